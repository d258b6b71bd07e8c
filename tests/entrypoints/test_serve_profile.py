"""The serving profiles on hand-written inputs: TTFT split into phases from two /metrics scrapes
(cbjax.bench.serve_breakdown), and each thread's GIL share from py-spy's raw output (cbjax.bench.serve_gil)."""

from __future__ import annotations

import pytest

from cbjax.bench.serve_breakdown import ttft_breakdown
from cbjax.bench.serve_gil import gil_shares


def page(ttft: tuple[float, int], queue: tuple[float, int], prefill: tuple[float, int] | None) -> str:
    """A /metrics page in Prometheus' text format with two label sets for TTFT (summed by the reader)."""
    lines = [
        "# HELP vllm:time_to_first_token_seconds TTFT.",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="a"} 1.0',
        'vllm:time_to_first_token_seconds_count{model_name="a"} 1.0',
        'vllm:time_to_first_token_seconds_sum{model_name="a"} 0.25',
        f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="b"}} {ttft[1]}',
        f'vllm:time_to_first_token_seconds_count{{model_name="b"}} {ttft[1]}',
        f'vllm:time_to_first_token_seconds_sum{{model_name="b"}} {ttft[0]}',
        "# HELP vllm:request_queue_time_seconds Queue.",
        "# TYPE vllm:request_queue_time_seconds histogram",
        f'vllm:request_queue_time_seconds_bucket{{le="+Inf",model_name="b"}} {queue[1]}',
        f'vllm:request_queue_time_seconds_count{{model_name="b"}} {queue[1]}',
        f'vllm:request_queue_time_seconds_sum{{model_name="b"}} {queue[0]}',
        "# HELP vllm:num_requests_running Running.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="b"} 3.0',
    ]
    if prefill is not None:
        lines += [
            "# HELP vllm:request_prefill_time_seconds Prefill.",
            "# TYPE vllm:request_prefill_time_seconds histogram",
            f'vllm:request_prefill_time_seconds_bucket{{le="+Inf",model_name="b"}} {prefill[1]}',
            f'vllm:request_prefill_time_seconds_count{{model_name="b"}} {prefill[1]}',
            f'vllm:request_prefill_time_seconds_sum{{model_name="b"}} {prefill[0]}',
        ]
    return "\n".join(lines) + "\n"


def test_phase_means_come_from_the_differences_of_sums_and_counts():
    # Between the scrapes 4 requests: TTFTs summing 2.0 s, queue 1.2 s, prefill 0.6 s.
    before = page(ttft=(1.5, 2), queue=(0.5, 2), prefill=(0.25, 2))
    after = page(ttft=(3.5, 6), queue=(1.7, 6), prefill=(0.85, 6))
    split = ttft_breakdown(before, after, client_mean_ttft_ms=560.0)
    assert split["engine_ttft"] == pytest.approx(500.0)  # 2.0 s / 4
    assert split["queue"] == pytest.approx(300.0)
    assert split["prefill"] == pytest.approx(150.0)
    assert split["front_end"] == pytest.approx(60.0)  # 560 - 500
    assert split["client_ttft"] == 560.0


def test_a_phase_the_server_does_not_export_or_that_saw_no_request_is_none():
    before = page(ttft=(1.0, 2), queue=(0.5, 2), prefill=None)
    after = page(ttft=(2.0, 4), queue=(0.5, 2), prefill=None)
    split = ttft_breakdown(before, after, client_mean_ttft_ms=700.0)
    assert split["prefill"] is None and split["queue"] is None
    assert split["engine_ttft"] == pytest.approx(500.0) and split["front_end"] == pytest.approx(200.0)


def test_gil_share_is_a_threads_samples_over_all_samples_taken_with_its_innermost_frame_of_ours():
    raw = "\n".join([
        "thread (11): MainThread;run (asyncio/base_events.py:607);sse (cbjax/entrypoints/openai/serving.py:152);"
        "model_dump_json (pydantic/main.py:587) 30",
        "thread (11): MainThread;run (asyncio/base_events.py:607);_run_once (asyncio/base_events.py:1922) 20",
        "thread (12): cbjax-engine-core;_step (cbjax/engine/core_client.py:120);schedule (cbjax/core/sched/scheduler.py:90);"
        "append (collections/__init__.py:10) 150",
    ])
    shares = gil_shares(raw, num_samples=1000)
    assert list(shares) == ["cbjax-engine-core", "MainThread"]  # most GIL first
    assert shares["cbjax-engine-core"]["gil_share"] == pytest.approx(0.15)
    assert shares["MainThread"]["gil_share"] == pytest.approx(0.05)  # 30 + 20 of 1000
    assert shares["MainThread"]["top_frames"] == [
        ("sse (cbjax/entrypoints/openai/serving.py:152)", 30), ("_run_once (asyncio/base_events.py:1922)", 20)]
    assert shares["cbjax-engine-core"]["top_frames"] == [("schedule (cbjax/core/sched/scheduler.py:90)", 150)]
