"""Mixed-step token buckets at powers of two only (old) against powers of two plus midpoints (new).

    python -m benchmarks.prefill_buckets_ab --model checkpoints/smollm2-135m-instruct \
        --parts serve prefix throughput --result-json bench_results/prefill_buckets_ab.json

For each engine shape, both bucket sets are built in this process (EngineConfig's
prompt_bucket_midpoints off and on) and run on the same requests,
alternating old, new, new, old, ... so both see the same machine load. Parts:
- serve: `cbjax bench serve`'s in-process workload (16 seqs, max model len 1024, 512 batched tokens,
  32 Poisson requests of 128 +-50% prompt and output tokens) at each --rates: median TTFT, median
  prefill (first scheduled -> first token, vLLM's request_prefill_time), output tok/s, median ITL.
- prefill: issue 12's prompt step alone: 15 requests decoding, then one prompt of each --prompt-lens
  arrives (no cache hit); its TTFT in process (add -> first token) and the step that carried it.
- prefix: BENCHMARKS section 12's shared-prefix shape (4 prefixes of 512 +-50%, questions of 32,
  outputs of 64, 32 requests, 16 seqs, 256 batched tokens), all queued at 0: output tok/s, mean TTFT.
- throughput: `cbjax bench throughput` shapes, 16 and 64 seqs x short (128) and long (512) prompts.
Prints and writes one JSON object: every run, the medians and new/old ratios.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from cbjax.bench.common import warm_up
from cbjax.bench.dataset import arrival_offsets, prefix_requests, random_requests
from cbjax.bench.metrics import serving_metrics
from cbjax.bench.recorder import StepRecorder
from cbjax.bench.serve import run_serve
from cbjax.bench.throughput import run_throughput
from cbjax.config import EngineConfig
from cbjax.engine.llm_engine import LLMEngine
from cbjax.sampling_params import SamplingParams

VARIANTS = ("powers", "midpoints")
SEEDS = itertools.count(1000)  # every prompt of a run its own tokens: no prefix cache hits


def build(model: str, variant: str, **options: Any) -> StepRecorder:
    engine = LLMEngine(
        EngineConfig(model=model, max_model_len=1024, compilation_cache_dir=".jax_cache",
                     kv_cache_memory_bytes=1 << 30, prompt_bucket_midpoints=variant == "midpoints", **options),
        progress=False,
    )
    recorder = StepRecorder(engine)
    warm_up(recorder)
    return recorder


def prompt_step_stats(recorder: StepRecorder) -> dict[str, float]:
    """Steps that carried a prompt chunk: how full their buckets were and how long they took. With async
    scheduling a step's result is read by the next engine step, so that one's wall time is its time."""
    records = recorder.records
    waits = {id(r): after.end - after.start for r, after in zip(records, records[1:])}
    mixed = [r for r in records[:-1] if r.kind == "mixed"]
    if not mixed:
        return {}
    return {
        "prompt_steps": len(mixed),
        "prompt_step_fill": sum(r.scheduled_tokens for r in mixed) / sum(r.bucket_tokens for r in mixed),
        "prompt_step_median_ms": 1000 * statistics.median(waits[id(r)] for r in mixed),
        "prompt_step_time_s": sum(waits[id(r)] for r in mixed),
    }


def serve_run(recorder: StepRecorder, rate: float, num_prompts: int, label: str) -> dict[str, float]:
    engine = recorder.engine
    requests = random_requests(num_prompts, 128, 128, 0.5, engine.model_config.vocab_size, 0)
    prefill: list[float] = []
    step = recorder.step

    def step_collecting_prefill() -> list[Any]:
        outputs = step()
        prefill.extend(o.metrics.first_token_time - o.metrics.first_scheduled_time for o in outputs if o.finished)
        return outputs

    recorder.step = step_collecting_prefill
    engine.reset_prefix_cache()  # every round computes its prompts, as the first did
    try:
        timelines, duration = run_serve(recorder, requests, arrival_offsets(num_prompts, rate, 1.0, 0), label=label)
    finally:
        del recorder.step
    metrics = serving_metrics(timelines, duration, (50,))
    return {
        "median_ttft_ms": metrics["median_ttft_ms"],
        "median_prefill_ms": 1000 * statistics.median(prefill),
        "mean_prefill_ms": 1000 * statistics.mean(prefill),
        "output_throughput": metrics["output_throughput"],
        "median_itl_ms": metrics["median_itl_ms"],
        **prompt_step_stats(recorder),
    }


def prefill_run(recorder: StepRecorder, prompt_lens: list[int], label: str) -> dict[str, float]:
    """TTFT of one arriving prompt of each length beside 15 decoding requests (the serving profile's
    typical prompt step), the median over the lengths and each length's."""
    engine = recorder.engine
    vocab = engine.model_config.vocab_size
    background = [f"{label}-decoding-{i}" for i in range(15)]
    for i, request in enumerate(random_requests(len(background), 32, 1, 0.0, vocab, seed=next(SEEDS))):
        engine.add_request(background[i], {"prompt_token_ids": request.prompt_token_ids},
                           SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True))
    decoding: set[str] = set()
    while len(decoding) < len(background):
        decoding |= {o.request_id for o in recorder.step() if o.outputs[0].token_ids}
    ttfts = {}
    for n, prompt_len in enumerate(prompt_lens):
        (request,) = random_requests(1, prompt_len, 1, 0.0, vocab, seed=next(SEEDS))
        request_id = f"{label}-prompt-{n}"
        start = time.perf_counter()
        engine.add_request(request_id, {"prompt_token_ids": request.prompt_token_ids},
                           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        while not any(o.request_id == request_id and o.outputs[0].token_ids for o in recorder.step()):
            pass
        ttfts[f"ttft_ms_{prompt_len}"] = 1000 * (time.perf_counter() - start)
    for request_id in background:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        recorder.step()
    return {"median_ttft_ms": statistics.median(ttfts.values()), **ttfts}


def throughput_run(recorder: StepRecorder, requests: list, label: str) -> dict[str, float]:
    recorder.engine.reset_prefix_cache()  # every round computes its prompts, as the first did
    result = run_throughput(recorder, requests, "continuous", label=label)
    keys = ("output_throughput", "mean_ttft_ms", "num_steps", "prefix_cache_hit_rate")
    return {key: result[key] for key in keys} | prompt_step_stats(recorder)


def alternate(recorders: dict[str, StepRecorder], run: Callable[[StepRecorder, str], dict], rounds: int) -> dict:
    """Run both variants `rounds` times each (old new, new old, ...); every run, medians, new/old ratios."""
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for i in range(rounds):
        for variant in VARIANTS if i % 2 == 0 else reversed(VARIANTS):
            runs[variant].append(run(recorders[variant], f"{variant}-{i}"))
            print(variant, i, json.dumps(runs[variant][-1]), flush=True)
    medians = {v: {k: statistics.median(r[k] for r in runs[v]) for k in runs[v][0]} for v in VARIANTS}
    ratios = {k: medians["midpoints"][k] / medians["powers"][k] for k in medians["powers"] if medians["powers"][k]}
    pairs = {k: [n[k] / o[k] for o, n in zip(runs["powers"], runs["midpoints"]) if o[k]] for k in medians["powers"]}
    return {"runs": runs, "medians": medians, "midpoints_over_powers": ratios, "pair_ratios": pairs}


def part_shapes(args: argparse.Namespace) -> list[tuple[str, dict, Callable[[StepRecorder, str], dict]]]:
    vocab = 49152
    shapes = []
    if "prefill" in args.parts:
        shapes.append(("prefill_beside_15_decodes", dict(max_num_seqs=16, max_num_batched_tokens=512),
                       lambda rec, label: prefill_run(rec, args.prompt_lens, label)))
    if "serve" in args.parts:
        for rate in args.rates:
            shapes.append((f"serve_rate{rate:g}", dict(max_num_seqs=16, max_num_batched_tokens=512),
                           lambda rec, label, rate=rate: serve_run(rec, rate, args.num_prompts, label)))
    if "prefix" in args.parts:
        requests = prefix_requests(32, 4, 512, 32, 64, 0.5, vocab, 0)
        shapes.append(("prefix_4x512_seqs16_tokens256", dict(max_num_seqs=16, max_num_batched_tokens=256),
                       lambda rec, label: throughput_run(rec, requests, label)))
    if "throughput" in args.parts:
        for seqs, prompts in ((16, 32), (64, 64)):
            for name, input_len, output_len in (("short", 128, 64), ("long", 512, 32)):
                requests = random_requests(prompts, input_len, output_len, 0.5, vocab, 0)
                shapes.append((f"throughput_seqs{seqs}_{name}", dict(max_num_seqs=seqs, max_num_batched_tokens=512),
                               lambda rec, label, requests=requests: throughput_run(rec, requests, label)))
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parts = ["prefill", "serve", "prefix", "throughput"]
    parser.add_argument("--parts", nargs="+", default=parts, choices=parts)
    parser.add_argument("--prompt-lens", nargs="+", type=int, default=[64, 80, 100, 120, 140, 160, 180, 200])
    parser.add_argument("--rates", nargs="+", type=float, default=[2.0, 4.0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    results = {}
    built: dict[tuple, dict[str, StepRecorder]] = {}
    for name, options, run in part_shapes(args):
        key = tuple(sorted(options.items()))
        if key not in built:
            built.clear()  # one engine pair at a time
            built[key] = {v: build(args.model, v, **options) for v in VARIANTS}
        print("==", name, flush=True)
        results[name] = alternate(built[key], run, args.rounds)
        print(name, "medians", json.dumps(results[name]["medians"]), flush=True)
        print(name, "midpoints / powers", json.dumps(results[name]["midpoints_over_powers"]), flush=True)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
