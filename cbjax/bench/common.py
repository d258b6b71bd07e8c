"""What every `cbjax bench` command shares: dataset and output flags, the engine, tables and JSON."""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
from typing import Any

from cbjax.entrypoints.cli.args import engine_options


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's random-dataset flags, and the shared-prefix dataset's."""
    parser.add_argument("--dataset", default="random", choices=["random", "prefix"],
                        help="prefix: prompts = one of --num-prefixes shared prefixes + a question")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in L*(1-r)..L*(1+r)")
    parser.add_argument("--dataset-seed", type=int, default=0, help="seed of the synthetic prompts and lengths")
    parser.add_argument("--num-prefixes", type=int, default=8, help="prefix dataset: distinct shared prefixes")
    parser.add_argument("--prefix-len", type=int, default=512, help="prefix dataset: tokens per prefix (range ratio applies)")
    parser.add_argument("--question-len", type=int, default=32, help="prefix dataset: tokens after the prefix")


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--result-json", default=None, help="write every number (and per-step series) here")
    parser.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots here (needs matplotlib)")


def build_engine(args: argparse.Namespace, **overrides: Any):
    from cbjax.config import EngineConfig
    from cbjax.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=args.model, **(engine_options(args) | overrides)))


def synthetic_requests(args: argparse.Namespace, vocab_size: int):
    from cbjax.bench.dataset import prefix_requests, random_requests

    if args.dataset == "prefix":
        return prefix_requests(
            args.num_prompts, args.num_prefixes, args.prefix_len, args.question_len, args.output_len,
            args.range_ratio, vocab_size, args.dataset_seed,
        )
    return random_requests(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab_size, args.dataset_seed
    )


def warm_up(recorder) -> None:
    """A few short requests first, so one-time host costs (first calls, allocations) stay out of the numbers."""
    from cbjax.bench.dataset import random_requests
    from cbjax.bench.throughput import run_throughput

    vocab = recorder.engine.model_config.vocab_size
    run_throughput(recorder, random_requests(4, 16, 8, 0.0, vocab, seed=99), "continuous", label="warmup")


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "jax_device": str(jax.devices()[0]),
        "args": {k: v for k, v in vars(args).items() if k != "func"},
    }


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(path).write_text(json.dumps(result, indent=1, default=float))
        print(f"wrote {path}")


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = [max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(fmt(row.get(c)).rjust(w) for c, w in zip(columns, widths)))


def fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def median_by(runs: list[dict[str, Any]], group: str, keys: list[str]) -> dict[str, dict[str, float]]:
    """Median of each key over the runs of each group value."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(run[group], []).append(run)
    return {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in groups.items()}


# ---- throughput ---------------------------------------------------------------------
def serve_once(recorder, requests, offsets, max_concurrency, percentiles, slos, label: str):
    """One serve run: (the result dict, the request timelines)."""
    from cbjax.bench.metrics import latencies_ms, serving_metrics
    from cbjax.bench.recorder import step_series, step_summary
    from cbjax.bench.serve import run_serve

    preemptions = recorder.engine.scheduler.num_preemptions
    timelines, duration = run_serve(recorder, requests, offsets, max_concurrency, label=label)
    metrics = serving_metrics(timelines, duration, percentiles, slos)
    result = {
        **metrics,
        **step_summary(recorder.records, recorder.engine.scheduler.num_preemptions - preemptions),
        "latencies_ms": latencies_ms(timelines),
        "steps": step_series(recorder.records),
    }
    return result, timelines
