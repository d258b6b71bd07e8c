"""Sliding-window attention stops growing with context: `python -m benchmarks.sliding_window --out sw.json`.

Times one layer's attention, windowed and full, as the context grows, on every attention backend this
platform has (a GPU: pallas and xla; a CPU: cpp and xla), for a
decode batch and for a 512-token prompt chunk over a cached context. A windowed layer reads at most
the window's pages per query, so its time should stay flat while the full layer's grows with the
context (issue 39's benchmark). Medians of `--repeats` rounds of `--inner` back-to-back calls, both
variants of a row measured one after the other in this process; the JSON is rewritten after every row.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import pathlib

import jax
import jax.numpy as jnp

from benchmarks.kernels import LLAMA3_8B, TINY_CPU, Shapes, median_seconds, paged_batch
from cbjax.models.layers.attention import AttentionPlan, attention


def backends_here() -> list[str]:
    return ["pallas", "xla"] if jax.devices()[0].platform == "gpu" else ["cpp", "xla"]


def time_layer(backend: str, shapes: Shapes, requests: list[tuple[int, int]], window: int | None, dtype,
               repeats: int, inner: int) -> float:
    q, k_pages, v_pages, metadata = paged_batch(jax.random.key(0), shapes, requests, dtype)
    decode_only = all(q_len == 1 for q_len, _ in requests)
    plan = AttentionPlan(backend, decode_only=decode_only)
    fn = jax.jit(functools.partial(attention, sm_scale=0.1, plan=plan, sliding_window=window))
    return median_seconds(lambda: fn(q, k_pages, v_pages, metadata), repeats, inner)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--chunk", type=int, default=512, help="prompt-chunk tokens of the prefill rows")
    parser.add_argument("--backends", nargs="+", default=None, help="default: every one this platform has")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="small heads (CPU smoke run)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("sliding_window.json"))
    args = parser.parse_args()

    on_gpu = jax.devices()[0].platform == "gpu"
    shapes = TINY_CPU if args.tiny else LLAMA3_8B
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    result = {
        "benchmark": "sliding_window", "command": "python -m benchmarks.sliding_window " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if v not in (None, False)),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
        "shapes": {"q_heads": shapes.num_q_heads, "kv_heads": shapes.num_kv_heads, "head_dim": shapes.head_dim,
                   "block_size": shapes.block_size, "dtype": jnp.dtype(dtype).name},
        "window": args.window, "rows": [],
    }
    print(f"{'backend':8} {'workload':28} {'context':>7} {'full ms':>9} {'window ms':>9} {'full/window':>11}")
    for backend in args.backends or backends_here():
        try:
            measure_backend(backend, args, shapes, dtype, result)
        except ValueError as error:  # a backend without the window says so
            print(f"{backend:8} skipped: {error}")


def measure_backend(backend: str, args: argparse.Namespace, shapes: Shapes, dtype, result: dict) -> None:
    workloads = {f"decode x{b}": lambda c, b=b: [(1, c)] * b for b in args.batches}
    workloads[f"chunk {args.chunk} over context"] = lambda c: [(args.chunk, c)]
    for name, requests_at in workloads.items():
        for context in args.contexts:
            requests = requests_at(context)
            full, windowed = (time_layer(backend, shapes, requests, w, dtype, args.repeats, args.inner)
                              for w in (None, args.window))
            row = {"backend": backend, "workload": name, "context": context,
                   "full_ms": full * 1e3, "window_ms": windowed * 1e3, "full_over_window": full / windowed}
            result["rows"].append(row)
            args.out.write_text(json.dumps(result, indent=1))
            print(f"{backend:8} {name:28} {context:7} {full * 1e3:9.3f} {windowed * 1e3:9.3f} {full / windowed:11.2f}",
                  flush=True)

if __name__ == "__main__":
    main()
