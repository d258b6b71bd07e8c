"""Do steps run slower on weights mapped from the weights cache than on weights in XLA's own memory?

    python benchmarks/mapped_weights_ab.py [--rounds 20]

One process, one engine (its weights mapped from ~/.cache/cbjax/weights, the default), and a copy
of every weight array made by XLA. The same compiled steps (decode of 16 and 64 rows, mixed 64 and
512 tokens: short and long batches) run alternately on the two weight sets; prints the median step
time of each and their ratio as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from cbjax import LLM
from cbjax.worker.compilation.buckets import Bucket
from cbjax.worker.packing import pack

MODEL = "checkpoints/smollm2-135m-instruct"
BUCKETS = [Bucket("decode", 16, 16), Bucket("decode", 64, 64), Bucket("mixed", 64, 64), Bucket("mixed", 512, 64)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    runner = LLM(MODEL).llm_engine.runner
    weight_sets = {"mapped": runner.weights, "xla_copy": [jnp.array(w, copy=True) for w in runner.weights]}
    jax.block_until_ready(weight_sets["xla_copy"])
    result = {}
    for bucket in BUCKETS:
        step, packed = runner.compiled[bucket], pack(runner._host_inputs(bucket))
        times = {name: [] for name in weight_sets}
        for _ in range(args.rounds):
            for name, weights in weight_sets.items():
                start = time.perf_counter()
                runner.kv_pool, runner.penalty_state, out = step(weights, runner.kv_pool, runner.penalty_state, packed)
                out.block_until_ready()
                times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        result[f"{bucket.kind}_{bucket.num_tokens}"] = {f"{name}_ms": round(m, 2) for name, m in medians.items()} | {
            "mapped_over_copy": round(medians["mapped"] / medians["xla_copy"], 3)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
