"""What an engine core in its own process sends its front end after every step (vLLM's EngineCoreOutputs).

Columns and tuples, not an object per request: a step of 256 streams is pickled, sent and read in
well under a tenth of a millisecond. The core's side (engine_core_proc.py) makes them; the front
end (engine/frontend.py) applies them, in field order, to its mirrors of the core's requests.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

from cbjax.core.request import Request
from cbjax.core.outputs import PromptLogprobsChunk


class ChildState(NamedTuple):
    """A request's state where the front end cannot see it change: its finish, or its first token."""

    request_id: str  # the scheduler's (child) id
    status: int  # RequestStatus value
    stop_reason: int | str | None
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_cached_tokens: int
    num_preemptions: int

    @classmethod
    def of(cls, request: Request) -> ChildState:
        return cls(request.request_id, request.status._value_, request.stop_reason, request.first_scheduled_time,
                   request.first_token_time, request.finished_time, request.num_cached_tokens, request.num_preemptions)


@dataclasses.dataclass
class StepProgress:
    """One engine-core step, in the order the core applied it."""

    # (request id, why): adds the core refused, and completions (by child id) it could not prepare
    rejected: list[tuple[str, str]]
    aborted: list[ChildState]  # children of the requests aborted before the step's tokens were read
    row_ids: list[str] | None  # the step's sampling rows' request ids (None: the previous step's), then
    skipped: list[int]  # rows of requests finished before the step was read: no token for them
    token_ids: list[int]  # their columns (SampledTokens'); logprobs and ranks empty where no row asked for logprobs
    logprobs: list[float]
    ranks: list[int]
    top: dict[int, tuple[list[int], list[float]]]
    prompt_logprobs: dict[str, PromptLogprobsChunk]
    started: list[ChildState]  # requests whose first output token this is (their times, cached tokens)
    finished: list[ChildState]  # rows the step finished (eos, stop token ids, length)
    preempted: list[str]  # requests the step's schedule preempted
    stats: dict[str, Any]  # EngineCore.get_stats() after the step
    num_step_tokens: int  # tokens of the step launched with it (0: none; async scheduling reads the one before)
    timestamp: float  # time.monotonic() when the core read the step (one clock for both processes)
    runs: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # SampledTokens.runs: verified drafts


def empty_progress(
    stats: dict[str, Any], rejected: list[tuple[str, str]] = (), aborted: list[ChildState] = (), num_step_tokens: int = 0,
) -> StepProgress:
    """A message with no step read: rejections and aborts applied while no step ran, or the first
    step launched with async scheduling (its tokens count when launched)."""
    return StepProgress(list(rejected), list(aborted), None, [], [], [], [], {}, {}, [], [], [], stats, num_step_tokens,
                        time.monotonic())
