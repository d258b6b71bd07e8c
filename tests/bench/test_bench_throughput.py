"""The static baseline's accounting, the step recorder and the serve loop, on a tiny model (no timing asserted)."""

from __future__ import annotations

import pytest
from tiny_checkpoint import make_tiny_checkpoint

from cbjax.bench.dataset import SyntheticRequest, arrival_offsets, prefix_requests, random_requests
from cbjax.bench.metrics import serving_metrics
from cbjax.bench.recorder import StepRecorder
from cbjax.bench.serve import run_serve
from cbjax.bench.throughput import forced_max_tokens, run_throughput, static_batches
from cbjax.config import EngineConfig
from cbjax.engine.llm_engine import LLMEngine

BLOCK_SIZE = 8
OUTPUT_LENS = [3, 9, 5, 2, 7]  # batches of 2: [3, 9] [5, 2] [7]


def synthetic(output_lens, prompt_len=6):
    return [SyntheticRequest(list(range(3, 3 + prompt_len)), n) for n in output_lens]


def test_static_batches_run_every_row_to_the_batch_longest():
    requests = synthetic(OUTPUT_LENS)
    assert static_batches(requests, 2) == [[0, 1], [2, 3], [4]]
    assert forced_max_tokens(requests, "static", 2) == [9, 9, 5, 5, 7]
    assert forced_max_tokens(requests, "continuous", 2) == OUTPUT_LENS
    with pytest.raises(ValueError, match="scheduling"):
        forced_max_tokens(requests, "dynamic", 2)


def test_random_requests_follow_the_range_ratio_and_seed():
    requests = random_requests(50, input_len=20, output_len=10, range_ratio=0.5, vocab_size=300, seed=3)
    assert all(10 <= r.prompt_len <= 30 and 5 <= r.output_len <= 15 for r in requests)
    assert all(0 <= t < 300 for r in requests for t in r.prompt_token_ids)
    assert requests == random_requests(50, 20, 10, 0.5, 300, seed=3)
    assert list(arrival_offsets(3, float("inf"), 1.0, 0)) == [0, 0, 0]


def test_prefix_requests_share_each_prefix_equally_then_ask_their_own_question():
    requests = prefix_requests(12, num_prefixes=3, prefix_len=40, question_len=10, output_len=8,
                               range_ratio=0.5, vocab_size=300, seed=1)
    groups: dict[tuple, list[list[int]]] = {}
    for request in requests:  # prefixes have 20 to 60 random tokens: their first 20 tell them apart
        groups.setdefault(tuple(request.prompt_token_ids[:20]), []).append(request.prompt_token_ids)
    assert sorted(len(group) for group in groups.values()) == [4, 4, 4]
    for group in groups.values():
        prefix_len = next(i for i, column in enumerate(zip(*group)) if len(set(column)) > 1)
        assert 20 <= prefix_len <= 60
        assert all(5 <= len(prompt) - prefix_len <= 15 for prompt in group)
    assert all(4 <= r.output_len <= 12 for r in requests)
    assert requests == prefix_requests(12, 3, 40, 10, 8, 0.5, 300, seed=1)
    with pytest.raises(ValueError, match="num_prefixes is 13"):
        prefix_requests(12, 13, 40, 10, 8, 0.5, 300)
    offsets = arrival_offsets(200, request_rate=4.0, burstiness=1.0, seed=0)
    assert offsets[0] == 0 and (offsets[1:] >= offsets[:-1]).all()


@pytest.fixture(scope="module")
def recorder(tmp_path_factory):
    _, ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("bench"), "llama")
    config = EngineConfig(
        model=str(ckpt), max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16,
        block_size=BLOCK_SIZE, num_kv_blocks=40,
    )
    return StepRecorder(LLMEngine(config, progress=False))


def test_static_counts_only_each_requests_own_tokens_as_useful(recorder):
    requests = synthetic(OUTPUT_LENS)
    result = run_throughput(recorder, requests, "static", label="static")
    forced = forced_max_tokens(requests, "static", 2)
    prompt_tokens = sum(r.prompt_len for r in requests)
    assert result["total_output_tokens"] == sum(OUTPUT_LENS)
    assert result["computed_output_tokens"] == sum(forced)
    assert result["num_preemptions"] == 0
    # Prefill rows plus one decode row per output token after the first (the last sampled token is never fed back).
    records = recorder.records
    assert sum(r.scheduled_tokens for r in records) == prompt_tokens + sum(m - 1 for m in forced)
    assert sum(r.useful_tokens for r in records) == prompt_tokens + sum(n - 1 for n in OUTPUT_LENS)
    assert result["useful_slot_occupancy"] < result["scheduled_slot_occupancy"] <= 1


def test_continuous_wastes_no_rows_and_kv_waste_is_under_a_block_per_request(recorder):
    requests = synthetic(OUTPUT_LENS)
    result = run_throughput(recorder, requests, "continuous", label="cont")
    assert result["computed_output_tokens"] == result["total_output_tokens"] == sum(OUTPUT_LENS)
    for r in recorder.records:
        assert r.useful_tokens == r.scheduled_tokens <= r.bucket_tokens
        assert 0 <= r.kv_allocated_slots - r.kv_token_slots < BLOCK_SIZE * r.num_running
        assert r.kv_blocks_used * BLOCK_SIZE >= r.kv_allocated_slots
    assert 0 < result["peak_kv_usage"] <= 1


def test_serve_stamps_every_token_and_reports_vllm_metrics(recorder):
    requests = synthetic([4, 1, 6], prompt_len=5)
    timelines, duration = run_serve(recorder, requests, [0.0, 0.0, 0.01], max_concurrency=2)
    assert [t.output_len for t in timelines] == [4, 1, 6]
    assert all(t.send_time <= t.token_times[0] and t.token_times == sorted(t.token_times) for t in timelines)
    metrics = serving_metrics(timelines, duration)
    assert (metrics["completed"], metrics["failed"], metrics["total_output_tokens"]) == (3, 0, 11)
    assert max(r.num_running for r in recorder.records) <= 2


def test_paged_capacity_simulation_admits_by_blocks_not_max_model_len():
    from cbjax.bench.experiments import simulate_paged

    # 6 requests of 8 prompt + 8 output tokens, blocks of 8, 8 usable blocks: every prompt fits in one
    # block (6 admitted at once), then growth into second blocks forces preemptions; contiguous
    # max_model_len=64 preallocation would fit 8 * 8 // 64 = 1.
    result = simulate_paged(synthetic([8] * 6, prompt_len=8), num_blocks=9, block_size=8, max_model_len=64,
                            max_num_seqs=16, max_num_batched_tokens=64)
    assert result["paged_max_concurrent"] == 6
    assert result["paged_preemptions"] > 0
    assert 0 <= result["paged_kv_waste_all_steps"] < 1
