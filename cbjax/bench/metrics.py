"""Serving metrics with `vllm bench serve`'s definitions and result-JSON key names.

One `RequestTimeline` per request: when it was sent, when each output token
arrived, how long its prompt was. The arithmetic follows vLLM's
`benchmarks/serve.py::calculate_metrics`:

- TTFT = first token time - send time; E2EL (latency) = last token time - send time.
- TPOT = (E2EL - TTFT) / (output tokens - 1), only for requests with more than one
  output token (a 1-token request counts as TPOT 0 for goodput, as in vLLM).
- ITL: every gap between consecutive token arrivals, pooled over requests.
- Throughputs divide by the benchmark duration; failed requests add no tokens.
- Goodput (`request_goodput`): completed requests meeting every given SLO
  (milliseconds, keys "ttft", "tpot", "e2el"), per second.
- Statistics of an empty list are 0 (vLLM's `np.mean(x or 0)`); percentiles are
  numpy's linear interpolation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclasses.dataclass
class RequestTimeline:
    """One request as a client saw it; times in seconds on one clock."""

    prompt_len: int
    send_time: float
    token_times: list[float] = dataclasses.field(default_factory=list)  # or streamed chunks' arrival times
    success: bool = True
    # A server's usage count, when one streamed chunk may carry several tokens (vLLM counts tokens
    # from `usage` and times ITLs per chunk); None: one token per entry of token_times.
    num_output_tokens: int | None = None

    @property
    def output_len(self) -> int:
        return len(self.token_times) if self.num_output_tokens is None else self.num_output_tokens

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.send_time

    @property
    def latency(self) -> float:
        return self.token_times[-1] - self.send_time

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.token_times))

    @property
    def tpot(self) -> float:
        """vLLM's TPOT; 0 for a request with a single output token."""
        if self.output_len < 2:
            return 0.0
        return (self.latency - self.ttft) / (self.output_len - 1)


def percentile_key(p: float) -> str:
    """vLLM writes p99 as "p99" and p99.9 as "p99.9"."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def summarize(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean_/median_/std_/pNN_ + `name`_ms of values given in seconds."""
    values = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000
    out = {
        f"mean_{name}_ms": float(np.mean(values)),
        f"median_{name}_ms": float(np.median(values)),
        f"std_{name}_ms": float(np.std(values)),
    }
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(values, p))
    return out


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """vLLM's `--goodput ttft:500 tpot:50` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {spec!r} must be NAME:MILLISECONDS with NAME in {SLO_METRICS}")
        if float(value) < 0:
            raise ValueError(f"goodput SLO {spec!r} is negative; give a time in milliseconds >= 0")
        slos[name] = float(value)
    return slos


def count_good(completed: Sequence[RequestTimeline], slos_ms: dict[str, float]) -> int:
    """Completed requests that meet every SLO (a 1-token request has TPOT 0)."""
    def good(t: RequestTimeline) -> bool:
        measured = {"ttft": t.ttft, "tpot": t.tpot, "e2el": t.latency}
        return all(measured[name] * 1000 <= slo for name, slo in slos_ms.items())

    return sum(good(t) for t in completed)


def serving_metrics(
    timelines: Sequence[RequestTimeline],
    duration_s: float,
    percentiles: Sequence[float] = (99,),
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict[str, float | int]:
    """The numbers `vllm bench serve` prints and saves, under its key names."""
    if duration_s <= 0:
        raise ValueError(f"duration_s is {duration_s}; the benchmark must have taken some time")
    completed = [t for t in timelines if t.success and t.output_len > 0]
    total_input = sum(t.prompt_len for t in completed)
    total_output = sum(t.output_len for t in completed)
    result: dict[str, float | int] = {
        "duration": duration_s,
        "completed": len(completed),
        "failed": len(timelines) - len(completed),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(completed) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    if goodput_slos_ms:
        result["request_goodput"] = count_good(completed, goodput_slos_ms) / duration_s
    result |= summarize("ttft", [t.ttft for t in completed], percentiles)
    result |= summarize("tpot", [t.tpot for t in completed if t.output_len > 1], percentiles)
    result |= summarize("itl", [itl for t in completed for itl in t.itls], percentiles)
    result |= summarize("e2el", [t.latency for t in completed], percentiles)
    return result


def latencies_ms(timelines: Sequence[RequestTimeline]) -> dict[str, list[float]]:
    """Every completed request's TTFT, TPOT, E2EL and every ITL, in ms (for CDF plots and the result JSON)."""
    completed = [t for t in timelines if t.success and t.output_len]
    return {
        "ttft": [1000 * t.ttft for t in completed],
        "tpot": [1000 * t.tpot for t in completed if t.output_len > 1],
        "itl": [1000 * x for t in completed for x in t.itls],
        "e2el": [1000 * t.latency for t in completed],
    }
