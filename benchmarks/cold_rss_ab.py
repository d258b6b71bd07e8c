"""Cold start with and without handing the compiling threads' freed heap back (issue 11), side by side.

Each run is a fresh process building `LLM(model)` with default options and empty caches (its own
temporary CBJAX_CACHE_DIR: no compiled steps, no weights cache, no kernel build); "keep" replaces
the runner's release_free_heap with a no-op, "release" is the engine as it is. The two alternate.
Reported per run: LLM() seconds, the time in compiling, and the process's peak RSS (getrusage,
this process alone, not the compiler it spawns for the C++ kernel).

    python benchmarks/cold_rss_ab.py --rounds 2 --out cold_rss_ab.json [--cpu-count 7]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

SETTINGS = ("keep", "release")


def child(model: str, setting: str, cpu_count: int | None) -> dict:
    import cbjax.worker.model_runner as runner_module
    from cbjax import LLM

    if cpu_count is not None:  # the runner compiles on os.cpu_count() threads: as on a machine with this many cores
        runner_module.os.cpu_count = lambda: cpu_count

    if setting == "keep":
        runner_module.release_free_heap = lambda: None
    phases = {}
    original = runner_module.ModelRunner.warm_up

    def timed_warm_up(self):
        phases["compiled_at_s"] = time.perf_counter() - start
        return original(self)

    runner_module.ModelRunner.warm_up = timed_warm_up
    start = time.perf_counter()
    LLM(model)
    return {"llm_s": time.perf_counter() - start, **phases,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="cold_rss_ab.json")
    parser.add_argument("--cpu-count", type=int, default=None,
                        help="compile on this many threads, as on a machine with that many cores (default: this one's)")
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.child, args.cpu_count)))
        return
    runs = {setting: [] for setting in SETTINGS}
    for _ in range(args.rounds):
        for setting in SETTINGS:
            with tempfile.TemporaryDirectory() as caches:
                env = {k: v for k, v in os.environ.items() if k not in ("CBJAX_DISABLE_COMPILE_CACHE", "CBJAX_KERNEL_CACHE")}
                cores = [] if args.cpu_count is None else ["--cpu-count", str(args.cpu_count)]
                out = subprocess.run([sys.executable, __file__, "--child", setting, "--model", args.model, *cores],
                                     env=env | {"CBJAX_CACHE_DIR": caches}, capture_output=True, text=True, check=True)
            runs[setting].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(setting, runs[setting][-1], flush=True)
    summary = {setting: {key: statistics.median(run[key] for run in r) for key in r[0]} for setting, r in runs.items()}
    result = {"command": " ".join(sys.argv), "load_average": os.getloadavg(), "runs": runs, "median": summary,
              "release_over_keep": {key: summary["release"][key] / summary["keep"][key] for key in summary["keep"]}}
    with open(args.out, "w") as file:
        json.dump(result, file, indent=1)
    print(json.dumps({k: result[k] for k in ("median", "release_over_keep", "load_average")}, indent=1))


if __name__ == "__main__":
    main()
