"""The server's own bounds (issue 35): fan-out per request, an overload gate that counts what is
really queued, validation errors that stay small, tokenization off the event loop, unsupported
fields refused by name, 500 for bugs, and stream headers before the first token.

The app runs in uvicorn on 127.0.0.1 in a thread, over a stand-in for AsyncLLM (FakeEngine) whose
timing the tests hold: what is under test is the HTTP layer, not the model (tests/entrypoints/
test_server.py runs the same routes over the real engine).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import threading
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry
from server_process import free_port
from tiny_checkpoint import TINY_VOCAB, write_tiny_tokenizer

from cbjax.entrypoints.openai import completions, serving
from cbjax.entrypoints.openai.app import build_app
from cbjax.entrypoints.openai.serving import ServerState
from cbjax.outputs import CompletionOutput, RequestMetrics, RequestOutput
from cbjax.sampling_params import RequestOutputKind, SamplingParams
from cbjax.tokenizer.tokenizer import Tokenizer

MAX_MODEL_LEN = 128
MAX_WAITING = 8
MAX_COMPLETIONS = 6
MAX_STOP_STRINGS = 3
COMPLETION = {"prompt": "Once upon a time", "max_tokens": 4}


class FakeEngine:
    """The surface of AsyncLLM the server uses. Each request answers `num_tokens` tokens (id 42), one
    per `token_interval` s, once `released` is set; the stats say the core runs and queues nothing,
    as they do before it has applied a burst of adds."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.model_config = dataclasses.make_dataclass("ModelConfig", [("vocab_size", int)])(TINY_VOCAB)
        self.engine_config = dataclasses.make_dataclass("EngineConfig", [("model", str)])("fake")
        self.released = threading.Event()
        self.released.set()
        self.token_interval = 0.0
        self.num_tokens = 4
        self.started: list[str] = []

    async def generate(self, prompt: dict, params: SamplingParams, request_id: str, *, priority: int = 0,
                       lora_request=None) -> AsyncIterator[RequestOutput]:
        self.started.append(request_id)
        while not self.released.is_set():
            await asyncio.sleep(0.005)
        metrics = RequestMetrics(time.monotonic(), None, None, None, 0)
        for step in range(1, self.num_tokens + 1):
            await asyncio.sleep(self.token_interval)
            last = step == self.num_tokens
            if params.output_kind is RequestOutputKind.DELTA or last:
                count = 1 if params.output_kind is RequestOutputKind.DELTA else step
                outputs = [CompletionOutput(index, "x" * count, [42] * count, "length" if last else None)
                           for index in range(params.n)]
                yield RequestOutput(request_id, prompt.get("prompt"), prompt["prompt_token_ids"], outputs, last,
                                    metrics)

    def check_request(self, prompt: dict, params: SamplingParams, priority: int = 0) -> None:
        if priority:
            raise ValueError(f"priority={priority} needs --scheduling-policy priority")

    async def get_stats(self) -> dict:
        return {"num_waiting": 0, "num_running": 0}

    def num_waiting_requests(self) -> int:
        return 0

    def check_health(self) -> None:
        pass


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> FakeEngine:
    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(tokenizer_dir)
    return FakeEngine(Tokenizer.from_dir(tokenizer_dir))


@pytest.fixture(scope="module")
def state(engine) -> ServerState:
    return ServerState(engine, "fake", MAX_MODEL_LEN, MAX_WAITING, MAX_COMPLETIONS, MAX_STOP_STRINGS)


@pytest.fixture(scope="module")
def url(state) -> str:
    gc.freeze()  # as `cbjax serve` does once ready: collections do not rescan the test session's heap
    app = build_app(state, CollectorRegistry(), None, 16 * 2**20)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(30)
    gc.unfreeze()


@pytest.fixture
def fresh(engine, state):
    """Each test starts from an idle server and leaves it idle."""
    engine.released.set()
    engine.token_interval, engine.num_tokens = 0.0, 4
    yield engine
    engine.released.set()
    deadline = time.monotonic() + 10
    while state.num_unfinished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state.num_unfinished == 0, "every admitted completion was counted out again"


