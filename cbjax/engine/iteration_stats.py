"""What each engine step did, for stat loggers (vLLM V1's IterationStats and FinishedRequestStats).

Counted as the request book reads each step's rows (RequestBook.progressed), so that a stat logger
needs no RequestOutput of a request nobody reads yet: a FINAL_ONLY request still gets one output,
when it finishes, and its steps cost a few list and dict operations each here.

    collector = IterationStatsCollector(book.parents)   # book.iteration_stats: its rows are then counted
    ... a step's rows read (collector.sampled per row) ...
    iteration = collector.end_step(engine_stats, num_step_tokens, step_time, now)
    iteration.finished_requests = collector.finished(outputs, now)   # the outputs made for it
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable
from typing import Any

from cbjax.core.request import Request
from cbjax.engine.parallel_sampling import ParentRequest
from cbjax.outputs import RequestOutput


@dataclasses.dataclass(slots=True)
class FinishedRequestStats:
    """A request (all its completions) that finished this step."""

    request_id: str
    finish_reason: str  # "stop" | "length" | "abort" (its first completion's)
    e2e_latency: float  # seconds from arrival to the front end seeing it finished
    queue_time: float | None  # arrival to first scheduled (None: never scheduled)
    prefill_time: float | None  # first scheduled to first token (None: no token)
    num_prompt_tokens: int
    num_generation_tokens: int  # over all its completions

    @classmethod
    def of(cls, output: RequestOutput, now: float) -> FinishedRequestStats:
        metrics = output.metrics
        scheduled, first_token = metrics.first_scheduled_time, metrics.first_token_time
        return cls(
            output.request_id, output.outputs[0].finish_reason or "abort", now - metrics.arrival_time,
            None if scheduled is None else scheduled - metrics.arrival_time,
            None if scheduled is None or first_token is None else first_token - scheduled,
            len(output.prompt_token_ids), metrics.num_generation_tokens,
        )


@dataclasses.dataclass(slots=True)
class IterationStats:
    """One engine step."""

    engine_stats: dict[str, Any]  # EngineCore.get_stats() after the step
    num_step_tokens: int  # tokens the step computed, prompt chunks and decodes (0: it launched none)
    num_prompt_tokens: int  # prompts of the requests whose first token came
    num_generation_tokens: int  # output tokens the step added to unfinished requests
    time_to_first_tokens: list[float]  # per request whose first token came: seconds since its arrival
    # (seconds, number of tokens): each output token but a completion's first waited `seconds` since
    # the completion's previous token (one pair per step those came in: nearly always one pair).
    inter_token_latencies: list[tuple[float, int]]
    finished_requests: list[FinishedRequestStats]


class _StepTime:
    """When a step's tokens were read, shared by every request that got one (set at its end_step)."""

    __slots__ = ("time",)


class IterationStatsCollector:
    def __init__(self, parents: dict[str, ParentRequest]):
        self.parents = parents  # the book's: child request id -> parent
        self.latest_token_step: dict[str, _StepTime] = {}  # by child request id, until the book forgets its parent
        self._start_step()

    def _start_step(self) -> None:
        self.step = _StepTime()
        self.previous_token_steps: list[_StepTime] = []  # one per token that was not its completion's first
        self.first_token_arrivals: list[float] = []
        self.num_prompt_tokens = 0
        self.num_first_tokens = 0

    def sampled(self, request: Request, num_tokens: int = 1) -> None:
        """`request` (a child) got a token this step (`num_tokens`: a verified run of speculative
        decoding, whose tokens after the first come 0 s after it)."""
        request_id = request.request_id
        previous = self.latest_token_step.get(request_id)
        self.latest_token_step[request_id] = self.step
        if num_tokens > 1:
            self.previous_token_steps += [self.step] * (num_tokens - 1)
        if previous is not None:
            self.previous_token_steps.append(previous)
            return
        self.num_first_tokens += 1
        if self.parents[request_id].children[0] is request:  # child 0 computes the prompt the others share
            self.first_token_arrivals.append(request.arrival_time)
            self.num_prompt_tokens += request.num_prompt_tokens

    def end_step(self, engine_stats: dict[str, Any], num_step_tokens: int, step_time: float, now: float) -> IterationStats:
        """The step's stats but its finished requests (`finished`): its tokens were read at
        `step_time` (the core's clock), the front end holds them at `now`."""
        self.step.time = step_time
        waits = collections.Counter(self.previous_token_steps)  # (usually one key: the step before)
        iteration = IterationStats(
            engine_stats, num_step_tokens, self.num_prompt_tokens,
            self.num_first_tokens + len(self.previous_token_steps),
            [now - arrival for arrival in self.first_token_arrivals],
            [(step_time - previous.time, count) for previous, count in waits.items()],
            [],
        )
        self._start_step()
        return iteration

    def finished(self, outputs: Iterable[RequestOutput], now: float) -> list[FinishedRequestStats]:
        """The stats of the finished requests among `outputs` (made for the steps just ended)."""
        return [FinishedRequestStats.of(output, now) for output in outputs if output.finished]

    def forget(self, parent: ParentRequest) -> None:
        """A request the book forgets (finished, failed or refused): its completions get no more tokens."""
        for child in parent.children:
            self.latest_token_step.pop(child.request_id, None)
