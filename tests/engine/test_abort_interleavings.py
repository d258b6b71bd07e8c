"""Aborts of n > 1 requests in every order never break the engine's bookkeeping (issue 35, defect 10).

A load test (streams of n = 2-3 closed by their clients after one chunk) killed the engine core
with a KeyError on a child id. Here hypothesis interleaves steps with aborts of a parent, of one
of its children, or of both, in either order, twice, before or after some children finished,
with a step in flight (async scheduling) and with stop strings ending children, against both
front ends: the in-process LLMEngine, and the engine-process front end (Frontend) reading the
core's StepProgress messages as the pipe carries them (pickled, several read at once when it
falls behind). Whatever the order: nothing raises, each request gets exactly one final output
(with a finish reason for every completion) and nothing after it, and every KV block is free.
"""

from __future__ import annotations

import pickle

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_async_scheduling import assert_all_released, engine  # noqa: F401 (its module fixture: a tiny engine whose pool preempts)

from cbjax import RequestOutputKind, SamplingParams
from cbjax.core.engine_core_proc import EngineCoreProc, _apply
from cbjax.core.protocol import empty_progress
from cbjax.engine.frontend import Frontend
from cbjax.engine.llm_engine import LLMEngine
from cbjax.engine.parallel_sampling import child_request_ids
from cbjax.outputs import RequestOutput

# The engine: test_async_scheduling's, 4 seats and 20 blocks of 4 tokens, EOS among the likely tokens. Up to
# 4 requests of 3 children: children wait, are held for child 0's prompt, are preempted.
MAX_STEPS = 200  # a workload's last request ends within max_tokens steps of its admission; far below this


@st.composite
def workloads(draw):
    """(requests as (prompt, params), actions): an action is "step", "read" (the process front
    end reads the messages waiting), or ("abort", request index, child index or None = the parent)."""
    requests = []
    for _ in range(draw(st.integers(1, 4))):
        prompt = draw(st.lists(st.integers(3, 299), min_size=1, max_size=12))
        requests.append((prompt, SamplingParams(
            n=draw(st.sampled_from([1, 2, 3, 3])),
            temperature=1.0,
            seed=draw(st.integers(0, 1000)),
            max_tokens=draw(st.integers(1, 8)),
            stop=draw(st.sampled_from([[], [], ["e"], ["a", "t"]])),  # one child stopped by a string, its siblings not
            output_kind=draw(st.sampled_from(list(RequestOutputKind))),
        )))
    abort = st.tuples(st.just("abort"), st.integers(0, len(requests) - 1), st.none() | st.integers(0, 2))
    actions = draw(st.lists(st.sampled_from(["step", "read"]) | abort, max_size=24))
    return requests, actions


def request_id(index: int) -> str:
    return f"cmpl-{index}"


def abort_target(requests: list, action: tuple) -> str:
    """The id an abort names: the request's, or one of its children's (vLLM's "{index}_{id}")."""
    _, index, child = action
    n = requests[index][1].n
    return request_id(index) if child is None or n == 1 else child_request_ids(request_id(index), n)[child % n]


def check_outputs(requests: list, outputs: list[RequestOutput]) -> None:
    """One final output per request, the last of its outputs, with a finish reason for each of its n completions."""
    finals = {}
    for output in outputs:
        assert output.request_id not in finals, f"{output.request_id} has an output after its final one"
        if output.finished:
            finals[output.request_id] = output
    assert sorted(finals) == sorted(request_id(i) for i in range(len(requests)))
    for index, (_, params) in enumerate(requests):
        completions = finals[request_id(index)].outputs
        assert [c.index for c in completions] == list(range(params.n))
        assert all(c.finish_reason in ("stop", "length", "abort") for c in completions), completions


def serve_in_process(engine: LLMEngine, requests: list, actions: list) -> list[RequestOutput]:
    for index, (prompt, params) in enumerate(requests):
        engine.add_request(request_id(index), {"prompt_token_ids": prompt}, params)
    outputs = []
    for action in actions:
        if action == "step":
            outputs += engine.step()
        elif action != "read":
            engine.abort_request(abort_target(requests, action))
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        outputs += engine.step()
    assert not engine.book.requests and not engine.book.parents and not engine.output_processor.texts
    return outputs