def post(url: str, path: str, body: dict | bytes, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60,
                      **kwargs)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:2000]
    return response.json()["error"]


# ---- 4: fan-out -----------------------------------------------------------------------------


@pytest.mark.parametrize("body, param, words", [
    (COMPLETION | {"n": 1_000_000}, "n", ["n=1000000", f"limit is {MAX_COMPLETIONS}", "--max-completions-per-request"]),
    ({"prompt": ["hi"] * 4, "n": 2, "max_tokens": 4}, "n", ["4 prompt(s) x n=2 = 8", "--max-completions-per-request"]),
    ({"prompt": [[5, 6]] * 100_000, "max_tokens": 4}, "n", ["100000 prompt(s)", "--max-completions-per-request"]),
    (COMPLETION | {"stop": ["a", "b", "c", "d"]}, "stop", ["4 strings", f"limit is {MAX_STOP_STRINGS}",
                                                           "--max-stop-strings"]),
])
def test_fan_out_past_the_limits_is_refused_before_anything_is_queued(url, fresh, body, param, words):
    started = len(fresh.started)
    error = error_of(post(url, "/v1/completions", body), 400)
    assert error["param"] == param and all(word in error["message"] for word in words), error
    assert len(fresh.started) == started, "nothing reached the engine"


def test_chat_n_is_bounded_too(url, fresh):
    body = {"messages": [{"role": "user", "content": "hi"}], "n": MAX_COMPLETIONS + 1, "max_tokens": 4}
    assert "--max-completions-per-request" in error_of(post(url, "/v1/chat/completions", body), 400)["message"]
    body["n"] = MAX_COMPLETIONS
    assert len(post(url, "/v1/chat/completions", body).json()["choices"]) == MAX_COMPLETIONS


def test_overload_gate_counts_completions_the_core_has_not_applied_yet(url, state, fresh):
    """The core's stats say nothing waits (it has not applied the adds yet); the gate still counts
    what this server sent: with n=4 and --max-waiting-requests 8, two requests fill the queue."""
    fresh.released.clear()

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async def one(delay: float) -> httpx.Response:
                await asyncio.sleep(delay)  # in order: the first ones in are the ones admitted
                return await http.post("/v1/completions", json=COMPLETION | {"n": 4})

            tasks = [asyncio.create_task(one(0.05 * i)) for i in range(5)]
            deadline = time.monotonic() + 10
            while sum(task.done() for task in tasks) < 3:  # the refused ones answer at once
                assert time.monotonic() < deadline, "the refused requests never answered"
                await asyncio.sleep(0.01)
            queued = state.num_unfinished
            fresh.released.set()
            return queued, await asyncio.gather(*tasks)

    queued, answers = asyncio.run(burst())
    assert queued == 8, "the two admitted requests count 4 completions each"
    assert [a.status_code for a in answers] == [200, 200, 503, 503, 503]
    refused = answers[2]
    assert int(refused.headers["Retry-After"]) >= 1
    assert "8 completions are already queued" in refused.json()["error"]["message"]
    assert post(url, "/v1/completions", COMPLETION | {"n": 4}).status_code == 200, "the queue drained"


def test_a_stream_whose_client_hung_up_is_counted_out(url, state, fresh):
    fresh.released.clear()
    with httpx.stream("POST", url + "/v1/completions", json=COMPLETION | {"stream": True, "n": 3}) as response:
        assert response.status_code == 200
        deadline = time.monotonic() + 10
        while state.num_unfinished != 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    # The fixture checks that the count goes back to zero once the client hung up.


