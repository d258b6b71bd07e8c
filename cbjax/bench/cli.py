"""`cbjax bench throughput | serve | prefill-stall | kv-capacity`: the benchmark commands."""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
from typing import Any

from cbjax.cli_args import add_engine_args, engine_options


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
    from cbjax.engine.config import EngineConfig
    from cbjax.engine.engine import LLMEngine

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

THROUGHPUT_KEYS = [
    "output_throughput", "mean_ttft_ms", "prefix_cache_hit_rate", "total_token_throughput", "elapsed_time", "useful_slot_occupancy",
    "mean_step_occupancy", "decode_step_occupancy", "peak_kv_usage", "kv_waste", "kv_waste_steady_state", "num_preemptions", "num_steps", "mean_step_ms",
]


def cmd_throughput(args: argparse.Namespace) -> None:
    from cbjax.bench.recorder import StepRecorder, step_series
    from cbjax.bench.throughput import run_throughput

    engine = build_engine(args)
    requests = synthetic_requests(args, engine.model_config.vocab_size)
    recorder = StepRecorder(engine)
    warm_up(recorder)
    runs, series = [], {}
    for repeat in range(args.repeats):  # interleaved, so drifting machine load hits every variant alike
        for scheduling in args.scheduling:
            # A B, then B A: machine load drifting over a repeat hits both variants alike.
            for caching in args.prefix_caching if repeat % 2 == 0 else reversed(args.prefix_caching):
                variant = scheduling if len(args.prefix_caching) == 1 else f"{scheduling} caching-{caching}"
                set_prefix_caching(engine, caching == "on")
                result = run_throughput(recorder, requests, scheduling, label=f"{variant}{repeat}")
                runs.append(result | {"variant": variant, "repeat": repeat})
                series[variant] = step_series(recorder.records)
                print_table([runs[-1]], ["variant", "repeat", *THROUGHPUT_KEYS[:7]])
    medians = median_by(runs, "variant", THROUGHPUT_KEYS)
    print(f"\nmedians over {args.repeats} interleaved repeat(s):")
    print_table([{"variant": name, **m} for name, m in medians.items()], ["variant", *THROUGHPUT_KEYS])
    result = {"medians": medians, "runs": runs, "steps": series, **environment(args)}
    if {"continuous", "static"} <= medians.keys():
        ratio = medians["continuous"]["output_throughput"] / medians["static"]["output_throughput"]
        result["continuous_over_static_output_throughput"] = ratio
        print(f"continuous / static output throughput: {ratio:.2f}x")
    for scheduling in args.scheduling:
        on, off = medians.get(f"{scheduling} caching-on"), medians.get(f"{scheduling} caching-off")
        if on and off:
            ratio = on["output_throughput"] / off["output_throughput"]
            result[f"{scheduling}_caching_on_over_off_output_throughput"] = ratio
            print(f"{scheduling}: prefix caching on / off output throughput {ratio:.3f}x, "
                  f"mean TTFT {on['mean_ttft_ms']:.0f} vs {off['mean_ttft_ms']:.0f} ms")
    write_json(args.result_json, result)
    if args.plot:
        from cbjax.bench.plots import plot_steps

        print("plots:", *plot_steps(pathlib.Path(args.plot), series))


def set_prefix_caching(engine, enabled: bool) -> None:
    """Turn the engine's prefix caching on or off between runs (same process, same compiled steps), cold."""
    engine.block_manager.enable_caching = enabled
    if not engine.reset_prefix_cache():
        raise RuntimeError("the prefix cache can only be reset with no request running")


# ---- serve ---------------------------------------------------------------------------


def serve_once(recorder, requests, offsets, max_concurrency, percentiles, slos, label: str):
    """One serve run: (the result dict, the request timelines)."""
    from cbjax.bench.metrics import serving_metrics
    from cbjax.bench.recorder import step_series, step_summary
    from cbjax.bench.serve import run_serve

    preemptions = recorder.engine.scheduler.num_preemptions
    timelines, duration = run_serve(recorder, requests, offsets, max_concurrency, label=label)
    metrics = serving_metrics(timelines, duration, percentiles, slos)
    completed = [t for t in timelines if t.success and t.output_len]
    result = {
        **metrics,
        **step_summary(recorder.records, recorder.engine.scheduler.num_preemptions - preemptions),
        "latencies_ms": {
            "ttft": [1000 * t.ttft for t in completed],
            "tpot": [1000 * t.tpot for t in completed if t.output_len > 1],
            "itl": [1000 * x for t in completed for x in t.itls],
            "e2el": [1000 * t.latency for t in completed],
        },
        "steps": step_series(recorder.records),
    }
    return result, timelines


SERVE_KEYS = [
    "completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
]


def cmd_serve(args: argparse.Namespace) -> None:
    from cbjax.bench.dataset import arrival_offsets
    from cbjax.bench.metrics import parse_goodput
    from cbjax.bench.recorder import StepRecorder

    slos = parse_goodput(args.goodput or [])
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    engine = build_engine(args)
    requests = synthetic_requests(args, engine.model_config.vocab_size)
    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.dataset_seed)
    recorder = StepRecorder(engine)
    warm_up(recorder)
    result, _ = serve_once(recorder, requests, offsets, args.max_concurrency, percentiles, slos, "serve")
    print(f"============ Serving Benchmark Result (rate {args.request_rate}, burstiness {args.burstiness}) ============")
    for key, value in result.items():
        if not isinstance(value, (dict, list)):
            print(f"{key:<32} {fmt(value)}")
    write_json(args.result_json, result | environment(args))
    if args.plot:
        from cbjax.bench.plots import plot_latency_cdfs, plot_steps

        out = pathlib.Path(args.plot)
        print("plots:", *plot_latency_cdfs(out, {"cbjax": result["latencies_ms"]}), *plot_steps(out, {"cbjax": result["steps"]}))


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, serve, prefill-stall, kv-capacity")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    p = sub.add_parser("throughput", help="offline synthetic requests; continuous vs static batching")
    add_engine_args(p)
    add_dataset_args(p)
    p.add_argument(
        "--scheduling", nargs="+", default=["continuous"], choices=["continuous", "static"],
        help="one or both (run side by side, interleaved)",
    )
    p.add_argument("--repeats", type=int, default=1, help="interleaved repeats; the table gives medians")
    p.add_argument(
        "--prefix-caching", nargs="+", default=["on"], choices=["on", "off"],
        help="one or both (both: side by side in one engine, each run starting with an empty cache)",
    )
    add_output_args(p)
    p.set_defaults(func=cmd_throughput)

    p = sub.add_parser("serve", help="requests arriving in real time against the in-process engine (vLLM bench serve metrics)")
    add_engine_args(p)
    add_dataset_args(p)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="*", help='SLOs like vLLM: "ttft:500 tpot:50 e2el:2000" (ms)')
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    add_output_args(p)
    p.set_defaults(func=cmd_serve)

    from cbjax.bench.experiments import add_experiment_parsers

    add_experiment_parsers(sub)
