"""The engine core thread and AsyncLLM: aborts from other threads, output kinds, early exits, health."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry
from engine_helpers import hf_greedy
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import AsyncLLM, RequestOutputKind, SamplingParams
from cbjax.config import EngineConfig
from cbjax.engine.exceptions import EngineDeadError
from cbjax.engine.llm_engine import LLMEngine
from cbjax.entrypoints.openai.app import build_app
from cbjax.entrypoints.openai.serving import ServerState

OPTIONS = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, block_size=8, num_kv_blocks=80, dtype="float32")
PROMPT = [5, 17, 42, 99, 7, 3, 250]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("async"), "llama")


@pytest.fixture(scope="module")
def engine(tiny):
    return LLMEngine(EngineConfig(model=str(tiny[1]), **OPTIONS), progress=False)


def assert_idle(stats: dict) -> None:
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], "every KV block is back in the pool"


def test_aborts_fired_from_another_thread_during_steps_land_between_steps(engine, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for index in range(6):
        engine.add_request(f"r{index}", {"prompt_token_ids": PROMPT[: index + 2]}, params)
    victims, fired = ["r1", "r3", "r5"], []
    run_step = engine.runner.dispatch

    def step_with_an_abort_from_another_thread(scheduled):
        if len(fired) < len(victims):  # one abort per step, sent while the device step is under way
            fired.append(victims[len(fired)])
            sender = threading.Thread(target=engine.abort_request, args=(fired[-1],))
            sender.start()
            sender.join()
        return run_step(scheduled)

    monkeypatch.setattr(engine.runner, "dispatch", step_with_an_abort_from_another_thread)
    finished = []
    while engine.has_unfinished_requests():
        finished += [output for output in engine.step() if output.finished]
    by_id = {output.request_id: output.outputs[0] for output in finished}
    assert sorted(output.request_id for output in finished) == [f"r{i}" for i in range(6)], "each finishes once"
    for request_id, completion in by_id.items():
        if request_id in victims:
            assert completion.finish_reason == "abort" and len(completion.token_ids) < 20
        else:
            assert completion.finish_reason == "length" and len(completion.token_ids) == 20
    assert_idle(engine.get_stats())
    assert engine.book.requests == {}


class FinishedRecorder:
    """A stat logger that keeps the stats of every finished request the core sees."""

    def __init__(self):
        self.finished = {}

    def record_step(self, iteration):
        self.finished.update({finished.request_id: finished for finished in iteration.finished_requests})


@pytest.fixture(scope="module")
def recorder():
    return FinishedRecorder()


@pytest.fixture(scope="module")
def async_llm(engine, recorder):
    llm = AsyncLLM.from_engine(engine, stat_loggers=[lambda config: recorder])
    yield llm
    llm.shutdown(timeout=10)


async def collect(llm, prompt, params, request_id):
    return [output async for output in llm.generate(prompt, params, request_id)]


def test_output_kinds_cumulative_delta_final_only_agree_with_transformers(async_llm, tiny):
    want = hf_greedy(tiny[0], PROMPT, 12)

    async def run():
        kinds = [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY]
        params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=kind) for kind in kinds]
        return await asyncio.gather(*[
            collect(async_llm, {"prompt_token_ids": PROMPT}, p, f"kind-{p.output_kind.name}") for p in params
        ])

    cumulative, delta, final_only = asyncio.run(run())
    assert cumulative[-1].outputs[0].token_ids == want
    assert [len(o.outputs[0].token_ids) for o in cumulative] == sorted({len(o.outputs[0].token_ids) for o in cumulative})
    assert [t for o in delta for t in o.outputs[0].token_ids] == want
    assert "".join(o.outputs[0].text for o in delta) == cumulative[-1].outputs[0].text
    assert len(final_only) == 1 and final_only[0].finished and final_only[0].outputs[0].token_ids == want
    assert [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]


@pytest.mark.parametrize("leave", ["close", "cancel"])
def test_leaving_the_stream_early_aborts_the_request_and_frees_its_blocks(async_llm, recorder, leave):
    request_id = f"leave-{leave}"
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def read_then_leave():
        if leave == "close":
            async with contextlib.aclosing(async_llm.generate({"prompt_token_ids": PROMPT}, params, request_id)) as it:
                async for _ in it:
                    break
        else:
            started = asyncio.Event()

            async def consume():
                async for _ in async_llm.generate({"prompt_token_ids": PROMPT}, params, request_id):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        deadline = time.monotonic() + 10
        while request_id not in recorder.finished and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return await async_llm.get_stats()

    stats = asyncio.run(read_then_leave())
    finished = recorder.finished[request_id]
    assert finished.finish_reason == "abort" and finished.num_generation_tokens < 100
    assert_idle(stats)


def rejected_requests_raise_while_a_neighbour_is_served(llm, hf_dir) -> None:
    """Bad input (a token outside the vocabulary, a request over max_model_len=128) raises in its
    caller while a good request beside it gets transformers' greedy tokens. Shared with the
    engine-process tests."""
    good = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)

    async def run():
        neighbour = asyncio.create_task(collect(llm, {"prompt_token_ids": PROMPT}, good, "neighbour"))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(llm, {"prompt_token_ids": [1, 10_000]}, good, "bad")
        with pytest.raises(ValueError, match="max_model_len is 128"):
            await collect(llm, {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=500), "too-long")
        return await neighbour

    (output,) = asyncio.run(run())
    assert output.outputs[0].token_ids == hf_greedy(hf_dir, PROMPT, 6)


def test_a_rejected_request_raises_while_its_neighbour_is_served(async_llm, tiny):
    rejected_requests_raise_while_a_neighbour_is_served(async_llm, tiny[0])


def test_a_request_sent_during_a_step_arrives_then_not_when_the_step_ends(async_llm, engine, monkeypatch):
    """As in vLLM, TTFT and queue time count from when the caller handed the request over, so the rest
    of the running step is in them (the core only dequeues it between steps)."""
    run_step, in_step, step_ends = engine.runner.dispatch, threading.Event(), []

    def slow_step(scheduled):
        in_step.set()
        time.sleep(0.3)
        result = run_step(scheduled)
        step_ends.append(time.monotonic())
        return result

    monkeypatch.setattr(engine.runner, "dispatch", slow_step)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)

    async def run():
        busy = asyncio.create_task(collect(async_llm, {"prompt_token_ids": PROMPT}, params, "busy"))
        await asyncio.to_thread(in_step.wait)  # the core is inside busy's first step
        sent = time.monotonic()
        (late,) = await collect(async_llm, {"prompt_token_ids": PROMPT[:3]}, params, "late")
        await busy
        return sent, late.metrics

    sent, metrics = asyncio.run(run())
    first_step_end = step_ends[0]
    assert sent <= metrics.arrival_time < first_step_end <= metrics.first_scheduled_time


def test_health_fails_once_the_engine_loop_died(async_llm, engine, monkeypatch):
    """Runs last in this module: it kills the shared engine's loop."""
    def broken_step(scheduled):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "dispatch", broken_step)
    params = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY)
    with pytest.raises(EngineDeadError, match="device lost"):
        asyncio.run(collect(async_llm, {"prompt_token_ids": PROMPT}, params, "doomed"))
    with pytest.raises(EngineDeadError):
        async_llm.check_health()
    app = build_app(ServerState(async_llm, "tiny", 128, None), CollectorRegistry(), None, 1 << 20)

    async def get_health():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get("/health")

    response = asyncio.run(get_health())
    assert response.status_code == 503
    assert response.json()["error"]["code"] == 503 and "device lost" in response.json()["error"]["message"]
