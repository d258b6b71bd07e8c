"""Times the skinny-dot prototype (skinny_dot.cc) on SmolLM2's 30 layers of projections, as
benchmarks/decode_dots_bandwidth.py times XLA's dots on the same shapes.

    [TILE_ROWS=12] python benchmarks/skinny_dot/run.py [ROWS ...]   (default 8 16 64; g++ with OpenMP, AVX-512)

Builds the prototype into a temporary folder (g++ -O3 -march=native -fopenmp), checks one
product against numpy, then prints ms, GB/s of weights and GFLOP/s at each number of rows on one
and two threads (median of 9 passes, each a ctypes call per projection).
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

HIDDEN, INTERMEDIATE, QKV, LAYERS = 576, 1536, 576 + 2 * 192, 30
ROWS = [int(r) for r in sys.argv[1:]] or [8, 16, 64]
TILE_ROWS = int(os.environ.get("TILE_ROWS", "8"))  # rows of sums a pass keeps in registers: 8 or 12


def build() -> ctypes.CDLL:
    library = pathlib.Path(tempfile.mkdtemp()) / "libskinny_dot.so"
    source = pathlib.Path(__file__).with_name("skinny_dot.cc")
    subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    lib = ctypes.CDLL(str(library))
    for function in (lib.skinny_matmul, lib.skinny_matmul_packed, lib.skinny_matmul_packed_bf16):
        function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.set_tile_rows(TILE_ROWS)
    return lib


def packed(w: np.ndarray) -> np.ndarray:
    """[K, N] -> [N / 32, K, 32]: each 32-column panel contiguous."""
    return np.ascontiguousarray(w.reshape(w.shape[0], -1, 32).transpose(1, 0, 2))


def main() -> None:
    lib = build()
    rng = np.random.default_rng(0)
    shapes = [(HIDDEN, QKV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)]
    layers = [[(rng.standard_normal(shape) * 0.02).astype(np.float32) for shape in shapes] for _ in range(LAYERS)]
    weight_bytes = sum(w.nbytes for layer in layers for w in layer)

    panels = [[packed(w) for w in layer] for layer in layers]
    # bfloat16 weights (rounded to nearest), packed the same way; the reference is their float32 value
    panels_bf16 = [[packed(w.astype(ml_dtypes.bfloat16)).view(np.uint16) for w in layer] for layer in layers]
    functions = {"[in, out]": lib.skinny_matmul, "packed panels": lib.skinny_matmul_packed,
                 "packed panels, bf16 weights": lib.skinny_matmul_packed_bf16}
    layouts = {"[in, out]": layers, "packed panels": panels, "packed panels, bf16 weights": panels_bf16}

    def matmul(x: np.ndarray, w: np.ndarray, y: np.ndarray, threads: int, layout: str) -> None:
        k = w.shape[0] if layout == "[in, out]" else w.shape[1]
        functions[layout](x.ctypes.data, w.ctypes.data, y.ctypes.data, x.shape[0], k, y.shape[1], threads)

    x = rng.standard_normal((11, HIDDEN)).astype(np.float32)
    for layout, weights in layouts.items():
        y = np.empty((11, 2 * INTERMEDIATE), np.float32)
        matmul(x, weights[0][2], y, 2, layout)
        reference = layers[0][2].astype(ml_dtypes.bfloat16).astype(np.float32) if "bf16" in layout else layers[0][2]
        print(f"{layout}: max |prototype - numpy| = {np.abs(y - x @ reference).max():.2e}")
    for rows in ROWS:
        inputs = {k: rng.standard_normal((rows, k)).astype(np.float32) for k in (HIDDEN, INTERMEDIATE)}
        outputs = [[np.empty((rows, w.shape[1]), np.float32) for w in layer] for layer in layers]
        for layout, weights, threads in [(layout, weights, threads) for layout, weights in layouts.items()
                                         for threads in (1, 2)]:
            def once() -> None:
                for layer, outs, originals in zip(weights, outputs, layers):
                    for w, out, original in zip(layer, outs, originals):
                        matmul(inputs[original.shape[0]], w, out, threads, layout)

            once()
            times = []
            for _ in range(9):
                start = time.perf_counter()
                once()
                times.append(time.perf_counter() - start)
            ms = statistics.median(times) * 1e3
            nbytes = weight_bytes // 2 if "bf16" in layout else weight_bytes
            print(f"{layout}, {rows} rows, {threads} thread(s): {ms:.1f} ms, {nbytes / ms / 1e6:.1f} GB/s, "
                  f"{2 * rows * weight_bytes / 4 / ms / 1e6:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
