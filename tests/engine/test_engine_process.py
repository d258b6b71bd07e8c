"""The engine core in its own process (AsyncLLM(engine_process=True)): the same outputs as the engine
core thread, stop strings found by the front end, rejections, aborts, freed blocks, a dead core."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import failing_writer
from test_async_llm import rejected_requests_raise_while_a_neighbour_is_served
from test_async_scheduling import assert_same_outputs
from engine_helpers import hf_greedy
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import AsyncLLM, RequestOutputKind, SamplingParams
from cbjax.config import EngineConfig
from cbjax.engine.core_client import ThreadCoreClient
from cbjax.engine.exceptions import EngineDeadError
from cbjax.engine.llm_engine import LLMEngine
from cbjax.engine.frontend import Frontend
from cbjax.core.protocol import ChildState, empty_progress
from cbjax.core.request import RequestStatus
from cbjax.outputs import Logprob
from cbjax.tokenizer.tokenizer import Tokenizer

# A small pool: 16 requests of up to ~40 tokens do not all fit at once, so some are preempted.
OPTIONS = dict(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=32, block_size=8, num_kv_blocks=20,
               dtype="float32")
PROMPT = [5, 17, 42, 99, 7, 3, 250]
KINDS = list(RequestOutputKind)
SMALL_PIPE_BUFFER, DEFAULT_PIPE_BUFFER = 4096, 212992  # bytes (Linux doubles them; 212992 is its default)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("engine-process"), "llama")


@pytest.fixture(scope="module")
def in_thread(tiny):
    llm = AsyncLLM.from_engine(LLMEngine(EngineConfig(model=str(tiny[1]), **OPTIONS), progress=False))
    yield llm
    llm.shutdown(timeout=10)


@pytest.fixture(scope="module")
def in_process(tiny):
    llm = AsyncLLM(str(tiny[1]), engine_process=True, progress=False, **OPTIONS)
    yield llm
    llm.shutdown(timeout=30)


async def collect(llm, prompt, params, request_id):
    return [output async for output in llm.generate(prompt, params, request_id)]


def run_all(llm, requests):
    async def run():
        return await asyncio.gather(*[collect(llm, prompt, params, rid) for rid, prompt, params in requests])

    return dict(zip([rid for rid, _, _ in requests], asyncio.run(run())))


def wait_idle(llm, timeout=10):
    """The stats once every request left and its blocks are back (they come with the core's next message)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = asyncio.run(llm.get_stats())
        if stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"not idle after {timeout} s: {stats}")


def completions(outputs, kind):
    """Per completion: what the caller ends with (DELTA: every delta joined; else the last output)."""
    last = outputs[-1]
    assert last.finished and all(not o.finished for o in outputs[:-1])
    result = []
    for index, completion in enumerate(last.outputs):
        if kind is RequestOutputKind.DELTA:
            parts = [o.outputs[index] for o in outputs]
            text, token_ids = "".join(p.text for p in parts), [t for p in parts for t in p.token_ids]
            logprobs = [d for p in parts for d in (p.logprobs or [])] if completion.logprobs is not None else None
        else:
            text, token_ids, logprobs = completion.text, completion.token_ids, completion.logprobs
        result.append((text, token_ids, completion.finish_reason, completion.stop_reason, plain(logprobs),
                       completion.cumulative_logprob))
    return result, plain(last.prompt_logprobs)


def plain(logprobs):
    """Logprob objects as (logprob, rank, text) tuples, for assert_same_outputs's tolerance on floats."""
    if isinstance(logprobs, Logprob):
        return (logprobs.logprob, logprobs.rank, logprobs.decoded_token)
    if isinstance(logprobs, dict):
        return {token: plain(value) for token, value in logprobs.items()}
    if isinstance(logprobs, list):
        return [plain(value) for value in logprobs]
    return logprobs


