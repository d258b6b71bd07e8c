"""How much of a step program's compile time is the sampler, the prompt logprobs and the penalty
state (issue 11): each program compiled whole and with those parts replaced by trivial stand-ins.

    PYTHONPATH=. python -m benchmarks.step_compile_parts --rounds 2 --out bench_results/step_compile_parts.json

Variants (cumulative): "whole"; "no sampler" (argmax, no logprobs); "no prompt logprobs" as well;
"no penalty state" as well (the step's history table left as it was). The outputs of the stand-ins
are wrong on purpose: only compile time is measured. Every variant compiles the smallest and the
largest program once per round, alternating, with the engine's XLA options and no cache; the
result is each variant's median compile seconds per program.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax.numpy as jnp

from cbjax.bench.common import write_json
from cbjax.worker import model_runner as runner_module
from cbjax.config import EngineConfig
from cbjax.engine.llm_engine import LLMEngine
from cbjax.worker.sample.logprobs import no_logprobs
from cbjax.worker.sample.sampler import SamplerOutput


def argmax_sampler(logits, tensors, penalty_state, num_logprobs):
    return SamplerOutput(jnp.argmax(logits, axis=-1).astype(jnp.int32), no_logprobs(logits.shape[0], num_logprobs))


def no_prompt_logprobs(compute_logits, hidden, targets, num_logprobs):
    return no_logprobs(hidden.shape[0], num_logprobs)


def unchanged_history(state, *_):
    return state


WHOLE = (runner_module.sample, runner_module.prompt_logprobs, runner_module.record_step_tokens)
VARIANTS = {
    "whole": WHOLE,
    "no sampler": (argmax_sampler, WHOLE[1], WHOLE[2]),
    "no sampler, no prompt logprobs": (argmax_sampler, no_prompt_logprobs, WHOLE[2]),
    "no sampler, no prompt logprobs, no penalty state": (argmax_sampler, no_prompt_logprobs, unchanged_history),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="step_compile_parts.json")
    args = parser.parse_args()
    runner = LLMEngine(EngineConfig(model=args.model, compilation_cache_dir=None), precompile=False).runner
    programs = list(dict.fromkeys(runner._step_shapes(runner.buckets).values()))
    chosen = [programs[0], programs[-1]]
    seconds: dict[str, dict[str, list[float]]] = {name: {str(b): [] for b in chosen} for name in VARIANTS}
    for round_index in range(args.rounds):
        names = list(VARIANTS) if round_index % 2 == 0 else list(reversed(VARIANTS))
        for name in names:
            runner_module.sample, runner_module.prompt_logprobs, runner_module.record_step_tokens = VARIANTS[name]
            for bucket in chosen:
                lowered = runner._lower(bucket)
                start = time.perf_counter()
                lowered.compile(compiler_options=runner.compiler_options or None)
                seconds[name][str(bucket)].append(time.perf_counter() - start)
    runner_module.sample, runner_module.prompt_logprobs, runner_module.record_step_tokens = WHOLE
    medians = {name: {bucket: round(statistics.median(times), 3) for bucket, times in per.items()} for name, per in seconds.items()}
    for name, per in medians.items():
        print(f"{name:50s}", per)
    write_json(args.out, {"load_average": os.getloadavg(), "rounds": args.rounds, "seconds": seconds, "median_s": medians})


if __name__ == "__main__":
    main()
