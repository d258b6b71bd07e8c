"""GET /metrics: the engine's counters in Prometheus format, with vLLM's metric names, meanings and
label `model_name`, so that dashboards built for vLLM work unchanged."""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from cbjax.config import EngineConfig
from cbjax.engine.iteration_stats import IterationStats

# vLLM's bucket edges (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return buckets
            buckets.append(value)
        exponent += 1


class CountedHistogram:
    """A histogram whose observe takes a count: nearly every running request waits the same time for
    its next token (the step's), so a step's latencies go in as one value and a count, not one call
    each (`cbjax bench host --stat-logger`). It exports what prometheus_client's Histogram does,
    less `_created`."""

    def __init__(self, registry: CollectorRegistry, name: str, documentation: str, buckets: list[float],
                 model_name: str):
        self.name, self.documentation, self.model_name = name, documentation, model_name
        self.upper_bounds = [*map(float, buckets), math.inf]
        self.counts = [0] * len(self.upper_bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.lock = threading.Lock()  # observed by the thread that reads the core's steps, collected by /metrics
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        with self.lock:
            self.counts[bisect.bisect_left(self.upper_bounds, value)] += count  # the first bucket with value <= bound
            self.sum += value * count

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self.lock:
            counts, total = list(self.counts), self.sum
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        buckets = [(floatToGoString(bound), count) for bound, count in zip(self.upper_bounds, itertools.accumulate(counts))]
        family.add_metric([self.model_name], buckets, total)
        yield family


class SpecDecodeCounters:
    """vLLM's speculative-decoding counters, advanced by the engine's cumulative ones (get_stats())."""

    NAMES = {"num_drafts": "Number of spec decoding drafts.",
             "num_draft_tokens": "Number of draft tokens.",
             "num_accepted_tokens": "Number of accepted tokens."}

    def __init__(self, registry: CollectorRegistry, model_name: str, num_speculative_tokens: int):
        model = {"model_name": model_name}
        self.counters = {name: Counter(f"vllm:spec_decode_{name}", doc, ["model_name"], registry=registry).labels(**model)
                         for name, doc in self.NAMES.items()}
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                          ["model_name", "position"], registry=registry)
        self.per_pos = [per_pos.labels(position=str(p), **model) for p in range(num_speculative_tokens)]
        self.seen = {name: 0 for name in self.NAMES} | {"per_pos": [0] * num_speculative_tokens}

    def record(self, stats: dict[str, Any]) -> None:
        for name, counter in self.counters.items():
            counter.inc(stats[f"spec_decode_{name}"] - self.seen[name])
            self.seen[name] = stats[f"spec_decode_{name}"]
        per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
        for counter, now, before in zip(self.per_pos, per_pos, self.seen["per_pos"]):
            counter.inc(now - before)
        self.seen["per_pos"] = list(per_pos)


class PrometheusStatLogger:
    """Fed each engine step's IterationStats (a core client's StatLogger); read by GET /metrics."""

    def __init__(self, registry: CollectorRegistry, model_name: str, config: EngineConfig):
        labels, model = ["model_name"], {"model_name": model_name}
        r = registry
        max_model_len, max_num_batched_tokens = config.max_model_len, config.max_num_batched_tokens

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(**model)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(**model)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**model)

        self.num_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       labels + ["finished_reason"], registry=r)
        self.model_name = model_name
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = CountedHistogram(r, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                    ITL_BUCKETS, model_name)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               one_two_five_buckets(max_model_len))
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.",
                                                   one_two_five_buckets(max_model_len))
        step_buckets = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          [b for b in step_buckets if b <= max_num_batched_tokens])
        self.preemptions_seen = 0
        self.prefix_cache_seen = (0, 0)  # the engine's (queries, hits) already counted
        spec = config.speculative_config
        self.spec_decode = None if spec is None else SpecDecodeCounters(r, model_name, spec.num_speculative_tokens)

    def record_step(self, iteration: IterationStats) -> None:
        stats = iteration.engine_stats
        self.num_running.set(stats["num_running"])
        self.num_waiting.set(stats["num_waiting"])
        self.kv_cache_usage.set(1.0 - stats["kv_blocks_free"] / max(stats["kv_blocks_total"], 1))
        self.num_preemptions.inc(stats["num_preemptions"] - self.preemptions_seen)
        self.preemptions_seen = stats["num_preemptions"]
        queries, hits = stats["prefix_cache_queries"], stats["prefix_cache_hits"]
        self.prefix_cache_queries.inc(queries - self.prefix_cache_seen[0])
        self.prefix_cache_hits.inc(hits - self.prefix_cache_seen[1])
        self.prefix_cache_seen = (queries, hits)
        if self.spec_decode is not None:
            self.spec_decode.record(stats)
        if iteration.num_step_tokens:
            self.iteration_tokens.observe(iteration.num_step_tokens)
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        for ttft in iteration.time_to_first_tokens:
            self.ttft.observe(ttft)
        for latency, count in iteration.inter_token_latencies:
            self.itl.observe(latency, count)
        for finished in iteration.finished_requests:
            self.request_success.labels(model_name=self.model_name, finished_reason=finished.finish_reason).inc()
            self.e2e.observe(finished.e2e_latency)
            if finished.queue_time is not None:
                self.queue_time.observe(finished.queue_time)
            if finished.prefill_time is not None:
                self.prefill_time.observe(finished.prefill_time)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