def random_workload(rng: random.Random, stops: list[str], count: int):
    requests = []
    for i in range(count):
        kind = rng.choice(KINDS)
        options = dict(max_tokens=rng.randint(1, 30), output_kind=kind, ignore_eos=rng.random() < 0.5)
        if rng.random() < 0.5:
            options |= dict(temperature=0.9, seed=rng.randint(0, 1000), top_k=rng.choice([0, 20]))
        else:
            options |= dict(temperature=0.0)
        if rng.random() < 0.4:
            options["stop"] = [rng.choice(stops)]
            options["include_stop_str_in_output"] = rng.random() < 0.5
        if rng.random() < 0.3:
            options["stop_token_ids"] = [rng.randrange(300)]
        if rng.random() < 0.3:
            options |= dict(logprobs=2, prompt_logprobs=1)
        if rng.random() < 0.2:
            options |= dict(n=2, temperature=0.9, seed=rng.randint(0, 1000))
        if rng.random() < 0.2:
            options |= dict(presence_penalty=0.5, repetition_penalty=1.2)
        prompt = [rng.randrange(1, 300) for _ in range(rng.randint(1, 12))]
        requests.append((f"w{i}", {"prompt_token_ids": prompt}, SamplingParams(**options)))
    return requests


def test_outputs_match_the_engine_core_thread_on_a_random_workload(in_thread, in_process, tiny):
    # Stop strings the tiny model really produces: pieces of its greedy text after PROMPT.
    probe = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    (reference,) = run_all(in_thread, [("probe", {"prompt_token_ids": PROMPT}, probe)])["probe"]
    text = reference.outputs[0].text
    assert reference.outputs[0].token_ids == hf_greedy(tiny[0], PROMPT, 24)
    stops = [text[i : i + 2] for i in range(2, len(text) - 2, 3) if text[i : i + 2].strip()] or [text[-2:]]
    rng = random.Random(0)
    requests = random_workload(rng, stops, 16)
    # The probe's prompt with each stop string: a stop the front end finds for sure.
    requests += [(f"stop{i}", {"prompt_token_ids": PROMPT}, SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], output_kind=kind))
        for i, (stop, kind) in enumerate(zip(stops, KINDS * len(stops)))]
    want, got = run_all(in_thread, requests), run_all(in_process, requests)
    for request_id, _, params in requests:
        # Tokens, text and ranks exactly; logprobs within 1e-4 (the two loops batch the rows differently)
        assert_same_outputs(completions(got[request_id], params.output_kind),
                            completions(want[request_id], params.output_kind))
    stopped = [c for rid, _, _ in requests for c in want[rid][-1].outputs if isinstance(c.stop_reason, str)]
    assert len(stopped) >= len(stops), "the stop strings were found"
    assert wait_idle(in_process)["num_preemptions"] > 0, "the small pool preempted some requests"
    wait_idle(in_thread)


def test_a_stop_string_ends_the_stream_and_frees_the_core_blocks(in_process, in_thread):
    def params(**stop):
        return SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, output_kind=RequestOutputKind.DELTA, **stop)

    full = "".join(o.outputs[0].text for o in run_all(in_thread, [("full", {"prompt_token_ids": PROMPT}, params())])["full"])
    stop = full[4:6]
    stopped = run_all(in_process, [("stopped", {"prompt_token_ids": PROMPT}, params(stop=[stop]))])["stopped"]
    text = "".join(o.outputs[0].text for o in stopped)
    assert stopped[-1].outputs[0].stop_reason == stop and stopped[-1].outputs[0].finish_reason == "stop"
    assert full.startswith(text + stop) and stop not in text and len(stopped[-1].metrics.__dict__) > 0
    assert sum(len(o.outputs[0].token_ids) for o in stopped) < 60
    wait_idle(in_process)  # the core stopped it when told, and its blocks are back


