"""One A/B harness: a named benchmark run on two commits, alternated round by round; medians and ratios.

    python -m benchmarks.ab --old 5b1fab4 --new HEAD --benchmark host --rounds 4 \\
        --result-json bench_results/ab_host.json [-- arguments that replace the benchmark's workload]
    python -m benchmarks.ab --old HEAD --new . --benchmark throughput     # `.`: the working tree, uncommitted edits too

Each side is a detached `git worktree` of its commit, made in a temporary folder and removed at the end
(a side given as an existing folder is used as it is). Every run is a fresh process of this checkout's
interpreter with the side's code first on sys.path (`python -P`, so the working folder is not put first:
checkpoints/ and other relative paths resolve in this repository, `import cbjax` in the side's tree).
Rounds alternate old-new, new-old, ... so both sides see the same machine load. Per setting the report
gives each side's median, new/old of the medians, and the median of the rounds' own new/old ratios
(steadier on a shared machine, whose speed moves from minute to minute; BENCHMARKS.md, "Method").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator

from cbjax.bench.common import print_table, write_json

REPO = pathlib.Path(__file__).resolve().parents[1]
MODEL = "checkpoints/smollm2-135m-instruct"

Metrics = dict[str, float]  # "setting | metric" -> value


def host_metrics(result: dict) -> Metrics:
    """`cbjax bench host`: host CPU and wall ms per step of each setting."""
    metrics = {}
    for run in result["runs"]:
        setting = (f"{run['num_running']} running, len {run['max_model_len']}, {run['variant']}, "
                   f"{run.get('output_kind', 'cumulative')}, {run['delay_ms']:g} ms device, "
                   f"engine process {run.get('engine_process', 'off')}")
        metrics[f"{setting} | host_cpu_ms_per_step"] = run["host_cpu_ms_per_step"]
        metrics[f"{setting} | wall_ms_per_step"] = run["wall_ms_per_step"]
    return metrics


def throughput_metrics(result: dict) -> Metrics:
    """`cbjax bench throughput`: each variant's output tokens/s and mean TTFT."""
    metrics = {}
    for variant, medians in result["medians"].items():
        metrics[f"{variant} | output_throughput"] = medians["output_throughput"]
        metrics[f"{variant} | mean_ttft_ms"] = medians["mean_ttft_ms"]
    return metrics


def startup_metrics(result: dict) -> Metrics:
    """benchmarks/llm_start.py: seconds of `import cbjax` and of `LLM()`."""
    return {"import cbjax | s": result["import_s"], "LLM() | s": result["llm_s"]}


def cpu_steps_metrics(result: dict) -> Metrics:
    """benchmarks/cpu_steps.py: each case's ms (one round per run)."""
    return {f"{name} | ms": statistics.median(values) for name, values in result["rounds"].items()}


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """A command that writes a result JSON, the workload it runs unless told otherwise, and what to compare."""

    argv: Callable[[str], list[str]]  # model -> the interpreter's arguments, before the workload
    workload: list[str]
    metrics: Callable[[dict], Metrics]
    warmup_rounds: int = 0  # rounds run first and not counted (caches filled on both sides)
    env: dict[str, str] = dataclasses.field(default_factory=dict)


BENCHMARKS = {
    # The issue-34 check: host time per step at 64 and 256 running requests against a 0 ms stand-in device.
    "host": Benchmark(
        argv=lambda model: ["-m", "cbjax", "bench", "host", "--model", model, "--repeats", "1"],
        workload=["--num-running", "64", "256", "--max-model-lens", "1024", "--delays-ms", "0",
                  "--variants", "greedy", "penalties+stop", "--async-scheduling", "on", "--output-kinds", "final_only"],
        metrics=host_metrics,
    ),
    # Whole-engine tokens/s on long prompts (chunked prefill, preemption), each side compiling its own steps.
    "throughput": Benchmark(
        argv=lambda model: ["-m", "cbjax", "bench", "throughput", "--model", model, "--repeats", "1"],
        workload=["--num-prompts", "32", "--input-len", "512", "--output-len", "64", "--range-ratio", "0.5",
                  "--max-num-seqs", "16", "--max-model-len", "1024", "--max-num-batched-tokens", "256",
                  "--kv-cache-memory-bytes", "268435456"],
        metrics=throughput_metrics,
        env={"CBJAX_DISABLE_COMPILE_CACHE": "1"},
    ),
    # The C++ attention kernel alone, one layer at SmolLM2's shapes: decodes, mixed steps and a prefill chunk.
    "cpp-attention": Benchmark(
        argv=lambda model: [str(REPO / "benchmarks" / "cpu_steps.py"), "--model", model, "--rounds", "1"],
        workload=["--only", "C++", "--repeats", "30"],
        metrics=cpu_steps_metrics,
        warmup_rounds=1,  # each side builds its C++ kernel once
    ),
    # Warm start: `import cbjax` and `LLM()` with the caches the warm-up round filled.
    "startup": Benchmark(
        argv=lambda model: [str(REPO / "benchmarks" / "llm_start.py"), "--model", model],
        workload=[],
        metrics=startup_metrics,
        warmup_rounds=1,
    ),
}


