"""`cbjax bench throughput | serve | prefill-stall | kv-capacity | host`: the benchmark commands."""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
from typing import Any

from cbjax.bench.common import (
    add_dataset_args, add_output_args, build_engine, environment, fmt, median_by, print_table, serve_once,
    synthetic_requests, warm_up, write_json,
)
from cbjax.entrypoints.cli.args import add_engine_args

THROUGHPUT_KEYS = [
    "output_throughput", "mean_ttft_ms", "prefix_cache_hit_rate", "total_token_throughput", "elapsed_time", "useful_slot_occupancy",
    "mean_step_occupancy", "decode_step_occupancy", "peak_kv_usage", "kv_waste", "kv_waste_steady_state", "num_preemptions", "num_steps", "mean_step_ms",
]


def cmd_throughput(args: argparse.Namespace) -> None:
    from cbjax.bench.recorder import StepRecorder, step_series
    from cbjax.bench.throughput import run_throughput

    engine = build_engine(args, async_scheduling=True)
    requests = synthetic_requests(args, engine.model_config.vocab_size)
    recorder = StepRecorder(engine)
    warm_up(recorder)
    runs, series = [], {}
    for repeat in range(args.repeats):  # interleaved, so drifting machine load hits every variant alike
        for scheduling in args.scheduling:
            # A B, then B A: machine load drifting over a repeat hits both variants alike.
            for caching, overlap in on_off_variants(args.prefix_caching, args.async_scheduling, reverse=repeat % 2 == 1):
                variant = " ".join([scheduling] + [f"{name}-{value}" for name, value, values in (
                    ("caching", caching, args.prefix_caching), ("async", overlap, args.async_scheduling)) if len(values) > 1])
                set_prefix_caching(engine, caching == "on")
                engine.config.async_scheduling = overlap == "on"
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
    for name in list(medians):
        for option in ("caching", "async"):
            off_name = name.replace(f"{option}-on", f"{option}-off")
            on, off = medians[name], medians.get(off_name)
            if off_name == name or off is None:
                continue
            key = name.replace(f" {option}-on", "").replace(" ", "_")
            ratio = on["output_throughput"] / off["output_throughput"]
            result[f"{key}_{option}_on_over_off_output_throughput"] = ratio
            # Each repeat's on and off ran back to back, so their ratio cancels load that drifts between repeats.
            by_run = {(r["variant"], r["repeat"]): r["output_throughput"] for r in runs}
            pairs = [by_run[name, i] / by_run[off_name, i] for i in range(args.repeats)]
            result[f"{key}_{option}_on_over_off_pair_ratios"] = pairs
            print(f"{name}: {option} on / off output throughput {ratio:.3f}x (median of per-repeat pair "
                  f"ratios {statistics.median(pairs):.3f}x, range {min(pairs):.3f}-{max(pairs):.3f}), "
                  f"mean TTFT {on['mean_ttft_ms']:.0f} vs {off['mean_ttft_ms']:.0f} ms")
    write_json(args.result_json, result)
    if args.plot:
        from cbjax.bench.plots import plot_steps

        print("plots:", *plot_steps(pathlib.Path(args.plot), series))


def on_off_variants(caching: list[str], overlap: list[str], reverse: bool) -> list[tuple[str, str]]:
    """Every (prefix caching, async scheduling) pair; reversed on odd repeats (A B, then B A), so
    machine load drifting over a repeat hits every variant alike."""
    pairs = [(c, a) for c in caching for a in overlap]
    return pairs[::-1] if reverse else pairs


def set_prefix_caching(engine, enabled: bool) -> None:
    """Turn the engine's prefix caching on or off between runs (same process, same compiled steps), cold."""
    engine.block_manager.enable_caching = enabled
    if not engine.reset_prefix_cache():
        raise RuntimeError("the prefix cache can only be reset with no request running")


# ---- serve ---------------------------------------------------------------------------


def print_serve_result(args: argparse.Namespace, result: dict[str, Any]) -> None:
    print(f"============ Serving Benchmark Result (rate {args.request_rate}, burstiness {args.burstiness}) ============")
    for key, value in result.items():
        if not isinstance(value, (dict, list)):
            print(f"{key:<32} {fmt(value)}")


def vocab_size_of(model: str) -> int:
    """The vocabulary size in a local model directory's config.json (for the synthetic prompts' token ids)."""
    config = pathlib.Path(model) / "config.json"
    if not config.exists():
        raise SystemExit(f"--vocab-size is needed: the model {model!r} is not a local directory with a config.json to read it from")
    return json.loads(config.read_text())["vocab_size"]