class CoreBehindPipe:
    """The engine-core process's loop (engine_core_proc._serve) and ProcessCoreClient's reader, turn
    by turn in this process: commands and progress cross pickled, as through the pipe."""

    def __init__(self, engine: LLMEngine):
        self.core = engine.core
        self.proc = EngineCoreProc(engine.core)
        self.frontend = Frontend(engine.tokenizer, engine.eos_token_ids, lambda child_id: self.send(("stop", child_id)))
        self.commands: list[tuple] = []  # to the core, applied between its steps
        self.messages: list = []  # to the front end, read in arrival order

    def send(self, command: tuple) -> None:
        self.commands.append(pickle.loads(pickle.dumps(command)))

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        parent = self.frontend.add_request(request_id, prompt, params, 0.0, None)
        self.send(("add", [(request_id, parent.children)]))

    def abort(self, request_id: str) -> None:
        child_ids = self.frontend.child_ids(request_id)
        if child_ids:
            self.send(("abort", child_ids))

    def core_turn(self) -> None:
        """_serve's loop body: apply the commands waiting, then step (or say what they did)."""
        applied, self.commands = self.commands, []
        for command in applied:
            _apply(command, None, self.proc)
        if self.core.has_unfinished_requests():
            message = self.proc.step()
        elif applied:
            message = self.proc.pending_message() or empty_progress(self.core.get_stats())
        else:
            return
        self.messages.append(pickle.loads(pickle.dumps(message)))

    def read(self) -> list[RequestOutput]:
        """ProcessCoreClient._apply: every message waiting, one output per request for all of them."""
        steps, self.messages = self.messages, []
        progressed = {}
        for step in steps:
            for request_id, _ in step.rejected:
                self.frontend.reject(request_id)
            for parent, finished in self.frontend.apply(step):
                progressed[parent.request_id] = (parent, finished)
        return self.frontend.outputs(progressed.values())

    @property
    def busy(self) -> bool:
        return bool(self.core.has_unfinished_requests() or self.commands or self.messages)


def serve_behind_pipe(engine: LLMEngine, requests: list, actions: list) -> list[RequestOutput]:
    pipe = CoreBehindPipe(engine)
    for index, (prompt, params) in enumerate(requests):
        pipe.add(request_id(index), prompt, params)
    outputs = []
    for action in actions:
        if action == "step":
            pipe.core_turn()
        elif action == "read":
            outputs += pipe.read()
        else:
            pipe.abort(abort_target(requests, action))
    for _ in range(MAX_STEPS):
        if not pipe.busy:
            break
        pipe.core_turn()
        outputs += pipe.read()
    book = pipe.frontend.book
    assert not book.requests and not book.parents and not pipe.frontend.output_processor.texts
    return outputs


# The case that killed the engine loop: a request aborted twice between two steps (a client gone and
# the server shutting down) was finished, and forgotten, twice; and one child aborted by its own id.
TWICE = ([([5, 17, 42], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6)),
          ([7, 3], SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=6, stop=["e"]))],
         ["step", ("abort", 0, None), ("abort", 0, None), ("abort", 1, 1), "step", "read", ("abort", 1, None), "step"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads(), async_scheduling=st.booleans())
@example(workload=TWICE, async_scheduling=True)
def test_aborts_in_any_order_leave_one_final_output_and_free_blocks(engine, workload, async_scheduling):
    requests, actions = workload
    engine.config.async_scheduling = async_scheduling
    try:
        check_outputs(requests, serve_in_process(engine, requests, actions))
        assert_all_released(engine)
        check_outputs(requests, serve_behind_pipe(engine, requests, actions))
        assert_all_released(engine)
    finally:
        engine.config.async_scheduling = True  # the module's engine is shared: a failure must not leak the mode
