"""The C++ packed matmul over float32, int8 and 4-bit weights, side by side at decode's row counts.

    PYTHONPATH=. python -m benchmarks.quant_kernels --result-json bench_results/quant_kernels.json
    PYTHONPATH=. python -m benchmarks.quant_kernels --kernels float32 int8 int4-g32   # a commit without int8 groups

SmolLM2-135M's 30 layers of projections (benchmarks/decode_dots_bandwidth.py's `projections`: q/k/v,
o, gate/up, down, weights [in, out]) through `packed_matmul_cpu` with the weights packed as the engine
packs them: float32 panels; int8 panels with one scale per column (quantization="int8") or per group of
32 inputs (GGUF's Q8_0), and with mins per group too ("int8-g32-mins": GGUF's Q5_1, Q5_K); 4-bit nibble
panels with scales and mins per group of 32 (quantization="int4-g32", GGUF's Q4_0/Q4_1), their scales and mins packed by panel as the engine packs them where N is whole panels
("int4-g32-rows": left as rows [K / G, N], as the kernel also takes them); "fp8": e4m3 panels with a scale per
column (an fp8 checkpoint's projections as stored). The weights are random (the
kernels' speed does not depend on the values). At each of --rows the kernels are timed alternately, --rounds
times (median of --calls each), in one process, so that load from other processes falls on all alike;
`over_float32` is float32's median ms over the kernel's.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from benchmarks.cpu_steps import median_ms
from benchmarks.decode_dots_bandwidth import HIDDEN, INTERMEDIATE, LAYERS, QKV, projections
from cbjax.bench.common import print_table, write_json
from kernels_cpu import pack_group_rows, pack_weight, packed_matmul_cpu
from kernels_cpu.quant4 import pack_nibbles

SHAPES = [(HIDDEN, QKV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)]  # [in, out] per layer
GROUP = 32
KERNELS = ("float32", "int8", "int8-g32", "int8-g32-mins", "int4-g32", "int4-g32-rows", "fp8")


def random_weight(rng: np.random.Generator, kernel: str, k: int, n: int) -> tuple[np.ndarray, ...]:
    """One [k, n] weight as `packed_matmul_cpu` takes it for `kernel`: (packed,) or (packed, scales[, mins])."""
    if kernel == "float32":
        return (pack_weight(rng.standard_normal((k, n), np.float32) * 0.02),)
    if kernel == "fp8":  # e4m3 codes (no NaN code), a scale per column: a checkpoint's fp8 weights as stored
        codes = rng.integers(0, 256, (k, n), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0
        return pack_weight(codes.view(ml_dtypes.float8_e4m3fn)), rng.uniform(1e-4, 2e-4, n).astype(np.float32)
    if kernel.startswith("int8"):
        scales = rng.uniform(1e-4, 2e-4, (n,) if kernel == "int8" else (k // GROUP, n)).astype(np.float32)
        beside = (scales, -16 * scales) if kernel.endswith("mins") else (scales,)
        return pack_weight(rng.integers(-127, 128, (k, n), dtype=np.int8)), *beside
    scales = rng.uniform(1e-3, 2e-3, (k // GROUP, n)).astype(np.float32)
    scales, mins = scales, -8 * scales
    if kernel != "int4-g32-rows":
        scales, mins = pack_group_rows(scales), pack_group_rows(mins)
    return pack_weight(pack_nibbles(rng.integers(0, 16, (k, n), dtype=np.uint8))), scales, mins


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--calls", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    weights = {kernel: [tuple(tuple(jnp.asarray(a) for a in random_weight(rng, kernel, k, n)) for k, n in SHAPES)
                        for _ in range(args.layers)] for kernel in args.kernels}
    step = jax.jit(functools.partial(projections, dot=lambda x, w: packed_matmul_cpu(x, *w)))
    nbytes = {kernel: sum(a.nbytes for layer in layers for w in layer for a in w) for kernel, layers in weights.items()}
    results = []
    for num_rows in args.rows:
        h = jax.random.normal(jax.random.key(0), (num_rows, HIDDEN), jnp.float32)
        times = {kernel: [] for kernel in args.kernels}
        for _ in range(args.rounds):
            for kernel in args.kernels:
                times[kernel].append(median_ms(lambda: step(h, weights[kernel]), args.calls))
        for kernel in args.kernels:
            ms = statistics.median(times[kernel])
            results.append({"kernel": kernel, "rows": num_rows, "ms": ms, "weight_mb": nbytes[kernel] / 1e6,
                            "gb_per_s": nbytes[kernel] / ms / 1e6,
                            "over_float32": statistics.median(times["float32"]) / ms if "float32" in times else None})
    print(f"{args.layers} layers of SmolLM2-135M projections, {jax.devices()[0].platform}")
    print_table(results, ["kernel", "rows", "ms", "weight_mb", "gb_per_s", "over_float32"])
    write_json(args.result_json, {"rows": results})


if __name__ == "__main__":
    main()
