"""Where cbjax's time goes on the shared-prefix workload of `cbjax.bench.peers --dataset prefix` (issue 13).

    PYTHONPATH=. python -m benchmarks.prefix_step_split [--rounds 2] [--result-json FILE]

The peers benchmark's cbjax side (the same requests and engine options: 32 prompts, 4 prefixes of
512 tokens, questions of 32, 64 output tokens, range ratio 0.5; 16 seats, 256 batched tokens, 4 GiB
pool; seeded sampling, ignore_eos), each round from an empty prefix cache after a 4-request
warm-up, with every step timed (cbjax.bench.recorder.StepRecorder) and summed by its bucket; and the
prompt tokens computed against those found in the cache.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from cbjax import LLM, SamplingParams
from cbjax.bench.common import write_json
from cbjax.bench.dataset import SyntheticRequest, prefix_requests
from cbjax.bench.recorder import StepRecorder


def run(engine, step, requests, tag: str) -> tuple[float, int]:
    """Queue all at once, step to the end: (seconds, prompt tokens found in the cache)."""
    for i, request in enumerate(requests):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": request.prompt_token_ids},
                           SamplingParams(temperature=1.0, max_tokens=request.output_len, ignore_eos=True, seed=i))
    cached, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        cached += sum(output.num_cached_tokens for output in step() if output.finished)
    return time.perf_counter() - start, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    requests = prefix_requests(32, 4, 512, 32, 64, 0.5, 49152, 0)
    llm = LLM(args.model, max_num_seqs=16, max_model_len=1024, max_num_batched_tokens=256,
              compilation_cache_dir=".jax_cache", kv_cache_memory_bytes=4 << 30)
    engine = llm.llm_engine
    run(engine, engine.step, [SyntheticRequest(r.prompt_token_ids[:16], 4) for r in requests[:4]], "warm-")
    prompt_tokens, output_tokens = (sum(len(r.prompt_token_ids) for r in requests), sum(r.output_len for r in requests))
    rounds = []
    for index in range(args.rounds):
        llm.reset_prefix_cache()
        recorder = StepRecorder(engine)
        elapsed, cached = run(engine, recorder.step, requests, f"r{index}-")
        steps = collections.defaultdict(list)
        for record in recorder.records:
            steps[f"{record.kind} {record.bucket_tokens}"].append((record.end - record.start, record.scheduled_tokens))
        rounds.append({
            "elapsed_s": elapsed, "output_tok_s": output_tokens / elapsed, "num_steps": len(recorder.records),
            "prompt_tokens": prompt_tokens, "cached_prompt_tokens": cached, "computed_prompt_tokens": prompt_tokens - cached,
            "steps": {bucket: {"count": len(v), "seconds": sum(s for s, _ in v), "median_ms": 1e3 * statistics.median(s for s, _ in v),
                               "tokens": sum(t for _, t in v)} for bucket, v in sorted(steps.items())},
        })
        print({k: v for k, v in rounds[-1].items() if k != "steps"}, flush=True)
        for bucket, row in rounds[-1]["steps"].items():
            print(f"   {bucket}: {row}", flush=True)
    write_json(args.result_json, {"rounds": rounds})


if __name__ == "__main__":
    main()
