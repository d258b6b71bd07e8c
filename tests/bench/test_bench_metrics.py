"""vLLM `bench serve` metric arithmetic on hand-made timelines (numbers worked out by hand)."""

import pytest

from cbjax.bench.metrics import RequestTimeline, parse_goodput, serving_metrics

# Request A: sent at 0, tokens at 0.1, 0.3, 0.6 -> TTFT 100 ms, E2EL 600 ms, TPOT 250 ms, ITLs 200, 300.
# Request B: sent at 1.0, one token at 1.5 -> TTFT 500 ms, E2EL 500 ms, no TPOT, no ITL.
# Request C: sent at 2.0, failed.
A = RequestTimeline(prompt_len=10, send_time=0.0, token_times=[0.1, 0.3, 0.6])
B = RequestTimeline(prompt_len=20, send_time=1.0, token_times=[1.5])
C = RequestTimeline(prompt_len=30, send_time=2.0, success=False)


def test_counts_and_throughputs_skip_failed_requests():
    m = serving_metrics([A, B, C], duration_s=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 4)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.0)
    assert m["total_token_throughput"] == pytest.approx(17.0)


def test_ttft_and_e2el_are_measured_from_the_send_time():
    m = serving_metrics([A, B, C], duration_s=2.0)
    assert m["mean_ttft_ms"] == pytest.approx(300.0)
    assert m["median_ttft_ms"] == pytest.approx(300.0)
    assert m["p99_ttft_ms"] == pytest.approx(100 + 0.99 * 400)
    assert m["mean_e2el_ms"] == pytest.approx(550.0)


def test_tpot_excludes_the_first_token_and_single_token_requests():
    m = serving_metrics([A, B], duration_s=1.0)
    assert m["mean_tpot_ms"] == pytest.approx(250.0)  # (600 - 100) / (3 - 1); B has no TPOT
    assert m["median_tpot_ms"] == pytest.approx(250.0)


def test_itl_pools_every_gap_between_tokens():
    m = serving_metrics([A, B], duration_s=1.0, percentiles=(50, 99.9))
    assert m["mean_itl_ms"] == pytest.approx(250.0)
    assert m["p50_itl_ms"] == pytest.approx(250.0)
    assert m["p99.9_itl_ms"] == pytest.approx(200 + 0.999 * 100)


def test_goodput_counts_requests_meeting_every_slo():
    # TTFT <= 200 ms: only A. TPOT <= 300: A (250) and B (1 token counts as TPOT 0).
    assert serving_metrics([A, B, C], 2.0, goodput_slos_ms={"ttft": 200})["request_goodput"] == pytest.approx(0.5)
    assert serving_metrics([A, B, C], 2.0, goodput_slos_ms={"tpot": 300})["request_goodput"] == pytest.approx(1.0)
    both = {"tpot": 200, "e2el": 550}
    assert serving_metrics([A, B, C], 2.0, goodput_slos_ms=both)["request_goodput"] == pytest.approx(0.5)  # B only


def test_no_completed_requests_gives_zero_statistics():
    m = serving_metrics([C], duration_s=1.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0


def test_goodput_specs_parse_like_vllm_and_reject_unknown_names():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError, match="NAME:MILLISECONDS"):
        parse_goodput(["latency:5"])


def test_latencies_in_ms_for_plots_skip_failed_requests():
    from cbjax.bench.metrics import latencies_ms

    got = latencies_ms([A, B, C])
    assert got["ttft"] == pytest.approx([100.0, 500.0])
    assert got["tpot"] == pytest.approx([250.0])  # B has one token
    assert got["itl"] == pytest.approx([200.0, 300.0])
    assert got["e2el"] == pytest.approx([600.0, 500.0])
