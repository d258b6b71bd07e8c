"""Host cost of prefix caching per decode step: the block manager's work with caching on vs off.

No model: `num_requests` requests of `prompt_len` distinct tokens decode `steps` tokens each,
and every step does what the scheduler does per request (append the token, allocate, mark it
computed, register full blocks). Prints and writes the per-step medians and means and their difference,
to set beside a real decode step's time (cbjax bench throughput's mean_step_ms).

    python -m benchmarks.prefix_host_cost --num-requests 64 --result-json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from cbjax.core.kv.block_manager import BlockManager
from cbjax.core.request import Request
from cbjax.sampling_params import SamplingParams


def decode_step_times(enable_caching: bool, num_requests: int, prompt_len: int, steps: int, block_size: int) -> list[float]:
    params = SamplingParams()  # the real params: the block manager reads more of them than it once did
    num_blocks = num_requests * (-(-(prompt_len + steps) // block_size)) + 1
    manager = BlockManager(num_blocks, block_size, enable_caching=enable_caching)
    requests = [Request(str(i), [i * prompt_len + j for j in range(prompt_len)], params) for i in range(num_requests)]
    for request in requests:
        manager.allocate(request, prompt_len, manager.get_computed_blocks(request))
        request.num_computed_tokens = prompt_len
        manager.cache_full_blocks(request)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for request in requests:
            request.append_output_token(7)
            manager.allocate(request, 1)
            request.num_computed_tokens += 1
            manager.cache_full_blocks(request)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    shape = (args.num_requests, args.prompt_len, args.steps, args.block_size)
    result = {}
    for _ in range(3):  # interleaved rounds, every step of every round counted
        for name, enabled in (("on", True), ("off", False)):
            result.setdefault(name, []).extend(decode_step_times(enabled, *shape))
    # Medians and means: a block fills (and is hashed) on one decode step in block_size.
    summary = {}
    for stat in (statistics.median, statistics.mean):
        for name, times in result.items():
            summary[f"caching_{name}_step_us_{stat.__name__}"] = 1e6 * stat(times)
        summary[f"caching_cost_per_step_us_{stat.__name__}"] = (
            summary[f"caching_on_step_us_{stat.__name__}"] - summary[f"caching_off_step_us_{stat.__name__}"]
        )
    summary["args"] = vars(args)
    print(json.dumps(summary, indent=1))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=1)

if __name__ == "__main__":
    main()