def test_outputs_never_read_are_counted_out_when_dropped(state, fresh):
    """A client that leaves before its answer starts: the outputs admit() returned are never iterated."""
    params = [SamplingParams(n=2, max_tokens=4)]

    async def admit_and_drop() -> int:
        outputs = await serving.admit(state, [{"prompt": None, "prompt_token_ids": [5]}], params, "dropped",
                                      priority=0)
        counted = state.num_unfinished
        del outputs
        return counted

    assert asyncio.run(admit_and_drop()) == 2
    gc.collect()
    assert state.num_unfinished == 0


# ---- 5: validation errors stay small ------------------------------------------------------------

WRONG_ITEMS = 100_000


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["a", 1] * WRONG_ITEMS}),
    ("/v1/completions", {"prompt": [[1, "x"]] * WRONG_ITEMS}),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": ["x"] * WRONG_ITEMS}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): "x" for i in range(WRONG_ITEMS)}}),
    ("/v1/chat/completions", {"messages": [{"role": 1}] * WRONG_ITEMS}),
    ("/detokenize", {"tokens": ["x"] * WRONG_ITEMS}),
])
def test_a_body_of_100k_wrong_items_gets_a_small_400_fast(url, fresh, path, body):
    content = json.dumps(body).encode()
    assert len(content) > 400_000
    start = time.monotonic()
    response = post(url, path, content)
    elapsed = time.monotonic() - start
    error = error_of(response, 400)
    assert len(response.content) < 4096, len(response.content)
    assert elapsed < 1.0, f"{elapsed:.2f} s"
    assert error["param"] and error["param"].split(".")[0] in body, error


def test_validation_message_names_the_first_errors_and_counts_the_rest(url, fresh):
    body = {"prompt": "hi", "n": "a", "temperature": "b" * 10_000, "top_p": "c", "top_k": "d", "seed": "e",
            "min_p": "f", "max_tokens": "g"}
    error = error_of(post(url, "/v1/completions", body), 400)
    assert error["message"].count(": Input should be") == 5 and error["message"].endswith("... and 2 more")
    assert "'a'" in error["message"] and len(error["message"]) < 1000


# ---- 6: tokenization off the event loop -------------------------------------------------------------


def test_a_huge_prompt_being_tokenized_does_not_stall_another_stream(url, fresh):
    """A stream's chunks come every 10 ms while a 2 MiB prompt (seconds of tokenizing) is posted:
    no gap between them grows beyond a few hundred ms (on the event loop, the gap was the whole
    tokenization)."""
    fresh.token_interval, fresh.num_tokens = 0.01, 100_000
    huge = " ".join(f"word{i} café 東京" for i in range(2**21 // 16))

    async def run() -> tuple[float, float, httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            gaps: list[float] = []
            posted, answered = asyncio.Event(), asyncio.Event()

            async def stream() -> None:
                async with http.stream("POST", "/v1/completions", json=COMPLETION | {"stream": True}) as response:
                    last = None
                    async for line in response.aiter_lines():
                        now = time.monotonic()
                        if line.startswith("data: {") and last is not None and posted.is_set():
                            gaps.append(now - last)
                        last = now
                        if answered.is_set():
                            return  # hang up: the engine's request is aborted

            streaming = asyncio.create_task(stream())
            await asyncio.sleep(0.3)
            posted.set()
            start = time.monotonic()
            answer = await http.post("/v1/completions", json={"prompt": huge, "max_tokens": 4})
            tokenizing = time.monotonic() - start
            answered.set()
            await streaming
            return max(gaps), tokenizing, answer

    max_gap, tokenizing, answer = asyncio.run(run())
    assert "maximum context length" in error_of(answer, 400)["message"], "the huge prompt was tokenized"
    assert tokenizing > 1.0, "the prompt is long enough to show a stall"
    assert max_gap < 0.3, f"a stream stalled {max_gap:.2f} s while a prompt took {tokenizing:.2f} s to tokenize"


def test_tokenize_route_answers_as_the_tokenizer(url, fresh, engine):
    tokens = post(url, "/tokenize", {"prompt": "Paris is the capital"}).json()["tokens"]
    assert tokens == engine.tokenizer.backend.encode("Paris is the capital").ids


# ---- 8: fields, error statuses, stream headers ----------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("path, extra, names", [
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, ["functions"]),
    ("/v1/chat/completions", {"structural_tag": {"type": "structural_tag"}}, ["structural_tag"]),
    ("/v1/completions", {"suffix": "end"}, ["suffix"]),
    ("/v1/completions", {"best_of": 3, "use_beam_search": True}, ["best_of", "use_beam_search"]),
    ("/v1/completions", {"prompt_logprobs": 1}, ["prompt_logprobs"]),
])
def test_unsupported_fields_are_refused_by_name(url, fresh, path, extra, names):
    body = (CHAT if "chat" in path else COMPLETION) | extra
    error = error_of(post(url, path, body), 400)
    assert error["param"] == names[0] and all(name in error["message"] for name in names), error
    assert "not supported" in error["message"]