def cmd_serve_http(args: argparse.Namespace, percentiles: list[float], slos: dict[str, float]) -> None:
    """Client mode: streaming requests to an OpenAI-compatible server at --base-url."""
    import asyncio

    from cbjax.bench.dataset import arrival_offsets
    from cbjax.bench.metrics import serving_metrics
    from cbjax.bench.serve_client import drive_server, served_model_name

    base_url = args.base_url.rstrip("/")
    model = args.model or served_model_name(base_url)
    vocab = args.vocab_size or vocab_size_of(model)
    requests = synthetic_requests(args, vocab)
    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.dataset_seed)
    extra_body = {"temperature": args.temperature}
    timelines, errors, duration = asyncio.run(
        drive_server(base_url, model, requests, offsets, args.max_concurrency, extra_body)
    )
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "backend": "openai", "endpoint_type": "openai",
        "base_url": base_url, "model_id": model, "num_prompts": args.num_prompts, "request_rate": args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        **serving_metrics(timelines, duration, percentiles, slos),
        # vLLM's per-request lists, in seconds
        "input_lens": [t.prompt_len for t in timelines],
        "output_lens": [t.output_len if t.success else 0 for t in timelines],
        "ttfts": [t.ttft if t.success else 0.0 for t in timelines],
        "itls": [t.itls if t.success else [] for t in timelines],
        "latencies": [t.latency if t.success else 0.0 for t in timelines],
        "errors": [error or "" for error in errors],
    }
    print_serve_result(args, result)
    if result["failed"]:
        print("first error:", next(e for e in errors if e))
    write_json(args.result_json, result)
    if args.plot:
        from cbjax.bench.metrics import latencies_ms
        from cbjax.bench.plots import plot_latency_cdfs

        print("plots:", *plot_latency_cdfs(pathlib.Path(args.plot), {model: latencies_ms(timelines)}))


def cmd_serve(args: argparse.Namespace) -> None:
    from cbjax.bench.dataset import arrival_offsets
    from cbjax.bench.metrics import parse_goodput
    from cbjax.bench.recorder import StepRecorder

    slos = parse_goodput(args.goodput or [])
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    if args.base_url:
        return cmd_serve_http(args, percentiles, slos)
    if not args.model:
        raise SystemExit("cbjax bench serve needs --model CHECKPOINT (in process) or --base-url URL (a running server)")
    engine = build_engine(args)
    requests = synthetic_requests(args, engine.model_config.vocab_size)
    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.dataset_seed)
    recorder = StepRecorder(engine)
    warm_up(recorder)
    result, _ = serve_once(recorder, requests, offsets, args.max_concurrency, percentiles, slos, "serve")
    print_serve_result(args, result)
    write_json(args.result_json, result | environment(args))
    if args.plot:
        from cbjax.bench.plots import plot_latency_cdfs, plot_steps

        out = pathlib.Path(args.plot)
        print("plots:", *plot_latency_cdfs(out, {"cbjax": result["latencies_ms"]}), *plot_steps(out, {"cbjax": result["steps"]}))


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, serve, prefill-stall, kv-capacity, host")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    p = sub.add_parser("throughput", help="offline synthetic requests; continuous vs static batching")
    add_engine_args(p, variants=True)
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

    p = sub.add_parser(
        "serve", help="requests arriving in real time: the in-process engine, or any OpenAI-compatible server with --base-url"
    )
    add_engine_args(p)
    model = next(action for action in p._actions if action.dest == "model")
    model.required = False  # with --base-url it is the served model's name, and optional
    model.help = "in process: the converted checkpoint; with --base-url: the served model name (default: the first in /v1/models)"
    p.add_argument("--base-url", default=None, help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (vllm serve, cbjax serve)")
    p.add_argument("--vocab-size", type=int, default=None, help="with --base-url: prompt token ids below this (default: from --model's config.json)")
    p.add_argument("--temperature", type=float, default=1.0, help="with --base-url: sent in every request")
    add_dataset_args(p)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="*", help='SLOs like vLLM: "ttft:500 tpot:50 e2el:2000" (ms)')
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    add_output_args(p)
    p.set_defaults(func=cmd_serve)

    from cbjax.bench.experiments import add_experiment_parsers
    from cbjax.bench.host import add_host_parser

    add_experiment_parsers(sub)
    add_host_parser(sub)
