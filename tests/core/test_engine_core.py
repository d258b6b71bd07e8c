"""EngineCore over a stand-in runner (no JAX): the schedule -> execute -> update loop, hand-worked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cbjax.config import EngineConfig
from cbjax.core.engine_core import EngineCore
from cbjax.core.outputs import EngineCoreStep, SampledTokens
from cbjax.core.request import Request, RequestStatus
from cbjax.sampling_params import SamplingParams

TOKEN = 7  # every row samples this token


class StandInRunner:
    """A device whose step samples TOKEN for every row that samples; it records what it was asked."""

    num_blocks, backend, buckets, max_suppressed_ids = 32, "stand-in", [], 16

    def __init__(self):
        self.launched = 0
        self.released: list[str] = []
        self.failed_requests: list[tuple[str, str]] = []

    def dispatch(self, scheduled):
        self.launched += 1
        return SimpleNamespace(scheduled=scheduled, rows=tuple(row.request for row in scheduled.scheduled if row.samples))

    def collect(self, launched):
        return SampledTokens(launched.rows, [TOKEN] * len(launched.rows), [0.0] * len(launched.rows),
                             [0] * len(launched.rows), {}), {}

    def release_request(self, request_id: str) -> None:
        self.released.append(request_id)


def make_core(async_scheduling: bool) -> EngineCore:
    config = EngineConfig(model="stand-in", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16, block_size=4,
                          async_scheduling=async_scheduling)
    config.resolve(max_position_embeddings=64)
    return EngineCore(config, StandInRunner(), SimpleNamespace(vocab_size=100), platform="cpu")


def add(core: EngineCore, request_id: str, max_tokens: int) -> Request:
    request = Request(request_id, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    core.check_request(request.prompt_token_ids, request.sampling_params, [], 0)
    core.add_requests([request])
    return request


def run_to_end(core: EngineCore) -> list[EngineCoreStep]:
    steps = []
    while core.has_unfinished_requests():
        steps.append(core.step())
    return steps


def test_each_step_reads_one_token_per_request_and_frees_it_when_it_finishes():
    core = make_core(async_scheduling=False)
    a, b = add(core, "a", max_tokens=2), add(core, "b", max_tokens=3)
    steps = run_to_end(core)
    assert all(isinstance(step, EngineCoreStep) for step in steps)
    assert [[r.request_id for r in step.sampled.sampling_requests] for step in steps] == [["a", "b"], ["a", "b"], ["b"]]
    assert [[r.request_id for r in step.finished] for step in steps] == [[], ["a"], ["b"]]
    assert a.output_token_ids == [TOKEN] * 2 and b.output_token_ids == [TOKEN] * 3
    assert a.status is b.status is RequestStatus.FINISHED_LENGTH
    assert core.runner.released == ["a", "b"]  # each once, the step it finished
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks - 1
    assert core.get_stats()["num_steps"] == 3


def test_async_scheduling_reads_each_step_one_call_later():
    core = make_core(async_scheduling=True)
    request = add(core, "a", max_tokens=2)
    steps = run_to_end(core)
    # Call 1 launches step 1 and reads nothing; call 2 launches step 2 and reads step 1; both of the
    # request's tokens are then in flight, so call 3 launches nothing and reads step 2.
    assert [step.sampled is None for step in steps] == [True, False, False]
    assert [len(step.finished) for step in steps] == [0, 0, 1]
    assert request.output_token_ids == [TOKEN, TOKEN] and core.runner.launched == 2


def test_an_abort_between_steps_skips_the_row_in_flight_and_frees_it_once():
    core = make_core(async_scheduling=True)
    aborted, kept = add(core, "gone", max_tokens=5), add(core, "kept", max_tokens=3)
    assert core.step().sampled is None  # step 1 in flight
    assert core.abort_request("gone") is aborted
    step = core.step()  # launches step 2 (without "gone"), reads step 1
    assert step.skipped == [aborted] and aborted.output_token_ids == []
    assert aborted.status is RequestStatus.FINISHED_ABORTED
    assert core.abort_request("gone") is None  # finished: nothing to abort again
    run_to_end(core)
    assert kept.output_token_ids == [TOKEN] * 3
    assert core.runner.released == ["gone", "kept"]


def test_check_request_names_the_limit():
    core = make_core(async_scheduling=False)
    with pytest.raises(ValueError, match="max_model_len is 64"):
        core.check_request([1] * 60, SamplingParams(max_tokens=10), [], 0)
    with pytest.raises(ValueError, match=r"prompt token id 100 is outside the vocabulary \[0, 100\)"):
        core.check_request([1, 100], SamplingParams(), [], 0)
    assert not core.has_unfinished_requests()

