"""What JAX's dispatch of one compiled step costs on the host, alone: the stand-in device's step
(`cbjax bench host`'s, no device work) called with the runner's real arguments (every weight, the
small ones stacked as the engine sends them (weight_stacks.py), the KV pool, the penalty table, the
block table), against a jitted function of N small arrays. --unstacked: every weight its own array.

    PYTHONPATH=. python benchmarks/step_dispatch.py --model checkpoints/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.bench.host import add_host_parser, build_standin_engine


def per_call_us(call, state, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        state = call(state)
    jax.block_until_ready(state)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--unstacked", action="store_true", help="call with the model's weights one array each")
    args = parser.parse_args()
    host_parser = argparse.ArgumentParser()
    add_host_parser(host_parser.add_subparsers())
    host_args = host_parser.parse_args(["host", "--model", args.model, "--num-running", "256", "--max-model-lens", "1024"])
    engine, _ = build_standin_engine(host_args, 1024)
    runner = engine.runner
    bucket = max(runner.buckets, key=lambda b: b.num_reqs)
    step = runner.compiled[bucket]
    packed = np.zeros(runner.packed_size(bucket), np.int32)
    weights = runner.weights if args.unstacked else runner.step_weights
    step._compiled = None  # compiled again for the weights passed here
    state = step(weights, runner.kv_pool, runner.penalty_state, runner.last_sampled, runner.block_table, packed)[:4]
    compiled = step._compiled  # the jitted stand-in: donated state in, the same state out
    result = {
        "num_weights": len(runner.weights),
        "num_weight_arrays_passed": len(weights),
        "num_kv_arrays": len(jax.tree_util.tree_leaves(runner.kv_pool)),
        "step_call_us": per_call_us(lambda s: compiled(weights, *s, packed)[:4], state, args.calls),
    }
    for n in (4, 64, 340):
        arrays = [jnp.ones((8, 8)) for _ in range(n)]
        small = jax.jit(lambda *xs: xs[-1] + 1).lower(*arrays).compile()
        result[f"{n}_small_arrays_call_us"] = per_call_us(lambda s, small=small, arrays=arrays: small(*arrays[:-1], s),
                                                          arrays[-1], args.calls)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