def test_the_front_end_gives_a_skipped_row_to_nobody(tiny):
    """Made by hand, the messages of a race: "x" finishes (here by an abort; a stop string found
    by the front end frees its id the same way, at once), a new "x" is added, and the core
    sends the step it had in flight with the old "x" (a row it skipped): the new "x" gets nothing,
    and its own first token lands on it."""
    stops = []
    frontend = Frontend(Tokenizer.from_dir(tiny[1]), [2], stops.append)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    frontend.add_request("x", [5, 6], params, 0.0, None)
    first = frontend.apply(step(["x"], [11]))
    old = frontend.book.requests["x"].children[0]
    (delta,) = frontend.outputs(first)
    assert delta.outputs[0].token_ids == [11] and not delta.finished
    old_state = ChildState("x", RequestStatus.FINISHED_ABORTED.value, None, 1.0, 1.0, 2.0, 0, 0)
    (final,) = frontend.outputs(frontend.apply(step([], [], aborted=[old_state])))
    assert final.finished and final.outputs[0].finish_reason == "abort" and old.output_token_ids == [11]
    frontend.add_request("x", [9, 9, 9], params, 3.0, None)
    assert frontend.outputs(frontend.apply(step(["x"], [12], skipped=[0]))) == []  # the old x's row
    new = frontend.book.requests["x"].children[0]
    assert new is not old and new.output_token_ids == [] and old.output_token_ids == [11]
    (delta,) = frontend.outputs(frontend.apply(step(["x"], [13])))
    assert delta.outputs[0].token_ids == [13] and new.output_token_ids == [13] and stops == []


def step(row_ids, token_ids, skipped=(), aborted=()):
    progress = empty_progress({}, aborted=list(aborted))
    progress.row_ids, progress.token_ids, progress.skipped = row_ids, token_ids, list(skipped)
    return progress


def test_bad_options_raise_in_the_caller_as_in_one_process(tiny):
    options = {**OPTIONS, "num_kv_blocks": 3}  # fewer blocks than one max_model_len request needs
    with pytest.raises(ValueError) as in_one_process:
        LLMEngine(EngineConfig(model=str(tiny[1]), **options), progress=False)
    with pytest.raises(ValueError) as in_a_child:
        AsyncLLM(str(tiny[1]), engine_process=True, progress=False, **options)
    assert str(in_a_child.value) == str(in_one_process.value)


PARENT_BACKENDS = """
import sys
from jax._src import xla_bridge
import cbjax.entrypoints.openai.server  # what cbjax serve imports
from cbjax import AsyncLLM
if __name__ == "__main__":
    llm = AsyncLLM(sys.argv[1], engine_process=True, progress=False, **eval(sys.argv[2]))
    print("backends:", sorted(xla_bridge._backends))
    llm.shutdown(timeout=30)
"""


