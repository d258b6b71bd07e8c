"""Garbage-collector pauses in a serving loop, with the start-up heap frozen (cbjax.heap.freeze_gc_heap) and not.

    PYTHONPATH=. python -m benchmarks.gc_freeze_ab --repeats 3 --result-json bench_results/gc_freeze_ab.json

`cbjax bench host`'s stand-in engine (the real host loop against a device whose step takes
--delay-ms), --num-running requests streamed as a server streams them (DELTA outputs), with
penalties and stop strings. Runs alternate between the heap as start-up left it and the heap
frozen (gc.freeze after a gc.collect; gc.unfreeze after the run), and report per run: the median
and the slowest wall time per step over the steps where every request decodes, and the
collector's own time by generation (gc.callbacks), in ms per step and its longest pause.
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import time
from typing import Any

from cbjax.bench.common import environment, print_table, write_json
from cbjax.bench.host import add_host_parser, build_standin_engine, run_host


class GcTimer:
    """Adds up each generation's collection time while installed in gc.callbacks."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = collections.defaultdict(float)
        self.longest: dict[int, float] = collections.defaultdict(float)
        self.count: dict[int, int] = collections.defaultdict(int)
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        generation, elapsed = info["generation"], time.perf_counter() - self._start
        self.seconds[generation] += elapsed
        self.longest[generation] = max(self.longest[generation], elapsed)
        self.count[generation] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--num-running", type=int, default=256)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--output-len", type=int, default=256, help="long enough for a full collection to come round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    host_parser = argparse.ArgumentParser()
    add_host_parser(host_parser.add_subparsers())
    host_args = host_parser.parse_args(["host", "--model", args.model, "--num-running", str(args.num_running),
                                        "--output-len", str(args.output_len)])
    engine, timeline = build_standin_engine(host_args, 1024)
    run_host(engine, timeline, 16, host_args.prompt_len, 16, "penalties+stop", 0.0)  # warm-up
    runs = []
    for repeat in range(args.repeats):
        for frozen in (False, True) if repeat % 2 == 0 else (True, False):
            timer = GcTimer()
            if frozen:
                gc.collect()
                gc.freeze()
            gc.callbacks.append(timer)
            try:
                run = run_host(engine, timeline, args.num_running, host_args.prompt_len, args.output_len,
                               "penalties+stop", args.delay_ms / 1e3, "on", "delta")
            finally:
                gc.callbacks.remove(timer)
                gc.unfreeze()
            steps = run["num_steps"]
            runs.append({"frozen": frozen, "delay_ms": args.delay_ms, "num_running": args.num_running,
                         "wall_ms_per_step": run["wall_ms_per_step"], "max_wall_ms_per_step": run["max_wall_ms_per_step"],
                         "host_cpu_ms_per_step": run["host_cpu_ms_per_step"], "num_steps": steps,
                         **{f"gc{g}_ms_per_step": timer.seconds[g] / steps * 1e3 for g in range(3)},
                         **{f"gc{g}_count": timer.count[g] for g in range(3)},
                         "gc2_longest_ms": timer.longest[2] * 1e3})
            print_table(runs[-1:], list(runs[-1]))
    medians = [{"frozen": frozen} | {k: statistics.median(r[k] for r in runs if r["frozen"] == frozen)
                                     for k in runs[0] if k not in ("frozen",)} for frozen in (False, True)]
    print("\nmedians:")
    print_table(medians, list(medians[0]))
    write_json(args.result_json, {"medians": medians, "runs": runs, **environment(host_args)})


if __name__ == "__main__":
    main()
