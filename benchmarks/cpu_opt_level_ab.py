"""XLA:CPU's LLVM optimization level for the step programs: 1 (cbjax's choice) against XLA's default 2.

    PYTHONPATH=. python -m benchmarks.cpu_opt_level_ab [--rounds 3] [--result-json FILE]

Two engines of the default LLM() shape in this process, one compiled at each level with no
compilation cache (so each compile is timed whole: `compile_s` is its precompile, warm-up
included). Each round then runs the same greedy requests on both, alternating which goes first,
at four workload shapes: 16 and 64 requests, short (32-token prompts, 32 out) and long
(384-token prompts, 96 out). Prints wall seconds (medians) and level-1/level-2 ratios.
"""

from __future__ import annotations

import argparse
import os
import time
from unittest import mock

import numpy as np

import cbjax.worker.compilation.compile_cache as compile_cache
from benchmarks.alternate import alternate_generate, medians
from cbjax import LLM, SamplingParams
from cbjax.bench.common import write_json

SHAPES = {  # name: (requests, prompt tokens, output tokens)
    "16 short": (16, 32, 32),
    "64 short": (64, 32, 32),
    "16 long": (16, 384, 96),
    "64 long": (64, 384, 96),
}


def build(model: str, level: int) -> tuple[LLM, float]:
    with mock.patch.object(compile_cache, "CPU_COMPILER_OPTIONS", {"xla_backend_optimization_level": level}):
        start = time.perf_counter()
        llm = LLM(model, compilation_cache_dir=None)
        return llm, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    built = {level: build(args.model, level) for level in (1, 2)}  # level 1 first: it pays the first-use costs
    engines = {level: llm for level, (llm, _) in built.items()}
    rng = np.random.default_rng(0)

    def workload(num: int, prompt_len: int, output_len: int):
        prompts = [{"prompt_token_ids": rng.integers(1, 40000, prompt_len).tolist()} for _ in range(num)]
        return prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)

    workloads = {shape: (lambda sizes=sizes: workload(*sizes)) for shape, sizes in SHAPES.items()}
    runs = alternate_generate(engines, workloads, args.rounds, order=(2, 1))
    result = {
        "load_average": os.getloadavg(),
        "llm_construction_s": {level: round(seconds, 2) for level, (_, seconds) in built.items()},
        "runs": {f"{shape} @ level {level}": times for (shape, level), times in runs.items()},
        "ratio_level1_over_level2": {},
    }
    print(f"LLM() without a cache: level 2 {built[2][1]:.1f} s, level 1 {built[1][1]:.1f} s")
    for shape in SHAPES:
        old, new = medians(runs, shape, 2, 1)
        result["ratio_level1_over_level2"][shape] = round(new / old, 3)
        print(f"{shape}: level 2 {old:.2f} s, level 1 {new:.2f} s, 1/2 {new / old:.3f}")
    write_json(args.result_json, result)


if __name__ == "__main__":
    main()
