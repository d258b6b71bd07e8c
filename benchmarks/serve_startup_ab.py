"""A/B: `cbjax serve`'s time from launch to its URL line, with the engine core in its own process
and in a thread, alternated; prints each launch and writes them as JSON.

    PYTHONPATH=. python benchmarks/serve_startup_ab.py --model checkpoints/smollm2-135m-instruct \
        --rounds 3 --result-json bench_results/serve_startup_engine_process.json

The first launch may compile (a cold cache); the later ones read the compile cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_process import ServerProcess  # noqa: E402

SIDES = ["--engine-process", "--no-engine-process"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    launches = []
    for round_index in range(args.rounds):
        for flag in SIDES if round_index % 2 == 0 else reversed(SIDES):
            start = time.perf_counter()
            server = ServerProcess(Path(args.model), Path("/tmp/cbjax-serve-startup.log"),
                                   "--max-num-seqs", "16", "--max-model-len", "512", flag)
            ready = time.perf_counter() - start
            server.stop()
            launches.append({"flag": flag, "round": round_index, "ready_s": round(ready, 2)})
            print(json.dumps(launches[-1]), flush=True)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(launches, indent=1))


if __name__ == "__main__":
    main()
