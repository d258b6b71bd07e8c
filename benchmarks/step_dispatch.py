"""What JAX's dispatch of one compiled step costs on the host, alone: the stand-in device's step
(`cbjax bench host`'s, no device work) called with the runner's real arguments (every weight as the
engine sends it, the KV pool, the penalty table, the block table), alternated in blocks with the same
call passing the weights another way, at the smallest and largest decode steps and the largest
prompt step; and a jitted function of N small arrays. The other way (--compare):
- stacked: every weight as its own array, against the small ones stacked (weight_stacks.py);
- fused: the checkpoint's separate q/k/v and gate/up kernels (fused_projections=False, loaded
  beside the engine's model), against the fused ones the engine serves.

    PYTHONPATH=. python benchmarks/step_dispatch.py --model checkpoints/smollm2-135m-instruct --compare stacked
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from flax import nnx

from cbjax.bench.host import add_host_parser, build_standin_engine
from cbjax.bench.standin_device import StandInStep
from cbjax.worker.weight_stacks import WeightStacks


def per_call_us(call, state, calls: int, times: list[float]):
    """Call `calls` times, threading the state through; append the microseconds per call to `times`."""
    start = time.perf_counter()
    for _ in range(calls):
        state = call(state)
    jax.block_until_ready(state)
    times.append((time.perf_counter() - start) / calls * 1e6)
    return state


def unfused_step_weights(engine) -> list:
    """The step's weights as the engine would send them with the checkpoint's separate projections."""
    from cbjax.checkpoint.loader import load_model

    runner = engine.runner
    packed = any(leaf.ndim == 3 for leaf in runner.weights)  # the CPU kernel's layout (LLMEngine's pack_for_cpu)
    model, _ = load_model(engine.config.model, dtype=str(runner.weights[0].dtype), activation_dtype="float32",
                          pack_for_cpu=packed, fused_projections=False)
    weights = jax.tree_util.tree_leaves(nnx.state(model))
    return WeightStacks.of(weights).stack(weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--compare", choices=["stacked", "fused"], default="stacked",
                        help="the way set beside the engine's own (see above)")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed block")
    parser.add_argument("--rounds", type=int, default=40, help="blocks per way of passing the weights, alternated")
    args = parser.parse_args()
    host_parser = argparse.ArgumentParser()
    add_host_parser(host_parser.add_subparsers())
    host_args = host_parser.parse_args(["host", "--model", args.model, "--num-running", "256", "--max-model-lens", "1024"])
    engine, _ = build_standin_engine(host_args, 1024)
    runner = engine.runner
    state = (runner.kv_pool, runner.penalty_state, runner.last_sampled, runner.block_table)
    if args.compare == "stacked":
        ways = {"stacked": runner.step_weights, "unstacked": runner.weights}
    else:
        ways = {"fused": runner.step_weights, "unfused": unfused_step_weights(engine)}
    new, old = ways
    result = {
        "compare": args.compare,
        "num_weights": len(runner.weights),
        "num_weight_arrays_passed": {way: len(weights) for way, weights in ways.items()},
        "num_kv_arrays": len(jax.tree_util.tree_leaves(runner.kv_pool)),
        "by_bucket": {},
    }
    # The smallest and largest decode steps and the largest prompt step: the packed inputs' size differs.
    decode = sorted((b for b in runner.buckets if b.kind == "decode"), key=lambda b: b.num_reqs)
    mixed = max((b for b in runner.buckets if b.kind == "mixed"), key=lambda b: b.num_tokens)
    for bucket in (decode[0], decode[-1], mixed):
        packed = np.zeros(runner.packed_size(bucket), np.int32)
        # The stand-in's jitted step (donated state in, the same state out), compiled for each way.
        compiled = {way: jax.jit(StandInStep._step, donate_argnums=(1, 2, 3, 4)).lower(weights, *state, packed).compile()
                    for way, weights in ways.items()}
        times: dict[str, list[float]] = {way: [] for way in ways}
        for round_index in range(args.rounds):
            for way in (ways if round_index % 2 == 0 else reversed(list(ways))):
                state = per_call_us(lambda s, way=way, packed=packed: compiled[way](ways[way], *s, packed),
                                    state, args.calls, times[way])
        result["by_bucket"][f"{bucket.kind} {bucket.num_tokens} tokens {bucket.num_reqs} rows"] = {
            "step_call_us_median": {way: round(statistics.median(ts), 1) for way, ts in times.items()},
            # Each round's two blocks ran back to back: their ratio sees one machine state (this machine's
            # speed moves 1.5x from minute to minute), and the median of the rounds' ratios is the comparison.
            f"{new}_over_{old}_median_of_rounds": round(statistics.median(
                ours / theirs for ours, theirs in zip(times[new], times[old])), 3),
        }
    for n in (4, 64, 340):
        arrays = [jnp.ones((8, 8)) for _ in range(n)]
        small = jax.jit(lambda *xs: xs[-1] + 1).lower(*arrays).compile()
        block: list[float] = []
        per_call_us(lambda s, small=small, arrays=arrays: small(*arrays[:-1], s), arrays[-1], args.calls, block)
        result[f"{n}_small_arrays_call_us"] = round(block[0], 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
