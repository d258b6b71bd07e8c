"""RequestOutput.metrics: vLLM's latency names (time_in_queue, first_token_latency, e2e_latency) and token
count; the stat loggers' per-step IterationStats and the Prometheus metrics made of them."""

from __future__ import annotations

import queue
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import LLM, RequestOutputKind, SamplingParams
from cbjax.config import EngineConfig
from cbjax.core.engine_core import EngineCore
from cbjax.core.engine_core_proc import EngineCoreProc
from cbjax.core.request import Request
from cbjax.engine.core_client import ThreadCoreClient
from cbjax.engine.llm_engine import LLMEngine
from cbjax.engine.process_client import ProcessCoreClient
from cbjax.engine.iteration_stats import FinishedRequestStats, IterationStats
from cbjax.entrypoints.openai.metrics import ITL_BUCKETS, CountedHistogram, PrometheusStatLogger
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


OPTIONS = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32, block_size=8, num_kv_blocks=40)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("metrics"))[1]


@pytest.fixture(scope="module")
def engine(checkpoint):
    return LLM(str(checkpoint), **OPTIONS).llm_engine


def test_engine_outputs_carry_queue_time_ttft_e2e_and_generation_tokens(engine, monkeypatch):
    # A scripted clock: scheduler calls return 100.0, 101.0, ... so every latency is known exactly.
    ticks = iter(float(t) for t in range(100, 200))
    monkeypatch.setattr(engine.scheduler, "clock", lambda: next(ticks))
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


def test_a_step_that_only_reads_the_step_in_flight_counts_no_tokens(engine, monkeypatch):
    """When overlapping stops (async scheduling turned off here; on a CPU, a seat that frees), step()
    reads the step in flight and launches none: it computed 0 tokens, not the step before's again."""
    monkeypatch.setattr(engine.config, "async_scheduling", True)
    engine.add_request("overlap", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # launches the prompt's step, reads none
    counts = [engine.last_step_num_tokens]
    engine.config.async_scheduling = False
    while engine.has_unfinished_requests():
        engine.step()
        counts.append(engine.last_step_num_tokens)
    assert counts == [3, 0, 1, 1, 1], "the prompt, the read of its step, then a decode step per token after the first"


def test_the_core_process_message_of_a_step_launched_but_not_read_carries_its_tokens(engine, monkeypatch):
    """With async scheduling the first step() launches the prompt's step and reads none: the message
    the core process sends for it must still count the step's tokens (fails before 910dc6e: 0)."""
    monkeypatch.setattr(engine.config, "async_scheduling", True)
    proc, steps_before = EngineCoreProc(engine.core), engine.core.num_steps
    proc.add_request("proc", [Request("proc", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))])
    counts = []
    while engine.core.has_unfinished_requests():
        counts.append(proc.step().num_step_tokens)
    num_steps = engine.core.num_steps - steps_before
    assert counts[0] == 3 and sum(counts) == 3 + (num_steps - 1), "the prompt's step, then one token a decode step"


