"""`cbjax bench throughput`: offline synthetic requests, continuous batching against the static baseline.

- continuous: every request is queued at once; the engine's continuous batching
  admits a waiting request as soon as a seat and blocks free up.
- static (the classical baseline): fixed batches of max_num_seqs requests in order;
  a batch starts only when the previous one has finished, and every row computes
  until the batch's longest request ends. Emulated exactly on the same engine: each
  request of a batch gets max_tokens = the batch's longest output, and only its own
  output length counts as useful tokens (throughput and occupancy both).

Outputs are forced to their length with ignore_eos; sampling is vLLM bench
throughput's (temperature 1.0, top_p 1.0), seeded per request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from cbjax.bench.dataset import SyntheticRequest
from cbjax.bench.recorder import StepRecorder, step_summary
from cbjax.sampling_params import SamplingParams

SCHEDULINGS = ("continuous", "static")


def static_batches(requests: Sequence[SyntheticRequest], batch_size: int) -> list[list[int]]:
    """Indices of the requests in each fixed batch, in order."""
    return [list(range(i, min(i + batch_size, len(requests)))) for i in range(0, len(requests), batch_size)]


def forced_max_tokens(requests: Sequence[SyntheticRequest], scheduling: str, batch_size: int) -> list[int]:
    """max_tokens each request runs to: its own length, or (static) its batch's longest."""
    if scheduling == "continuous":
        return [r.output_len for r in requests]
    if scheduling != "static":
        raise ValueError(f"scheduling is {scheduling!r}; choose one of {SCHEDULINGS}")
    max_tokens = [0] * len(requests)
    for batch in static_batches(requests, batch_size):
        longest = max(requests[i].output_len for i in batch)
        for i in batch:
            max_tokens[i] = longest
    return max_tokens


def _params(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed)


def _drain(recorder: StepRecorder, ids: set[str], computed: dict[str, int], ttfts: list[float]) -> None:
    """Step until every request in `ids` finished; record how many tokens each computed, and its TTFT."""
    while ids:
        for output in recorder.step():
            if output.finished and output.request_id in ids:
                ids.discard(output.request_id)
                computed[output.request_id] = len(output.outputs[0].token_ids)
                ttfts.append(output.metrics.first_token_time - output.metrics.arrival_time)


def run_throughput(
    recorder: StepRecorder, requests: Sequence[SyntheticRequest], scheduling: str, label: str = "run"
) -> dict[str, Any]:
    """Run `requests` to completion with `scheduling`; the throughput numbers and per-step records."""
    engine = recorder.engine
    batch_size = engine.config.max_num_seqs
    max_tokens = forced_max_tokens(requests, scheduling, batch_size)
    ids = [f"{label}-{i}" for i in range(len(requests))]
    batches = static_batches(requests, batch_size) if scheduling == "static" else [list(range(len(requests)))]
    recorder.records.clear()
    recorder.useful_output_len = {ids[i]: r.output_len for i, r in enumerate(requests)}
    preemptions_before = engine.scheduler.num_preemptions
    stats_before = engine.get_stats()
    computed: dict[str, int] = {}
    ttfts: list[float] = []
    start = time.perf_counter()
    for batch in batches:
        for i in batch:
            engine.add_request(ids[i], {"prompt_token_ids": requests[i].prompt_token_ids}, _params(max_tokens[i], i))
        _drain(recorder, {ids[i] for i in batch}, computed, ttfts)
    elapsed = time.perf_counter() - start
    wrong = [rid for rid, m in zip(ids, max_tokens) if computed[rid] != m]
    if wrong:
        raise RuntimeError(f"requests {wrong[:5]} did not run to their forced max_tokens (ignore_eos)")
    total_input = sum(r.prompt_len for r in requests)
    total_output = sum(r.output_len for r in requests)  # useful tokens only
    stats = engine.get_stats()
    queries = stats["prefix_cache_queries"] - stats_before["prefix_cache_queries"]
    return {
        "scheduling": scheduling,
        "num_requests": len(requests),
        "elapsed_time": elapsed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "computed_output_tokens": sum(computed.values()),
        "requests_per_second": len(requests) / elapsed,
        "output_throughput": total_output / elapsed,
        "total_token_throughput": (total_input + total_output) / elapsed,
        "mean_ttft_ms": 1000 * sum(ttfts) / len(ttfts),  # from each request's arrival (all queued at the start)
        "prefix_cache_hit_rate": (stats["prefix_cache_hits"] - stats_before["prefix_cache_hits"]) / max(1, queries),
        **step_summary(recorder.records, engine.scheduler.num_preemptions - preemptions_before),
    }
