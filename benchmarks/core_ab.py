"""The engine core's host step, before and after: two checkouts' cores alternated, round by round.

    git worktree add --detach /tmp/cbjax-before <old commit>
    PYTHONPATH=. python benchmarks/core_ab.py --old /tmp/cbjax-before --num-running 16 64 256 --rounds 6

Each round starts one process per checkout, in alternating order (this script, run with that
checkout's package): host_contention.core_runs, an engine core (LLMEngine.send_progress(), the
stand-in device of `cbjax bench host`, 0 ms device, no front end) stepping --num-running greedy
requests (--prompt-len, --output-len) to their end, --runs times; each run's median wall time per
decode step of all of them (at 0 ms device, all of it host time). Longer outputs than `cbjax bench host`'s default give more steady
steps per run. A round's ratio is the mean of its new runs over the mean of its old runs; the
comparison is the median of the rounds' ratios (this machine's speed moves 1.5-2x from minute to
minute; two processes started back to back see about the same machine).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve()


def run_side(checkout: pathlib.Path, args: argparse.Namespace, num_running: int) -> list[float]:
    command = [sys.executable, str(HERE), "--worker", "--model", str(pathlib.Path(args.model).resolve()),
               "--num-running", str(num_running), "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
               "--runs", str(args.runs)]
    env = os.environ | {"PYTHONPATH": str(checkout)}
    done = subprocess.run(command, cwd=checkout, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", help="the old checkout (a git worktree)")
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    p.add_argument("--num-running", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--prompt-len", type=int, default=32, help="at most the bench passage's 148 tokens")
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--runs", type=int, default=2, help="runs per process")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--result-json")
    p.add_argument("--worker", action="store_true", help="(internal) one side's runs, printed as JSON")
    args = p.parse_args()
    if args.worker:
        from host_contention import core_runs  # (this folder is first on sys.path; cbjax is the checkout's)

        medians = core_runs(args.model, args.runs, args.num_running[0], prompt_len=args.prompt_len, output_len=args.output_len)
        print(json.dumps([round(ms, 3) for ms in medians]))
        return
    if args.old is None:
        p.error("--old is required: the checkout to compare with")
    sides = {"old": pathlib.Path(args.old).resolve(), "new": HERE.parent.parent}
    result = {"args": vars(args), "by_num_running": {}}
    for num_running in args.num_running:
        rounds = []
        for index in range(args.rounds):
            order = ["old", "new"] if index % 2 == 0 else ["new", "old"]
            rounds.append({side: run_side(sides[side], args, num_running) for side in order})
        ratios = [statistics.mean(r["new"]) / statistics.mean(r["old"]) for r in rounds]
        summary = {
            "median_of_round_ratios_new_over_old": round(statistics.median(ratios), 3),
            "round_ratios": [round(ratio, 3) for ratio in ratios],
            "rounds_new_faster": sum(ratio < 1 for ratio in ratios),
            "median_ms_new": statistics.median(ms for r in rounds for ms in r["new"]),
            "median_ms_old": statistics.median(ms for r in rounds for ms in r["old"]),
            "runs": rounds,
        }
        result["by_num_running"][str(num_running)] = summary
        print(num_running, {k: v for k, v in summary.items() if k != "runs"}, flush=True)
    if args.result_json:
        pathlib.Path(args.result_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