def test_the_parent_process_never_starts_a_jax_backend(tiny, tmp_path):
    """On a GPU the first backend a process starts takes most of the GPU's memory: only the core may."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT_BACKENDS)
    done = subprocess.run([sys.executable, str(script), str(tiny[1]), repr(OPTIONS)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "backends: []" in done.stdout


def test_a_rejected_request_raises_while_its_neighbour_is_served(in_process, tiny):
    rejected_requests_raise_while_a_neighbour_is_served(in_process, tiny[0])
    wait_idle(in_process)


def test_leaving_the_stream_early_aborts_the_request_and_frees_its_blocks(in_process):
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def read_then_leave():
        async with contextlib.aclosing(in_process.generate({"prompt_token_ids": PROMPT}, params, "leaver")) as it:
            async for _ in it:
                break

    asyncio.run(read_then_leave())
    stats = wait_idle(in_process)
    assert stats["num_running"] == 0


def test_priority_reaches_every_child_request(tiny):
    engine = LLMEngine(EngineConfig(model=str(tiny[1]), scheduling_policy="priority", **OPTIONS),
                       precompile=False, progress=False)
    params = SamplingParams(temperature=0.9, seed=1, max_tokens=2, n=2)
    engine.add_request("urgent", {"prompt_token_ids": PROMPT}, params, priority=-3)
    engine.add_request("plain", {"prompt_token_ids": PROMPT}, params)
    assert [(request.request_id, request.priority) for request in engine.scheduler.requests.values()] == [
        ("0_urgent", -3), ("1_urgent", -3), ("0_plain", 0), ("1_plain", 0)]


@pytest.mark.parametrize("client", ["in_thread", "in_process"])
def test_a_priority_reaches_the_core_through_either_client(client, request):
    """The fcfs policy refuses a priority (vLLM's rule): that refusal comes back from the core, and a
    request beside it is served."""
    llm = request.getfixturevalue(client)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)

    async def run():
        with pytest.raises(ValueError, match="priority=-3 is only allowed with scheduling_policy='priority'"):
            await collect_with_priority(llm, params, "urgent", -3)
        return await collect_with_priority(llm, params, "plain", 0)

    (output,) = asyncio.run(run())
    assert output.finished and len(output.outputs[0].token_ids) == 2
    wait_idle(llm)


@pytest.mark.parametrize("client", ["in_thread", "in_process"])
def test_check_request_raises_in_the_caller_what_generate_would(client, request):
    """AsyncLLM.check_request (issue 35): the core's checks, run at once in the caller with the limits
    the core sent, so a server answers 400 before it opens a stream, in either core mode."""
    llm = request.getfixturevalue(client)
    good = SamplingParams(temperature=0.0, max_tokens=4)
    llm.check_request({"prompt_token_ids": PROMPT}, good)
    llm.check_request("a text prompt", good)
    prompt = {"prompt_token_ids": PROMPT}
    for bad_prompt, params, priority, why in [
        ({"prompt_token_ids": [1, 10_000]}, good, 0, "prompt token id 10000 is outside the vocabulary"),
        (prompt, SamplingParams(max_tokens=500), 0, "max_model_len is 128"),
        (prompt, SamplingParams(stop_token_ids=[8589934592]), 0, r"\[8589934592\] in stop_token_ids are outside"),
        (prompt, good, -3, "priority=-3 is only allowed with scheduling_policy='priority'"),
        (prompt, good, 2**70, "priority=1180591620717411303424 is only allowed"),
    ]:
        with pytest.raises(ValueError, match=why):
            llm.check_request(bad_prompt, params, priority)


@pytest.mark.parametrize("client", ["in_thread", "in_process"])
def test_generate_takes_vllms_prompt_forms(client, request, tiny):
    """AsyncLLM.generate takes a str, a TextPrompt and a TokensPrompt (issue 35, defect 11) in either
    core mode, and refuses by name a key for inputs cbjax does not take."""
    llm = request.getfixturevalue(client)
    token_ids = llm.get_tokenizer().encode("hello world")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    forms = ["hello world", {"prompt": "hello world"}, {"prompt_token_ids": token_ids}]
    outputs = run_all(llm, [(f"form{index}", prompt, params) for index, prompt in enumerate(forms)])
    expected = hf_greedy(tiny[0], token_ids, 4)
    for (output,) in outputs.values():
        assert output.prompt_token_ids == token_ids and output.outputs[0].token_ids == expected
    with pytest.raises(ValueError, match=r"prompt keys \['multi_modal_data'\] are vLLM inputs cbjax does not take"):
        asyncio.run(collect(llm, {"prompt": "hello world", "multi_modal_data": {"image": None}}, params, "image"))
    wait_idle(llm)


def test_a_request_the_core_cannot_prepare_fails_alone(in_process, tiny):
    """Issue 35: a request whose sampling row the core's runner cannot write (its column writer
    raising, for that request alone) fails in its caller with a ValueError, as a refused one does;
    its neighbours get transformers' tokens, and every block comes back."""
    good = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    prompts = [PROMPT, PROMPT[2:]]
    in_process.core.call(failing_writer.patch_core_writers, True, timeout=30)
    try:
        async def run():
            neighbours = [asyncio.create_task(collect(in_process, {"prompt_token_ids": prompt}, good, f"good{index}"))
                          for index, prompt in enumerate(prompts)]
            with pytest.raises(ValueError, match=r"could not prepare this request.*OverflowError"):
                await collect(in_process, {"prompt_token_ids": PROMPT}, failing_writer.MARKED, "marked")
            return await asyncio.gather(*neighbours)

        results = asyncio.run(run())
    finally:
        in_process.core.call(failing_writer.patch_core_writers, False, timeout=30)
    for prompt, (output,) in zip(prompts, results):
        assert output.outputs[0].token_ids == hf_greedy(tiny[0], prompt, 6)
    wait_idle(in_process)


