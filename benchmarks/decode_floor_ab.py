"""The smallest decode bucket: 8 rows (today) against 16 (one compiled step fewer at start-up).

    PYTHONPATH=. python -m benchmarks.decode_floor_ab [--rounds 3] [--result-json FILE]

Two engines of the default LLM() shape (64 seqs, 512 batched tokens) in this process, one with
decode buckets from 8 rows, one from 16; each round runs the same greedy requests on both,
alternating, at 1, 4 and 8 concurrent requests (the sizes an 8-row bucket serves), 64 output tokens
each: wall seconds and output tok/s, medians and 16/8 ratios.
"""

from __future__ import annotations

import argparse
import functools
from unittest import mock

import cbjax.worker.compilation.buckets as buckets
import cbjax.worker.model_runner as runner_module
from benchmarks.alternate import alternate_generate, medians
from cbjax import LLM, SamplingParams
from cbjax.bench.common import write_json

CONCURRENCIES = (1, 4, 8)


def build(model: str, min_decode_reqs: int) -> LLM:
    floor = functools.partial(buckets.compute_buckets, min_decode_reqs=min_decode_reqs)
    with mock.patch.object(runner_module, "compute_buckets", floor):
        return LLM(model, compilation_cache_dir=".jax_cache")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    engines = {floor: build(args.model, floor) for floor in (8, 16)}
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1 + (7 * i + j) % 400 for j in range(24)]} for i in range(8)]
    workloads = {str(n): (lambda n=n: (prompts[:n], params)) for n in CONCURRENCIES}
    runs = alternate_generate(engines, workloads, args.rounds, order=(8, 16))
    result = {"runs": {f"{name}@{floor}": times for (name, floor), times in runs.items()}, "ratio_16_over_8": {}}
    for concurrency in CONCURRENCIES:
        old, new = medians(runs, str(concurrency), 8, 16)
        result["ratio_16_over_8"][concurrency] = round(new / old, 3)
        print(f"{concurrency} requests: 8-row floor {old:.2f} s, 16-row floor {new:.2f} s, 16/8 {new / old:.3f}")
    write_json(args.result_json, result)


if __name__ == "__main__":
    main()
