"""Host CPU per step, before and after: `cbjax bench host` of two checkouts, alternated in one run.

    git worktree add --detach /tmp/cbjax-before <old commit>
    python -m benchmarks.host_ab --old /tmp/cbjax-before --rounds 2 --result-json bench_results/host_ab.json

Each round runs the old checkout's and this one's `cbjax bench host` (same workload, one repeat
each) one after the other, in alternating order, so both see the same machine load; the table
gives each setting's median over the rounds of the host CPU per step (the process's CPU time,
which the other processes on a shared machine barely move) and new / old. By default the old
checkout is one that builds every request's output every step (cumulative) and the new one runs
--output-kinds; with --same-output-kinds both run --output-kinds and each kind is compared with itself.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from cbjax.bench.common import print_table, write_json

SETTING = ["max_model_len", "variant", "num_running", "delay_ms"]


def run_bench(checkout: pathlib.Path, args: argparse.Namespace, extra: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "host.json"
        command = [
            sys.executable, "-m", "cbjax", "bench", "host", "--model", str(pathlib.Path(args.model).resolve()),
            "--num-running", *map(str, args.num_running), "--max-model-lens", *map(str, args.max_model_lens),
            "--delays-ms", *map(str, args.delays_ms), "--variants", *args.variants, "--async-scheduling", "on",
            "--engine-process", args.engine_process, "--repeats", str(args.repeats), "--result-json", str(path), *extra,
        ]
        env = os.environ | {"PYTHONPATH": str(checkout)}
        subprocess.run(command, cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(path.read_text())["runs"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="the checkout to compare against (e.g. a worktree of main)")
    p.add_argument("--new", default=str(pathlib.Path(__file__).resolve().parents[1]))
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-running", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--max-model-lens", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--delays-ms", type=float, nargs="+", default=[0.0, 5.0])
    p.add_argument("--variants", nargs="+", default=["greedy", "penalties+stop"])
    p.add_argument("--output-kinds", nargs="+", default=["final_only", "delta", "cumulative"], help="the new side's")
    p.add_argument("--same-output-kinds", action="store_true",
                   help="the old checkout has --output-kinds too: run it with the same ones and compare kind with kind")
    p.add_argument("--engine-process", choices=["off", "on"], default="off",
                   help="on: both sides time the engine core in its own process (its CPU per step)")
    p.add_argument("--repeats", type=int, default=1, help="repeats per side per round (cbjax bench host --repeats)")
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    sides = {"old": (pathlib.Path(args.old).resolve(), []),
             "new": (pathlib.Path(args.new).resolve(), ["--output-kinds", *args.output_kinds])}
    if args.same_output_kinds:
        sides["old"] = (sides["old"][0], sides["new"][1])
    runs = []
    for round_index in range(args.rounds):
        for side in (["old", "new"] if round_index % 2 == 0 else ["new", "old"]):
            checkout, extra = sides[side]
            for run in run_bench(checkout, args, extra):
                runs.append(run | {"side": side, "output_kind": run.get("output_kind", "cumulative"), "round": round_index})
            print(f"round {round_index}: {side} done", file=sys.stderr)
    rows = []
    settings = list(dict.fromkeys(tuple(r[k] for k in SETTING) for r in runs))
    for setting in settings:
        def median(side: str, kind: str, key: str = "host_cpu_ms_per_step") -> float | None:
            values = [r[key] for r in runs if tuple(r[k] for k in SETTING) == setting and r["side"] == side
                      and r["output_kind"] == kind]
            return statistics.median(values) if values else None

        row = dict(zip(SETTING, setting))
        if not args.same_output_kinds:
            row["old_cumulative"] = median("old", "cumulative")
        for kind in args.output_kinds:
            old_kind = kind if args.same_output_kinds else "cumulative"
            old, new = median("old", old_kind), median("new", kind)
            if args.same_output_kinds:
                row[f"old_{kind}"] = old
            row |= {f"new_{kind}": new, f"ratio_{kind}": new / old if new and old else None,
                    f"wall_new_{kind}": median("new", kind, "wall_ms_per_step")}
            if args.same_output_kinds:
                row[f"wall_old_{kind}"] = median("old", kind, "wall_ms_per_step")
        if not args.same_output_kinds:
            row["wall_old_cumulative"] = median("old", "cumulative", "wall_ms_per_step")
        rows.append(row)
    print_table(rows, list(rows[0]))
    write_json(args.result_json, {"rows": rows, "runs": runs, "args": vars(args)})


if __name__ == "__main__":
    main()