def test_a_completion_the_core_cannot_prepare_stops_its_siblings_there_too(in_process):
    """Of an n=3 request, the second completion fails when it joins the batch: its caller gets the
    error, and the other two stop in the core at once instead of running their 100 tokens."""
    in_process.core.call(failing_writer.patch_core_writers, True, timeout=30)
    try:
        with pytest.raises(ValueError, match=r"could not prepare this request.*OverflowError"):
            asyncio.run(collect(in_process, {"prompt_token_ids": PROMPT}, failing_writer.ONE_OF_THREE_FAILS, "one"))
        steps_at_error = in_process.core.call(failing_writer.core_num_steps, timeout=30)
        steps_when_idle = wait_idle(in_process)["num_steps"]
    finally:
        in_process.core.call(failing_writer.patch_core_writers, False, timeout=30)
    assert steps_when_idle - steps_at_error <= 5


async def collect_with_priority(llm, params, request_id, priority):
    return [o async for o in llm.generate({"prompt_token_ids": PROMPT}, params, request_id, priority=priority)]


def run_in_thread_within(seconds: float, main):
    """asyncio.run(main()) in a thread; AssertionError if it has not returned within `seconds` (a
    deadlock may block the event loop itself, where no asyncio timeout fires)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(asyncio.run(main())), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: deadlocked"
    return result[0]


def set_pipe_buffer(_engine_core=None, size: int = SMALL_PIPE_BUFFER) -> None:
    """Set the send buffer of this process's ends of the engine-core pipe (its only Unix sockets)."""
    for fd in map(int, os.listdir("/proc/self/fd")):
        with contextlib.suppress(OSError):
            with socket.socket(fileno=os.dup(fd)) as end:  # (a duplicate: closing it leaves the pipe open)
                if end.family == socket.AF_UNIX:
                    end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)


def test_a_flood_of_early_stops_with_a_slow_front_end_never_deadlocks_the_pipe(in_process, in_thread, monkeypatch):
    """Issue 35: both directions of the pipe full at once. The front end falls behind (its reader
    applies steps slowly, so the core blocks sending progress) while the event loop sends a flood of
    adds whose stop strings match early (each match sends a stop). With blocking sends (the reader's
    stop under the front end's lock, the event loop's adds, the core's progress while it reads no
    commands) both processes wedge; with an I/O thread per direction every request finishes. Small
    pipe buffers make the overload that fills them on a busy server happen with a few requests."""
    prompt = {"prompt_token_ids": PROMPT * 4}
    probe = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    (reference,) = run_all(in_thread, [("probe", prompt, probe)])["probe"]
    stop = reference.outputs[0].text[1:3]
    early_stop = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop], logprobs=5,
                                output_kind=RequestOutputKind.DELTA)
    apply = in_process.core._apply
    monkeypatch.setattr(in_process.core, "_apply", lambda steps: (time.sleep(0.02), apply(steps)))
    in_process.core.call(set_pipe_buffer, timeout=60)
    set_pipe_buffer()

    async def flood():
        tasks = []
        for wave in range(10):
            tasks += [asyncio.create_task(collect(in_process, prompt, early_stop, f"flood{wave}.{i}")) for i in range(10)]
            await asyncio.sleep(0.02)
        return await asyncio.gather(*tasks)

    results = run_in_thread_within(60, flood)
    assert [outputs[-1].outputs[0].stop_reason for outputs in results] == [stop] * 100
    monkeypatch.undo()
    in_process.core.call(set_pipe_buffer, DEFAULT_PIPE_BUFFER, timeout=60)
    set_pipe_buffer(size=DEFAULT_PIPE_BUFFER)
    wait_idle(in_process)


