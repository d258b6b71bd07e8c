"""XLA:CPU's bf16 weight dots against torch's (oneDNN) on the same machine, in one process.

    python -m benchmarks.cpu_dots --result-json bench_results/cpu_dots.json

The dot that dominates a SmolLM2 step: activations [M, 576] (float32, cast to bf16) times a bf16
weight [576, 1536] with float32 results, as cbjax runs it (`jnp.dot(..., preferred_element_type=
float32)` inside a jit), against `torch.nn.Linear` in bf16 (vLLM-CPU's path), at the row counts
of decode (2-64) and prefill (256) steps. Needs torch (the `ref` extra); medians of 5 x 200 calls.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np


def median_us(fn, repeats: int = 5, calls: int = 200) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn()
        if hasattr(result, "block_until_ready"):
            result.block_until_ready()
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times)) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_dots", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 8, 16, 32, 64, 256])
    parser.add_argument("--in-features", type=int, default=576)
    parser.add_argument("--out-features", type=int, default=1536)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--result-json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    import torch  # the `ref` extra; only this benchmark needs it

    torch.set_num_threads(args.torch_threads)
    k, n = args.in_features, args.out_features
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(k, n)).astype(np.float32)
    w_jax = jnp.asarray(weight).astype(jnp.bfloat16)
    dot = jax.jit(lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32))
    linear = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(weight.T.copy()))
    results = []
    with torch.inference_mode():
        for m in args.rows:
            x = rng.normal(size=(m, k)).astype(np.float32)
            x_jax, x_torch = jnp.asarray(x), torch.from_numpy(x).to(torch.bfloat16)
            xla_us = median_us(lambda: dot(x_jax, w_jax))
            torch_us = median_us(lambda: linear(x_torch))
            flops = 2 * m * k * n
            row = {"rows": m, "xla_us": xla_us, "torch_us": torch_us,
                   "xla_gflops": flops / xla_us / 1e3, "torch_gflops": flops / torch_us / 1e3}
            results.append(row)
            print(f"M={m:4d}  XLA {xla_us:8.1f} us {row['xla_gflops']:6.1f} GFLOP/s | torch {torch_us:8.1f} us "
                  f"{row['torch_gflops']:6.1f} GFLOP/s | XLA / torch time {xla_us / torch_us:.2f}x", flush=True)
    if args.result_json:
        args.result_json.write_text(json.dumps({"shape": [k, n], "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
