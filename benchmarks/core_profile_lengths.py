"""Where the engine core's host step goes at each max_model_len: cProfile's self time per step, side by side.

    PYTHONPATH=. python -m benchmarks.core_profile_lengths --max-model-lens 1024 8192 --runs 3

For each length, the core alone of benchmarks/host_contention.py (256 greedy requests, 0 ms stand-in
device, no front end) runs --runs times, its steps (not the engine's build) under cProfile. Prints, as JSON, each
length's profiled seconds per step and the --top functions by self time per step (microseconds), so a
function whose time grows with max_model_len shows as a row that grows across the columns.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats

from benchmarks.host_contention import core_runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    p.add_argument("--max-model-lens", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    per_step: dict[int, dict[str, float]] = {}
    for max_model_len in args.max_model_lens:
        profile = cProfile.Profile()
        core_runs(args.model, args.runs, max_model_len=max_model_len, profile=profile)
        stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive calls, self s, cumulative s, callers)
        steps = next(calls for (file, _, name), (calls, *_) in stats.items()
                     if name == "step" and file.endswith("engine/engine.py"))
        per_step[max_model_len] = {f"{file.rsplit('/', 1)[-1]}:{name}": 1e6 * self_s / steps
                                   for (file, _, name), (_, _, self_s, _, _) in stats.items()}
    first = per_step[args.max_model_lens[0]]
    top = sorted(first, key=first.get, reverse=True)[: args.top]
    print(json.dumps({
        "us_per_step_total": {length: round(sum(times.values()), 1) for length, times in per_step.items()},
        "top_self_us_per_step": {name: [round(per_step[length].get(name, 0.0), 1) for length in args.max_model_lens] for name in top},
        "max_model_lens": args.max_model_lens,
    }, indent=1))


if __name__ == "__main__":
    main()
