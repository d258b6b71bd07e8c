"""/metrics carries vLLM's speculative-decoding counters, advanced by the engine's cumulative get_stats()."""

from prometheus_client import CollectorRegistry

from cbjax.config import EngineConfig
from cbjax.engine.iteration_stats import IterationStats
from cbjax.entrypoints.openai.metrics import PrometheusStatLogger

STATS = {"num_running": 1, "num_waiting": 0, "kv_blocks_free": 1, "kv_blocks_total": 2, "num_preemptions": 0,
         "prefix_cache_queries": 0, "prefix_cache_hits": 0}


def spec_stats(drafts: int, draft_tokens: int, per_pos: list[int]) -> dict:
    return {**STATS, "spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": draft_tokens,
            "spec_decode_num_accepted_tokens": sum(per_pos), "spec_decode_num_accepted_tokens_per_pos": per_pos}


def test_spec_decode_counters_follow_the_engines_totals():
    registry = CollectorRegistry()
    config = EngineConfig(model="unused", max_model_len=64, max_num_batched_tokens=64,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    logger = PrometheusStatLogger(registry, "m", config)
    logger.record_step(IterationStats(spec_stats(2, 6, [2, 1, 0]), 8, 0, 5, [], [], []))
    logger.record_step(IterationStats(spec_stats(3, 9, [3, 2, 1]), 4, 0, 4, [], [], []))
    value = lambda name, **labels: registry.get_sample_value(name, {"model_name": "m", **labels})  # noqa: E731
    assert (value("vllm:spec_decode_num_drafts_total"), value("vllm:spec_decode_num_draft_tokens_total"),
            value("vllm:spec_decode_num_accepted_tokens_total")) == (3, 9, 6)
    assert [value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)] == [3, 2, 1]


def test_without_speculation_there_are_no_spec_decode_counters():
    registry = CollectorRegistry()
    PrometheusStatLogger(registry, "m", EngineConfig(model="unused", max_model_len=64, max_num_batched_tokens=64))
    assert not [m.name for m in registry.collect() if "spec_decode" in m.name]
