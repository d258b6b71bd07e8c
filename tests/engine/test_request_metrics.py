"""RequestOutput.metrics: vLLM's latency names (time_in_queue, first_token_latency, e2e_latency) and token count."""

from __future__ import annotations

import pytest
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import LLM, SamplingParams
from cbjax.outputs import RequestMetrics


def test_latencies_are_the_differences_vllm_names():
    metrics = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=12.0,
                             finished_time=15.25, num_preemptions=0, num_generation_tokens=7)
    assert metrics.time_in_queue == 0.5
    assert metrics.first_token_latency == 2.0
    assert metrics.e2e_latency == 5.25


def test_latencies_not_yet_known_are_none():
    metrics = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=None,
                             finished_time=None, num_preemptions=0)
    assert metrics.time_in_queue == 0.5
    assert metrics.first_token_latency is None and metrics.e2e_latency is None


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("metrics"))[1]
    llm = LLM(str(checkpoint), max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32, block_size=8, num_kv_blocks=40)
    return llm.llm_engine


def test_engine_outputs_carry_queue_time_ttft_e2e_and_generation_tokens(engine):
    # A scripted clock: scheduler calls return 100.0, 101.0, ... so every latency is known exactly.
    ticks = iter(float(t) for t in range(100, 200))
    engine.scheduler.clock = lambda: next(ticks)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True),
                       arrival_time=99.0)
    streamed = []
    while engine.has_unfinished_requests():
        streamed += engine.step()
    # Step 1 schedules the prompt (100) and samples the first token (101); steps 2 and 3 decode,
    # the last one finishing the request (102).
    assert [o.metrics.num_generation_tokens for o in streamed] == [1, 2, 3]
    final = streamed[-1].metrics
    assert (final.time_in_queue, final.first_token_latency, final.e2e_latency) == (1.0, 2.0, 3.0)
    assert final.num_generation_tokens == len(streamed[-1].outputs[0].token_ids) == 3


def test_merged_outputs_count_one_inter_token_latency_per_step():
    """An output that carries several steps' tokens (an engine-core process's front end that fell
    behind merges them) still counts one ITL per decode step, as vLLM does, summing to the wait."""
    from prometheus_client import CollectorRegistry

    from cbjax.config import EngineConfig
    from cbjax.entrypoints.openai.metrics import PrometheusStatLogger
    from cbjax.outputs import CompletionOutput, RequestOutput

    registry = CollectorRegistry()
    logger = PrometheusStatLogger(registry, "m", EngineConfig(model="unused", max_model_len=64, max_num_batched_tokens=64))

    def output(num_tokens, finished=False):
        metrics = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0,
                                 finished_time=None, num_preemptions=0, num_generation_tokens=num_tokens)
        completion = CompletionOutput(0, "", list(range(num_tokens)), "length" if finished else None)
        return RequestOutput("r", None, [1, 2], [completion], finished, metrics)

    stats = {"num_running": 1, "num_waiting": 0, "kv_blocks_free": 1, "kv_blocks_total": 2, "num_preemptions": 0,
             "prefix_cache_queries": 0, "prefix_cache_hits": 0}
    logger.record_step([output(3)], stats, 1, now=12.0)  # tokens 1-3: the first at 11.0, two more steps by 12.0
    logger.record_step([output(5, finished=True)], stats, 1, now=13.0)  # two more steps by 13.0

    def sample(name):
        return registry.get_sample_value(name, {"model_name": "m"})

    assert sample("vllm:inter_token_latency_seconds_count") == 2 + 2
    assert sample("vllm:inter_token_latency_seconds_sum") == pytest.approx((12.0 - 11.0) + (13.0 - 12.0))
    assert sample("vllm:time_to_first_token_seconds_count") == 1
    assert sample("vllm:generation_tokens_total") == 5
