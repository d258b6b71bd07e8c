"""The engine core's host step alone, and beside a second busy Python process (two-core machines).

    python -m benchmarks.host_contention --runs 6

An engine core (EngineCore.step(), the stand-in device of `cbjax bench host`, 0 ms device)
steps 256 greedy requests to their end in this process, --runs times, with no front end: no step's
outputs are made. Then the same with a second such process started beside it (`--worker`), as the
front end of `--engine-process on` runs beside the core. It prints each
run's median wall time per decode step of all 256 requests, and the medians of the runs, as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from cbjax.bench.host import PASSAGE, add_host_parser, build_standin_engine, host_params, measure


def core_runs(model: str, runs: int, num_running: int = 256, max_model_len: int = 1024) -> list[float]:
    """Each run's median wall ms per decode step, with `cbjax bench host`'s prompt and output lengths."""
    parser = argparse.ArgumentParser()
    add_host_parser(parser.add_subparsers())
    args = parser.parse_args(["host", "--model", model, "--num-running", str(num_running), "--max-model-lens", str(max_model_len)])
    engine, timeline = build_standin_engine(args, max_model_len)
    core = engine.core  # stepped alone: the front end only queues the requests
    passage = engine.tokenizer.encode(PASSAGE)
    medians = []
    for run in range(runs):
        timeline.steps.clear()
        for i, params in enumerate(host_params(args.output_len, num_running, "greedy", "final_only", "together")):
            engine.add_request(f"r{run}-{i}", {"prompt_token_ids": passage[: args.prompt_len]}, params, None)
        while core.has_unfinished_requests():
            core.step()
        # (no outputs are made here: measure's token counts stay 0)
        medians.append(measure(timeline.steps, [], 0.0, num_running, "together")["wall_ms_per_step"])
    return medians


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--worker", action="store_true", help="(internal) the second process: step until killed")
    args = p.parse_args()
    if args.worker:
        while True:
            core_runs(args.model, 1)
    alone = core_runs(args.model, args.runs)
    worker = subprocess.Popen([sys.executable, __file__, "--model", args.model, "--worker"], stdout=subprocess.DEVNULL)
    try:
        time.sleep(15)  # its engine built and stepping
        beside = core_runs(args.model, args.runs)
    finally:
        worker.kill()
        worker.wait()
    print(json.dumps({"alone_ms_per_step": [round(x, 3) for x in alone],
                      "beside_a_busy_process_ms_per_step": [round(x, 3) for x in beside],
                      "median_alone": round(statistics.median(alone), 3),
                      "median_beside": round(statistics.median(beside), 3)}, indent=1))


if __name__ == "__main__":
    main()
