"""The C++ attention kernel built at -O3 (kernels_cpu.build.FLAGS) against -O2: build time and kernel time.

    PYTHONPATH=. python -m benchmarks.kernel_opt_level_ab --rounds 3

A cold start waits for this build (BENCHMARKS.md section 14), so a cheaper optimization level would
start sooner; this says what it would cost per call. Each round runs one fresh process per level,
alternating, each building into its own empty kernel cache (the build's wall time) and then timing
the jitted kernel (median of --calls) on three SmolLM2-shaped cases: 16 decodes over 608 positions,
64 decodes over 300, and one 256-token prompt chunk over 512 positions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CASES = {"decode 16 x 608": ([1] * 16, 608), "decode 64 x 300": ([1] * 64, 300), "prefill 256 over 512": ([256], 512)}


def child(level: str, calls: int) -> dict:
    """In a fresh process: build the kernel at `level`, then time it on CASES (ms per call)."""
    import kernels_cpu.build as build

    build.FLAGS = tuple(level if flag.startswith("-O") else flag for flag in build.FLAGS)
    start = time.perf_counter()
    build.build()
    build_s = time.perf_counter() - start

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_cpu import ragged_paged_attention_cpu
    from kernels_pallas.reference import AttentionMetadata

    kv_heads, q_heads, dim, block_size = 3, 9, 64, 16
    rng = np.random.default_rng(0)
    attend = jax.jit(lambda q, k, v, m: ragged_paged_attention_cpu(q, k, v, m, dim**-0.5))
    result = {"level": level, "build_s": build_s}
    for name, (q_lens, context) in CASES.items():
        blocks = -(-context // block_size)
        pool = jnp.asarray(rng.standard_normal((kv_heads, 1 + len(q_lens) * blocks, block_size, dim), np.float32))
        q = jnp.asarray(rng.standard_normal((sum(q_lens), q_heads, dim), np.float32))
        metadata = AttentionMetadata(
            slot_mapping=jnp.zeros(sum(q_lens), jnp.int32),
            query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
            seq_lens=jnp.full(len(q_lens), context, jnp.int32),
            block_tables=jnp.asarray((1 + np.arange(len(q_lens) * blocks, dtype=np.int32)).reshape(len(q_lens), blocks)),
        )
        attend(q, pool, pool, metadata).block_until_ready()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            attend(q, pool, pool, metadata).block_until_ready()
            times.append(time.perf_counter() - start)
        result[f"{name} ms"] = statistics.median(times) * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", nargs="+", default=["-O3", "-O2"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=150)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.calls)))
        return
    runs = []
    for round_index in range(args.rounds):
        for level in args.levels if round_index % 2 == 0 else list(reversed(args.levels)):
            with tempfile.TemporaryDirectory() as cache:
                command = [sys.executable, "-m", "benchmarks.kernel_opt_level_ab", f"--child={level}", "--calls", str(args.calls)]
                output = subprocess.run(command, env=os.environ | {"CBJAX_KERNEL_CACHE": cache}, capture_output=True,
                                        text=True, check=True).stdout
            runs.append(json.loads(output.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), flush=True)
    medians = {level: {key: statistics.median(run[key] for run in runs if run["level"] == level)
                       for key in runs[0] if key != "level"} for level in args.levels}
    print(json.dumps({"load_average": os.getloadavg(), "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