@pytest.mark.parametrize("client", ["in_thread", "in_process"])
def test_an_abort_of_one_child_ends_it_alone_and_a_request_aborted_twice_ends_once(client, request):
    """Issue 35, defect 10: an abort may name one completion of an n > 1 request by its child id
    (vLLM's "{index}_{id}"): it alone ends, "abort", its siblings run to their length, and the request
    gets one final output. A request aborted twice before the core applies either (a client gone and
    a shutdown) ends once; the first core to see it finished and forgot it twice, and died."""
    llm = request.getfixturevalue(client)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=100, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def read(request_id, *aborts):
        outputs = []
        async for output in llm.generate({"prompt_token_ids": PROMPT}, params, request_id):
            for abort in aborts if not outputs else ():
                await llm.abort(abort)
            outputs.append(output)
        return outputs

    one_child = asyncio.run(read("three", "1_three"))
    assert [output.finished for output in one_child] == [False] * (len(one_child) - 1) + [True]
    assert [c.finish_reason for c in one_child[-1].outputs] == ["length", "abort", "length"]
    assert [sum(len(o.outputs[i].token_ids) for o in one_child) for i in (0, 2)] == [100, 100]
    twice = asyncio.run(read("twice", "twice", "twice"))
    assert [output.finished for output in twice][-1] and sum(output.finished for output in twice) == 1
    assert [c.finish_reason for c in twice[-1].outputs] == ["abort"] * 3
    llm.check_health()
    wait_idle(llm)


class EngineWhoseStepRaises:
    """An LLMEngine stand-in for ThreadCoreClient: it takes requests, and its first step raises."""

    def __init__(self):
        self.request_ids = []

    def get_stats(self):
        return {}

    def has_unfinished_requests(self):
        return bool(self.request_ids)

    def add_request(self, request_id, *_):
        self.request_ids.append(request_id)

    def abort_request(self, request_id):
        self.request_ids.remove(request_id)

    def step(self):
        raise RuntimeError("injected fault in the step")


def test_an_add_after_the_core_thread_died_fails_at_once():
    """Issue 35: the dying loop drained its commands once; an add queued after that waited forever."""
    client = ThreadCoreClient(EngineWhoseStepRaises())
    client.start()
    running, late = queue.SimpleQueue(), queue.SimpleQueue()
    client.add_request("running", {"prompt_token_ids": PROMPT}, SamplingParams(), running.put)
    assert isinstance(running.get(timeout=10), EngineDeadError)
    client.thread.join(10)
    client.add_request("late", {"prompt_token_ids": PROMPT}, SamplingParams(), late.put)
    error = late.get(timeout=1)
    assert isinstance(error, EngineDeadError) and "injected fault in the step" in str(error)
    client.abort_request("late")  # (nothing to abort, and no error)
    client.shutdown(timeout=1)


def _exit_now(engine):
    os._exit(3)


def test_a_core_that_dies_fails_every_caller(in_process):
    """Runs last in this module: it kills the shared engine core."""
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def run():
        stream = in_process.generate({"prompt_token_ids": PROMPT}, params, "doomed")
        await anext(stream)  # it is running
        with pytest.raises(EngineDeadError, match="exited"):
            await asyncio.to_thread(in_process.core.call, _exit_now)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    asyncio.run(run())
    with pytest.raises(EngineDeadError):
        in_process.check_health()
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(in_process, {"prompt_token_ids": PROMPT}, params, "after"))
