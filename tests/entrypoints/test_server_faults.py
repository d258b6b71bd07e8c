"""`cbjax serve` when its engine core dies (issue 35): every open stream gets an error event and
ends, and the server exits non-zero within 10 s (the cause in its log), so that a supervisor
restarts it. Engine-process mode: the core's process is killed with SIGKILL; thread mode: the
core's step raises (patched in through a sitecustomize on the server's PYTHONPATH)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import psutil
from server_process import REPO, ServerProcess
from test_server import ENGINE_FLAGS, PROMPTS, jax_cache, tiny  # noqa: F401 (module fixtures: a checkpoint, one compile for both servers)

EXIT_BOUND_S = 10
# 3 streams of 16 prompts x 110 tokens on 4 seats: over a thousand steps, all open at the first token.
BUSY = {"model": "tiny", "prompt": [PROMPTS[0]] * 16, "max_tokens": 110, "temperature": 0.0, "ignore_eos": True,
        "stream": True}
FAULTY_STEP = """
import os
from cbjax.engine.llm_engine import LLMEngine

_step = LLMEngine.step


def step(self):
    if os.path.exists(os.environ["CBJAX_TEST_FAULT_FILE"]):
        raise RuntimeError("injected fault in the engine step")
    return _step(self)


LLMEngine.step = step
"""


async def stream_events(http: httpx.AsyncClient, first_chunk: asyncio.Event) -> list[dict | str]:
    """Every event of one streamed completion, until the server ends the stream."""
    events = []
    async with http.stream("POST", "/v1/completions", json=BUSY) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                first_chunk.set()
    return events


def streams_through_a_fault(server: ServerProcess, fault) -> tuple[list[list[dict | str]], float]:
    """Open 3 streams, call `fault()` once the first chunk came; their events, and when the fault came."""
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            started = asyncio.Event()
            streams = [asyncio.create_task(stream_events(http, started)) for _ in range(3)]
            await asyncio.wait_for(started.wait(), 60)
            fault()
            fault_time = time.monotonic()
            return await asyncio.wait_for(asyncio.gather(*streams), EXIT_BOUND_S), fault_time

    return asyncio.run(run())


def assert_every_stream_ended_with_an_error(streams: list[list[dict | str]]) -> None:
    for events in streams:
        errors = [event for event in events if isinstance(event, dict) and "error" in event]
        assert len(errors) == 1 and errors[0]["error"]["code"] == 503, events[-3:]
        assert events[-1] == "[DONE]" and events[-2] is errors[0]
        finished = [c for e in events if isinstance(e, dict) for c in e.get("choices", []) if c["finish_reason"]]
        assert len(finished) < 16, "the stream was still open at the fault"


def assert_the_fault_ends_every_stream_and_the_server(server: ServerProcess, fault, log: Path, cause: str) -> None:
    try:
        streams, fault_time = streams_through_a_fault(server, fault)
        assert_every_stream_ended_with_an_error(streams)
        exit_code = server.process.wait(EXIT_BOUND_S)
        assert time.monotonic() - fault_time < EXIT_BOUND_S and exit_code == 1
    finally:
        server.stop()
    assert cause in log.read_text() and "stopping the server (exit 1)" in log.read_text()


def test_killing_the_engine_core_process_ends_every_stream_and_the_server(tiny, jax_cache, tmp_path):
    server = ServerProcess(tiny[1], tmp_path / "server.log", *ENGINE_FLAGS, "--compilation-cache-dir", jax_cache,
                           "--served-model-name", "tiny", "--engine-process")
    (core,) = [child for child in psutil.Process(server.process.pid).children()
               if "resource_tracker" not in " ".join(child.cmdline())]
    assert_the_fault_ends_every_stream_and_the_server(
        server, lambda: os.kill(core.pid, signal.SIGKILL), tmp_path / "server.log", "exit code -9")


def test_a_core_thread_whose_step_raises_ends_every_stream_and_the_server(tiny, jax_cache, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(FAULTY_STEP)
    fault_file = tmp_path / "fault"
    server = ServerProcess(tiny[1], tmp_path / "server.log", *ENGINE_FLAGS, "--compilation-cache-dir", jax_cache,
                           "--served-model-name", "tiny", "--no-engine-process",
                           env={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]),
                                "CBJAX_TEST_FAULT_FILE": str(fault_file)})
    assert_the_fault_ends_every_stream_and_the_server(
        server, fault_file.touch, tmp_path / "server.log", "injected fault in the engine step")
