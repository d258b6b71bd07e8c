"""Where a served request's time to first token goes, from the server's own Prometheus histograms.

vLLM and cbjax export the same three histograms (vLLM's names): `vllm:time_to_first_token_seconds`
(from the request reaching the engine to its first token leaving it), `vllm:request_queue_time_seconds`
(waiting: for the running step to end, and for a seat and KV blocks) and
`vllm:request_prefill_time_seconds` (first scheduled to first token: the prompt's step or chunks).
Scraping /metrics before and after a benchmark run and taking the difference of each histogram's sum
and count gives the run's means; the client's mean TTFT minus the engine's is the front end (HTTP,
validation, tokenization, the hand-over to the engine, detokenizing and writing the first event).
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

PHASES = {
    "engine_ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}


def histogram_sums(metrics_text: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of every histogram in a /metrics page, summed over its labels."""
    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if family.type != "histogram":
                continue
            for suffix, slot in (("_sum", 0), ("_count", 1)):
                if sample.name == family.name + suffix:
                    totals.setdefault(family.name, [0.0, 0.0])[slot] += sample.value
    return {name: (s, c) for name, (s, c) in totals.items()}


def ttft_breakdown(before: str, after: str, client_mean_ttft_ms: float) -> dict[str, float | None]:
    """Mean ms per phase over the requests that finished between the two scrapes, and the front end's share
    (the client's mean TTFT minus the engine's); None where the server does not export a phase."""
    start, end = histogram_sums(before), histogram_sums(after)
    result: dict[str, float | None] = {"client_ttft": client_mean_ttft_ms}
    for phase, name in PHASES.items():
        s0, c0 = start.get(name, (0.0, 0.0))
        s1, c1 = end.get(name, (0.0, 0.0))
        result[phase] = 1000 * (s1 - s0) / (c1 - c0) if c1 > c0 else None
    engine = result["engine_ttft"]
    result["front_end"] = None if engine is None else client_mean_ttft_ms - engine
    return result