def test_tools_without_a_tool_call_parser_are_refused_unless_tool_choice_is_none(url, fresh):
    """vLLM's rule: "auto" (the default with tools) needs --enable-auto-tool-choice and a parser."""
    tools = {"tools": [{"type": "function", "function": {"name": "f"}}]}
    error = error_of(post(url, "/v1/chat/completions", CHAT | tools), 400)
    assert error["param"] == "tool_choice" and "--enable-auto-tool-choice" in error["message"], error
    assert post(url, "/v1/chat/completions", CHAT | tools | {"tool_choice": "none"}).status_code == 200


def test_fields_that_ask_for_nothing_and_unknown_fields_are_answered(url, fresh, caplog):
    noop = {"response_format": {"type": "text"}, "tool_choice": "none", "tools": [], "best_of": 1}
    assert post(url, "/v1/chat/completions", CHAT | noop).status_code == 200
    with caplog.at_level(logging.WARNING, logger="cbjax.entrypoints.openai.serving"):
        assert post(url, "/v1/completions", COMPLETION | {"frobnicate": 1}).status_code == 200
    assert "ignored: ['frobnicate']" in caplog.text


def test_stream_options_without_stream_is_refused_as_vllm_does(url, fresh):
    body = COMPLETION | {"stream_options": {"include_usage": True}}
    error = error_of(post(url, "/v1/completions", body), 400)
    assert error["message"] == "Stream options can only be defined when `stream=True`."
    assert error["param"] == "stream_options"


def test_a_bug_is_a_500_not_a_400(url, fresh, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("a bug in the server, not in the request")

    monkeypatch.setattr(completions, "completion_logprobs", broken)
    error = error_of(post(url, "/v1/completions", COMPLETION | {"logprobs": 1}), 500)
    assert "a bug in the server" in error["message"]
    lines = [line for line in post(url, "/v1/completions", COMPLETION | {"logprobs": 1, "stream": True}).text.split("\n")
             if line.startswith("data: ")]
    assert json.loads(lines[0][6:])["error"]["code"] == 500 and lines[-1] == "data: [DONE]"


def test_a_stream_sends_its_headers_before_the_first_token(url, fresh):
    fresh.released.clear()  # the engine holds every token back

    async def headers() -> tuple[int, str]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
                request = http.build_request("POST", path, json=body | {"stream": True})
                response = await asyncio.wait_for(http.send(request, stream=True), 5)
                assert (response.status_code, response.headers["content-type"]) == (
                    200, "text/event-stream; charset=utf-8")
                await response.aclose()

    asyncio.run(headers())


def test_a_stream_the_engine_would_refuse_gets_a_400_status(url, fresh):
    error = error_of(post(url, "/v1/completions", COMPLETION | {"stream": True, "priority": 3}), 400)
    assert "priority=3" in error["message"]


def test_serve_help_names_the_limits(capsys):
    from cbjax.entrypoints.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for flag in ("--max-completions-per-request", "--max-stop-strings", "--max-waiting-requests"):
        assert flag in help_text
    assert "(default: 128" in help_text and "(default: 16)" in help_text
