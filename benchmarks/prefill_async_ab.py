"""Async scheduling on against off for a prompt arriving beside running decodes (issue 12's TTFT).

    python -m benchmarks.prefill_async_ab --result-json bench_results/prefill_async_ab.json

Two engines differing only in `async_scheduling` (16 seqs, 512 batched tokens), alternated over
--rounds, each running prefill_buckets_ab's prefill part: 15 requests decoding, then one prompt of
each length arrives; its TTFT in process. Prints medians and the off / on ratio of each round.
"""

from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.prefill_buckets_ab import prefill_run
from cbjax.bench.common import warm_up
from cbjax.bench.recorder import StepRecorder
from cbjax.config import EngineConfig
from cbjax.engine.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--prompt-lens", nargs="+", type=int, default=[64, 80, 100, 120, 140, 160, 180, 200])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    recorders = {}
    for name, flag in (("on", True), ("off", False)):
        config = EngineConfig(model=args.model, max_num_seqs=16, max_model_len=1024, max_num_batched_tokens=512,
                              compilation_cache_dir=".jax_cache", kv_cache_memory_bytes=1 << 30, async_scheduling=flag)
        recorders[name] = StepRecorder(LLMEngine(config, progress=False))
        warm_up(recorders[name])
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for i in range(args.rounds):
        for name in ("on", "off") if i % 2 == 0 else ("off", "on"):
            runs[name].append(prefill_run(recorders[name], args.prompt_lens, f"{name}-{i}"))
    medians = {name: statistics.median(r["median_ttft_ms"] for r in runs[name]) for name in runs}
    pairs = [off["median_ttft_ms"] / on["median_ttft_ms"] for on, off in zip(runs["on"], runs["off"])]
    result = {"median_ttft_ms": medians, "off_over_on_pairs": pairs, "runs": runs}
    print(json.dumps({"median_ttft_ms": medians, "off_over_on_pairs": pairs}))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
