"""`cbjax bench serve --base-url` against a fake OpenAI-compatible streaming server with known timing.

The fake server (stdlib, 127.0.0.1, a free port, stopped by the test) answers each streaming
/v1/completions request with its first chunk after FIRST_S, then one chunk every GAP_S, then a
usage chunk and [DONE], so the expected TTFT, ITL, TPOT and E2EL are known in advance. Sleeps
only ever make a measured time longer, so each check is a lower bound at the known value and an
upper bound with some slack for a busy machine.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time

import pytest

from cbjax.bench.dataset import SyntheticRequest
from cbjax.bench.metrics import serving_metrics
from cbjax.bench.serve_client import drive_server, served_model_name
from cbjax.entrypoints.cli.main import main as cbjax_main

pytest.importorskip("httpx")

FIRST_S, GAP_S, SLACK_S = 0.30, 0.12, 0.25  # long sleeps and wide slack: CI's cores may be busy (0.1 s of slack failed under load)


class FakeServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, tokens_per_chunk: int = 1, reject_max_tokens: int | None = None):
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.tokens_per_chunk = tokens_per_chunk
        self.reject_max_tokens = reject_max_tokens  # answer 400 to requests asking for this many tokens
        self.payloads: list[dict] = []
        self.in_flight = self.peak_in_flight = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class FakeHandler(http.server.BaseHTTPRequestHandler):
    server: FakeServer

    def log_message(self, *args) -> None:  # keep pytest's output clean
        pass

    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        with server.lock:
            server.payloads.append(payload)
            server.in_flight += 1
            server.peak_in_flight = max(server.peak_in_flight, server.in_flight)
        if payload["max_tokens"] == server.reject_max_tokens:
            self.leave()
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "bad request"}}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(FIRST_S)
        for i in range(payload["max_tokens"] // server.tokens_per_chunk):
            if i:
                time.sleep(GAP_S)
            # generated text may hold characters str.splitlines breaks at (vLLM writes them unescaped)
            self.event({"choices": [{"index": 0, "text": "x\u2028\x85\x1c"[: server.tokens_per_chunk + 2], "finish_reason": None}]})
            if i == 0:
                self.wfile.write(b": keep-alive comment\n\n")
        self.event({"choices": [], "usage": {"prompt_tokens": len(payload["prompt"]), "completion_tokens": payload["max_tokens"]}})
        self.leave()  # before [DONE]: once the client has it, it may send its next request
        self.wfile.write(b"data: [DONE]\n\n")

    def leave(self) -> None:
        with self.server.lock:
            self.server.in_flight -= 1

    def event(self, data: dict) -> None:
        self.wfile.write(f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode())
        self.wfile.flush()


@pytest.fixture
def serve():
    servers = []

    def start(**options) -> FakeServer:
        server = FakeServer(**options)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def requests(output_lens: list[int]) -> list[SyntheticRequest]:
    return [SyntheticRequest(prompt_token_ids=list(range(10 + i, 20 + 2 * i)), output_len=n) for i, n in enumerate(output_lens)]


def test_times_ttft_itl_tpot_and_e2el_from_the_stream(serve):
    server = serve()
    reqs = requests([5, 5, 5, 5])
    timelines, errors, duration = asyncio.run(drive_server(server.url, "fake-model", reqs, [0.0] * 4))
    assert errors == [None] * 4
    m = serving_metrics(timelines, duration, percentiles=[50])
    assert (m["completed"], m["failed"]) == (4, 0)
    assert m["total_output_tokens"] == 20
    assert m["total_input_tokens"] == sum(r.prompt_len for r in reqs)
    assert FIRST_S * 1000 <= m["mean_ttft_ms"] <= (FIRST_S + SLACK_S) * 1000
    # ITL and TPOT: the 4 gaps after each first token, as the client saw them (the usage chunk is no
    # token). A busy machine can read a first chunk late and shorten its gap below the server's sleep,
    # so the server's GAP_S bounds only the upper side.
    assert all(len(t.itls) == 4 for t in timelines)
    gaps = [(t.token_times[-1] - t.token_times[0]) / 4 for t in timelines]
    assert m["mean_itl_ms"] == pytest.approx(1000 * sum(gaps) / len(gaps))
    assert m["mean_tpot_ms"] == pytest.approx(1000 * sum(gaps) / len(gaps))
    assert 0 < m["mean_itl_ms"] <= (GAP_S + SLACK_S) * 1000
    e2el = FIRST_S + 4 * GAP_S
    assert e2el * 1000 <= m["mean_e2el_ms"] <= (e2el + 2 * SLACK_S) * 1000
    # what the server was asked: the prompts as token ids, forced lengths, streaming with usage
    sent = sorted(server.payloads[1:], key=lambda p: p["prompt"])  # [0]: the initial test request
    assert [p["prompt"] for p in sent] == [r.prompt_token_ids for r in reqs]
    assert all(p["model"] == "fake-model" and p["max_tokens"] == 5 and p["stream"] and p["ignore_eos"] for p in sent)
    assert all(p["stream_options"] == {"include_usage": True} for p in sent)


def test_chunks_carrying_several_tokens_count_tokens_from_usage_and_itl_per_chunk(serve):
    server = serve(tokens_per_chunk=2)
    timelines, errors, duration = asyncio.run(drive_server(server.url, "fake-model", requests([6]), [0.0]))
    m = serving_metrics(timelines, duration)
    assert m["total_output_tokens"] == 6  # 3 chunks of 2 tokens, as the usage chunk says
    assert len(timelines[0].itls) == 2  # vLLM: one ITL per chunk after the first
    # TPOT spreads the 2 chunk gaps over the 5 tokens after the first: (E2EL - TTFT) / 5, from the
    # chunks' arrival times as the client saw them (a busy machine can read the first chunk late and
    # shorten the gaps below the server's sleeps, so the server's GAP_S bounds only the upper side).
    first, last = timelines[0].token_times[0], timelines[0].token_times[-1]
    assert m["mean_tpot_ms"] == pytest.approx((last - first) / 5 * 1000)
    assert 0 < last - first <= 2 * GAP_S + SLACK_S


def test_max_concurrency_caps_requests_in_flight_and_ttft_counts_from_the_send(serve):
    server = serve()
    timelines, errors, duration = asyncio.run(
        drive_server(server.url, "fake-model", requests([3] * 4), [0.0] * 4, max_concurrency=2)
    )
    assert server.peak_in_flight == 2
    one = FIRST_S + 2 * GAP_S
    assert duration >= 2 * one  # two waves of two
    assert serving_metrics(timelines, duration)["completed"] == 4
    # the second wave waited for a slot, but its TTFT counts from when it was sent, as in vLLM
    # (from the benchmark's start it would be at least one + FIRST_S)
    second_wave = sorted(timelines, key=lambda t: t.send_time)[2:]
    assert all(t.send_time >= one for t in second_wave)
    assert all(FIRST_S <= t.ttft < one + FIRST_S / 2 for t in second_wave)


def test_poisson_send_times_are_kept(serve):
    server = serve()
    offsets = [0.0, 0.3, 0.6]
    timelines, _, _ = asyncio.run(drive_server(server.url, "fake-model", requests([1, 1, 1]), offsets))
    for timeline, offset in zip(timelines, offsets):
        assert offset <= timeline.send_time <= offset + SLACK_S


def test_a_refused_request_fails_alone(serve):
    server = serve(reject_max_tokens=2)
    timelines, errors, duration = asyncio.run(drive_server(server.url, "fake-model", requests([3, 2, 3]), [0.0] * 3))
    assert errors[0] is None and errors[2] is None and errors[1].startswith("HTTP 400")
    m = serving_metrics(timelines, duration)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (2, 1, 6)


def test_cli_writes_vllms_result_keys(serve, tmp_path):
    server = serve()
    out = tmp_path / "result.json"
    assert served_model_name(server.url) == "fake-model"
    cbjax_main([
        "bench", "serve", "--base-url", server.url, "--num-prompts", "3", "--input-len", "8", "--output-len", "2",
        "--vocab-size", "100", "--request-rate", "50", "--max-concurrency", "2", "--result-json", str(out),
    ])
    result = json.loads(out.read_text())
    for key in ("completed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
                "ttfts", "itls", "latencies", "input_lens", "output_lens", "errors", "model_id", "max_concurrency"):
        assert key in result, key
    assert result["model_id"] == "fake-model" and result["completed"] == 3 and result["total_output_tokens"] == 6
    assert len(server.payloads) == 1 + 3 and all(0 <= t < 100 for p in server.payloads for t in p["prompt"])
    assert all(p["temperature"] == 1.0 for p in server.payloads)


def test_an_unreachable_server_or_unknown_model_gets_a_clear_message(serve):
    server = serve(reject_max_tokens=3)
    with pytest.raises(SystemExit, match="initial test request .* failed .*HTTP 400"):
        asyncio.run(drive_server(server.url, "fake-model", requests([3, 5]), [0.0, 0.0]))
    server.shutdown()
    server.server_close()
    with pytest.raises(SystemExit, match="is the server up"):
        served_model_name(server.url)
