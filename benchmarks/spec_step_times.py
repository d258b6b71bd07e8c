"""Where speculative decoding's time goes: `python -m benchmarks.spec_step_times [--ks 3 4 8]`.

Runs the copy workload of benchmarks/spec_decode.py (1 and 4 requests in flight) on an engine without
speculation and on one with n-gram speculation per k, every step made synchronous so each is timed
alone: the device step's wall time by bucket (decode steps, and the steps that verify drafts), and
the host time a step spends in the scheduler and the proposer. The ceiling of the speedup is
mean_acceptance_length * t_decode / t_verify (plus the host time's share).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from cbjax import LLM, SamplingParams
from benchmarks.spec_decode import copy_prompts


def timed(owner, name: str, into: list) -> None:
    """Wrap owner.name so each call's seconds are appended to `into`."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = inner(*args, **kwargs)
        into.append(time.perf_counter() - start)
        return result

    setattr(owner, name, wrapper)


def instrument(llm: LLM) -> dict:
    """Time every step's device call by (kind, bucket, verifies), and the scheduler and proposer."""
    core = llm.llm_engine.core
    runner = core.runner
    times: dict = collections.defaultdict(list)
    launch, dispatch = runner.launch, runner.dispatch
    verifying = [False]

    def noting_dispatch(scheduled):
        verifying[0] = bool(scheduled.spec_token_ids)
        return dispatch(scheduled)

    def synchronous_launch(bucket, packed, grammar_bitmask=None):
        start = time.perf_counter()
        result = launch(bucket, packed, grammar_bitmask)
        result.block_until_ready()
        times[("step", bucket.kind, bucket.num_tokens, bucket.num_reqs, "verifies" if verifying[0] else "")].append(time.perf_counter() - start)
        return result

    runner.launch, runner.dispatch = synchronous_launch, noting_dispatch
    timed(core.scheduler, "schedule", times["schedule"])
    timed(runner, "prepare", times["prepare"])
    if core.speculation is not None:
        timed(core.speculation, "propose", times["propose"])
    return times


def uninstrument(llm: LLM) -> None:
    core = llm.llm_engine.core
    for owner, name in ((core.runner, "launch"), (core.runner, "dispatch"), (core.runner, "prepare"), (core.scheduler, "schedule"),
                        (core.speculation, "propose")):
        if owner is not None:
            owner.__dict__.pop(name, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 4, 8])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    options = dict(max_num_seqs=32, max_model_len=1024, max_num_batched_tokens=256)
    configs = [("off", None)] + [(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k,
                                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4}) for k in args.ks]
    for name, spec in configs:
        llm = LLM(args.model, **options, speculative_config=spec)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        for batch in args.batches:
            prompts = copy_prompts(llm.get_tokenizer(), 2 * batch)
            llm.generate(prompts[:batch], params, use_tqdm=False)  # warm-up
            llm.reset_prefix_cache()
            times = instrument(llm)
            before = llm.get_stats()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False) if batch == len(prompts) else [
                o for first in range(0, len(prompts), batch) for o in llm.generate(prompts[first:first + batch], params, use_tqdm=False)]
            elapsed = time.perf_counter() - start
            after = llm.get_stats()
            num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            line = f"{name} @{batch}: {num_tokens / elapsed:.1f} tok/s (synchronous steps)"
            if spec is not None:
                drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
                accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
                line += f", mean acceptance length {1 + accepted / max(1, drafts):.2f}"
            print(line)
            for key, values in sorted(times.items(), key=str):
                if values:
                    print(f"    {key}: n={len(values)} median {1e3 * statistics.median(values):.2f} ms")
            uninstrument(llm)
        del llm


if __name__ == "__main__":
    main()
