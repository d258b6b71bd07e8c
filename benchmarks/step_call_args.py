"""What launching a compiled step costs the host for its arguments alone, by how many there are.

    PYTHONPATH=. python -m benchmarks.step_call_args --result-json bench_results/step_call_args.json

A step is one call of an executable compiled ahead (`jax.jit(...).lower(...).compile()`) with the
weights (SmolLM2-135M: 276 arrays), the KV pool (60 arrays, 2 per layer, donated and handed back)
and one packed int32 input. Each setting here compiles a step that does no work on arrays of 4
floats with that many weights and pool arrays, and times its calls: what is left is JAX's own
dispatch (checking each argument, donating each pool buffer, wrapping each output), which a real
step pays on top of its work, on any device. Settings alternate over --rounds; medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from cbjax.bench.common import print_table, write_json

# (weights, pool arrays): SmolLM2-135M's counts, each part alone, and a pool stacked over layers.
SETTINGS = [(276, 60), (276, 0), (0, 60), (276, 2), (0, 2), (0, 0)]


def time_calls(num_weights: int, num_pool: int, calls: int) -> float:
    """Median seconds per call of a no-op compiled step with these arguments (the pool donated)."""

    def step(weights, pool, packed):
        return pool, packed + 1

    weights = [jnp.ones((4,)) for _ in range(num_weights)]
    pool = [jnp.ones((4,)) for _ in range(num_pool)]
    packed = jnp.zeros((8,), jnp.int32)
    compiled = jax.jit(step, donate_argnums=(1,)).lower(weights, pool, packed).compile()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        pool, _ = compiled(weights, pool, packed)
        times.append(time.perf_counter() - start)
    return statistics.median(times[calls // 5 :])  # the first calls warm up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    runs = [
        {"weights": w, "pool_arrays": k, "round": r, "us_per_call": time_calls(w, k, args.calls) * 1e6}
        for r in range(args.rounds) for w, k in (SETTINGS if r % 2 == 0 else SETTINGS[::-1])
    ]
    rows = [
        {"weights": w, "pool_arrays": k,
         "us_per_call": statistics.median(run["us_per_call"] for run in runs if (run["weights"], run["pool_arrays"]) == (w, k))}
        for w, k in SETTINGS
    ]
    print_table(rows, ["weights", "pool_arrays", "us_per_call"])
    write_json(args.result_json, {"command": "python -m benchmarks.step_call_args", "args": vars(args), "runs": runs, "medians": rows})


if __name__ == "__main__":
    main()