def sample(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


STATS = {"num_running": 1, "num_waiting": 0, "kv_blocks_free": 1, "kv_blocks_total": 2, "num_preemptions": 0,
         "prefix_cache_queries": 0, "prefix_cache_hits": 0}


def test_the_prometheus_logger_observes_each_step_record_as_vllm_names_it():
    """A hand-made step record: a step of 12 tokens in which one request's first token came (after
    0.25 s), three tokens came 0.5 s after their previous ones and a request finished by a stop."""
    registry = CollectorRegistry()
    logger = PrometheusStatLogger(registry, "m", EngineConfig(model="unused", max_model_len=64, max_num_batched_tokens=64))
    finished = FinishedRequestStats("r", "stop", e2e_latency=2.0, queue_time=0.5, prefill_time=None,
                                    num_prompt_tokens=9, num_generation_tokens=4)
    logger.record_step(IterationStats(STATS, 12, 9, 4, [0.25], [(0.5, 3)], [finished]))
    logger.record_step(IterationStats(STATS, 0, 0, 0, [], [], []))  # a message with no step launched
    assert (sample(registry, "vllm:iteration_tokens_total_count"), sample(registry, "vllm:iteration_tokens_total_sum")) == (1, 12)
    assert sample(registry, "vllm:prompt_tokens_total") == 9 and sample(registry, "vllm:generation_tokens_total") == 4
    assert (sample(registry, "vllm:time_to_first_token_seconds_count"), sample(registry, "vllm:time_to_first_token_seconds_sum")) == (1, 0.25)
    assert sample(registry, "vllm:inter_token_latency_seconds_count") == 3
    assert sample(registry, "vllm:inter_token_latency_seconds_sum") == pytest.approx(1.5)
    assert sample(registry, "vllm:request_success_total", finished_reason="stop") == 1
    assert sample(registry, "vllm:e2e_request_latency_seconds_sum") == 2.0
    assert sample(registry, "vllm:request_queue_time_seconds_count") == 1
    assert sample(registry, "vllm:request_prefill_time_seconds_count") == 0, "no first token: no prefill time"
    assert sample(registry, "vllm:request_generation_tokens_sum") == 4 and sample(registry, "vllm:request_prompt_tokens_sum") == 9


def test_a_counted_histogram_exports_what_as_many_observations_of_a_histogram_do():
    values = [(0.003, 5), (0.01, 2), (0.02, 1), (0.3, 7), (100.0, 2)]  # on, between and past the bucket edges
    counted, reference = CollectorRegistry(), CollectorRegistry()
    histogram = CountedHistogram(counted, "vllm:latency_seconds", "doc", ITL_BUCKETS, "m")
    expected = Histogram("vllm:latency_seconds", "doc", ["model_name"], buckets=ITL_BUCKETS, registry=reference)
    for value, count in values:
        histogram.observe(value, count)
        for _ in range(count):
            expected.labels(model_name="m").observe(value)

    def exported(registry):
        return sorted(line for line in generate_latest(registry).decode().splitlines() if "_created" not in line)

    assert exported(counted) == exported(reference)


def token_counts(outputs: list, kind: RequestOutputKind) -> list[int]:
    """Each completion's number of tokens, from a request's outputs (DELTA: summed over them)."""
    if kind is RequestOutputKind.DELTA:
        return [sum(len(o.outputs[i].token_ids) for o in outputs) for i in range(len(outputs[-1].outputs))]
    return [len(completion.token_ids) for completion in outputs[-1].outputs]


def test_ttft_and_e2e_count_each_finished_request_once(engine):
    """Requests of every output kind, one with n=2 and one aborted after its first output, through the
    core thread with the Prometheus logger: each request counts once in TTFT, e2e, queue and prefill
    time and the success counter; each completion's tokens once; one ITL per token after its first."""
    registry = CollectorRegistry()
    client = ThreadCoreClient(engine, [PrometheusStatLogger(registry, "m", engine.config)])
    steps_before = engine.get_stats()["num_steps"]
    kinds = RequestOutputKind
    requests = {
        "final": ([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True, output_kind=kinds.FINAL_ONLY)),
        "pair": ([8, 9, 10, 11], SamplingParams(n=2, max_tokens=4, ignore_eos=True, output_kind=kinds.FINAL_ONLY)),
        "stream": ([12, 13], SamplingParams(max_tokens=6, ignore_eos=True, output_kind=kinds.DELTA)),
        "left": ([14, 15, 16], SamplingParams(max_tokens=40, ignore_eos=True, output_kind=kinds.DELTA)),
    }
    received = {request_id: queue.SimpleQueue() for request_id in requests}
    outputs = {request_id: [] for request_id in requests}
    client.start()
    try:
        for request_id, (prompt, params) in requests.items():
            client.add_request(request_id, {"prompt_token_ids": prompt}, params, received[request_id].put)
        for request_id in requests:
            while not (outputs[request_id] and outputs[request_id][-1].finished):
                outputs[request_id].append(received[request_id].get(timeout=60))
                if request_id == "left" and len(outputs[request_id]) == 1:
                    client.abort_request(request_id)  # the caller leaves after its first output
    finally:
        client.shutdown(timeout=60)
        kept, engine.book.iteration_stats = engine.book.iteration_stats.latest_token_step, None
    assert kept == {}, "nothing kept of a finished request"
    tokens = {request_id: token_counts(outputs[request_id], params.output_kind) for request_id, (_, params) in requests.items()}
    assert tokens["final"] == [5] and tokens["pair"] == [4, 4] and tokens["stream"] == [6] and 1 <= tokens["left"][0] < 40
    assert [len(outputs[request_id]) for request_id in ("final", "pair")] == [1, 1]

    def count(name, **labels):
        return sample(registry, name, **labels)

    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert count(f"vllm:{name}_count") == 4, name
    assert count("vllm:request_success_total", finished_reason="length") == 3
    assert count("vllm:request_success_total", finished_reason="abort") == 1
    assert count("vllm:prompt_tokens_total") == count("vllm:request_prompt_tokens_sum") == 3 + 4 + 2 + 3
    total = sum(sum(counts) for counts in tokens.values())
    assert count("vllm:generation_tokens_total") == count("vllm:request_generation_tokens_sum") == total
    assert count("vllm:inter_token_latency_seconds_count") == sum(n - 1 for counts in tokens.values() for n in counts)
    assert count("vllm:iteration_tokens_total_count") == engine.get_stats()["num_steps"] - steps_before


def standin_core(options: dict) -> EngineCore:
    """A core whose device steps take 2 ms and compute nothing (`cbjax bench host`'s stand-in device):
    an engine-core process that starts in seconds, with no model step to compile."""
    from cbjax.bench.standin_device import install_standin

    engine = LLMEngine(EngineConfig(**options), precompile=False, progress=False)
    install_standin(engine.runner, 0.002, list(range(3, 300)))
    return engine.core


class SlowFirstRecord:
    """A stat logger whose first record keeps the front end's reader away while the core steps on."""

    def __init__(self, logger: PrometheusStatLogger):
        self.logger, self.slept = logger, False

    def record_step(self, iteration: IterationStats) -> None:
        if not self.slept:
            time.sleep(0.3)
            self.slept = True
        self.logger.record_step(iteration)


def test_a_front_end_that_reads_several_core_steps_at_once_observes_each_step(checkpoint):
    """The core process runs ahead while the front end is busy; the front end then reads every waiting
    step in one go, and each must still be one observation of iteration_tokens, with its own count."""
    registry = CollectorRegistry()
    stat_logger = SlowFirstRecord(PrometheusStatLogger(registry, "m", EngineConfig(model=str(checkpoint), **OPTIONS)))
    options = {"model": str(checkpoint), **OPTIONS, "async_scheduling": False}  # each step reads its own tokens
    client = ProcessCoreClient(standin_core, (options,), [lambda config: stat_logger])
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
    params = SamplingParams(max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    received = queue.SimpleQueue()
    client.start()
    try:
        client.add_requests([(f"r{i}", {"prompt_token_ids": prompt}, params, received.put, 0, None)
                             for i, prompt in enumerate(prompts)])
        outputs = [received.get(timeout=60) for _ in prompts]
    finally:
        client.shutdown(timeout=30)  # its reader thread has recorded every step by then
    assert all(output.finished for output in outputs) and received.empty()
    num_steps = client.stats["num_steps"]
    assert num_steps == 12, "all four prompts in one step, then 11 decode steps"
    assert sample(registry, "vllm:iteration_tokens_total_count") == num_steps
    # Every prompt token computed once, then one token per request per step but the last sampled.
    assert sample(registry, "vllm:iteration_tokens_total_sum") == sum(map(len, prompts)) + len(prompts) * 11
    assert sample(registry, "vllm:generation_tokens_total") == len(prompts) * 12
    assert sample(registry, "vllm:time_to_first_token_seconds_count") == len(prompts)
    assert sample(registry, "vllm:inter_token_latency_seconds_count") == len(prompts) * 11
