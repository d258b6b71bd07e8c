"""What a step hands back across the layers, as plain host data (vLLM V1's outputs.py): no JAX here.

The model runner fills SampledTokens and PromptLogprobsChunk; EngineCore.step() returns an
EngineCoreStep; the front ends (engine/) turn those into RequestOutputs, in this process or, as
StepProgress, in another.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cbjax.core.request import Request


@dataclasses.dataclass(frozen=True)
class SampledTokens:
    """A step's sampled tokens on the host, as columns: row i is the step's i-th request that
    samples (`sampling_requests`). Columns, not an object per row: they are read every step."""

    sampling_requests: tuple[Any, ...]  # core.request.Request
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # over the whole vocabulary (vLLM's); 0 unless the request asked for logprobs
    top: dict[int, tuple[list[int], list[float]]]  # by row, for the rows that asked for logprobs: ids and logprobs
    # By row, for the rows that verified drafts (speculative decoding): every token the row added this
    # step, accepted drafts first; its token_ids entry is the last. The core's update cuts a run at a stop.
    runs: dict[int, list[int]] = dataclasses.field(default_factory=dict)

    def top_of(self, row: int) -> tuple[list[int], list[float]]:
        return self.top.get(row, ([], []))


@dataclasses.dataclass(frozen=True)
class PromptLogprobsChunk:
    """Logprobs of prompt tokens start, start + 1, ... of one request, scored in one step."""

    start: int  # index in the prompt of the first token scored (>= 1: the first has no logprob)
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclasses.dataclass(slots=True)  # not frozen: made every step, and a frozen init sets each field through object.__setattr__
class EngineCoreStep:
    """What one EngineCore.step() read back: the tokens of the step it collected (None: it collected
    none, e.g. the first step launched with async scheduling), already in their requests."""

    sampled: SampledTokens | None
    # For requests still unfinished when the step was read (a finished one's chunk is dropped).
    prompt_logprobs: dict[str, PromptLogprobsChunk]
    finished: list[Request]  # rows the step finished (eos, stop token ids, length), their slots freed
    skipped: list[Request]  # scheduled rows finished before the step was read: no token for them
    preempted: list[str]  # request ids the step's schedule preempted


NOTHING_READ = EngineCoreStep(None, {}, [], [], [])  # (shared: nobody changes its lists)