@contextlib.contextmanager
def checkout(commit: str, tree: pathlib.Path) -> Iterator[pathlib.Path]:
    """The tree to run: `commit` itself when it is a folder, else a detached worktree of it at `tree`, removed afterwards."""
    if pathlib.Path(commit).is_dir():
        yield pathlib.Path(commit).resolve()
        return
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{commit}^{{commit}}"],
                         check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), sha], check=True,
                   capture_output=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=True)


def describe(tree: pathlib.Path) -> str:
    """The commit a tree is at, and whether it has uncommitted edits."""
    sha = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                         text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"], check=True,
                           capture_output=True, text=True).stdout.strip()
    return f"{sha} with uncommitted edits" if dirty else sha


def run_once(benchmark: Benchmark, tree: pathlib.Path, model: str, workload: list[str], out: pathlib.Path) -> Metrics:
    """One fresh process of the benchmark with `tree`'s code; its metrics."""
    command = [sys.executable, "-P", *benchmark.argv(model), *workload, "--result-json", str(out)]
    env = os.environ | benchmark.env | {"PYTHONPATH": str(tree)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)}\nin {tree} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return benchmark.metrics(json.loads(out.read_text()))


def compare(rounds: list[dict[str, Metrics]]) -> list[dict]:
    """Per key: each side's median, new/old of the medians, the median of the rounds' ratios and how many rounds new was lower."""
    rows = []
    for key in rounds[0]["old"]:
        old = [r["old"][key] for r in rounds if key in r["old"] and key in r["new"]]
        new = [r["new"][key] for r in rounds if key in r["old"] and key in r["new"]]
        ratios = [n / o for n, o in zip(new, old) if o]
        setting, metric = key.rsplit(" | ", 1)
        rows.append({"setting": setting, "metric": metric, "old": statistics.median(old), "new": statistics.median(new),
                     "new/old": statistics.median(new) / statistics.median(old) if statistics.median(old) else None,
                     "median round ratio": statistics.median(ratios) if ratios else None,
                     "rounds new lower": f"{sum(n < o for n, o in zip(new, old))}/{len(new)}"})
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    workload = argv[argv.index("--") + 1:] if "--" in argv else None
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="commit (or folder) to compare against")
    parser.add_argument("--new", default="HEAD", help="commit (or folder; `.` is the working tree); default HEAD")
    parser.add_argument("--benchmark", required=True, choices=sorted(BENCHMARKS))
    parser.add_argument("--rounds", type=int, default=4, help="counted rounds, each one run per side")
    parser.add_argument("--model", default=MODEL, help="checkpoint both sides load (cbjax convert)")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    benchmark = BENCHMARKS[args.benchmark]
    workload = benchmark.workload if workload is None else workload
    model = str(pathlib.Path(args.model).resolve())
    rounds, runs = [], []
    with tempfile.TemporaryDirectory(prefix="cbjax-ab-") as folder, \
            checkout(args.old, pathlib.Path(folder) / "old") as old, checkout(args.new, pathlib.Path(folder) / "new") as new:
        trees = {"old": old, "new": new}
        commits = {side: describe(tree) for side, tree in trees.items()}
        for index in range(benchmark.warmup_rounds + args.rounds):
            measured = {}
            for side in ("old", "new") if index % 2 == 0 else ("new", "old"):
                load = os.getloadavg()[0]
                measured[side] = run_once(benchmark, trees[side], model, workload, pathlib.Path(folder) / f"{side}.json")
                runs.append({"round": index, "side": side, "load_average": load, "metrics": measured[side]})
                print(f"round {index}{' (warm-up)' * (index < benchmark.warmup_rounds)}: {side} done, load {load:.1f}",
                      file=sys.stderr)
            if index >= benchmark.warmup_rounds:
                rounds.append(measured)
    rows = compare(rounds)
    print_table(rows, list(rows[0]))
    print(f"old {commits['old']}, new {commits['new']}")
    write_json(args.result_json, {"benchmark": args.benchmark, "commits": commits, "workload": workload,
                                  "rows": rows, "runs": runs})


if __name__ == "__main__":
    main()
