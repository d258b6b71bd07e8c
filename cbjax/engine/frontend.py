"""The front end of an engine core in another process: mirrors of its requests, their text and outputs.

vLLM V1's split: the core schedules and steps; this side tokenizes prompts, detokenizes, checks
stop strings and makes RequestOutputs, off the core's critical path. A stop string found here
ends the mirror at once (its output is final, later tokens never shown) and asks the core to stop
the request (`stop`): the core may have computed a token or two more by then, which nobody sees,
and frees its blocks as it would on an abort. Everything else a request's output holds comes from
the core's StepProgress, applied in the order the core applied it, so the text, token ids,
finish reasons and stop reasons are those LLMEngine makes in one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from cbjax.core.outputs import SampledTokens
from cbjax.core.protocol import ChildState, StepProgress
from cbjax.core.request import Request, RequestStatus
from cbjax.engine.output_processor import OutputProcessor
from cbjax.engine.parallel_sampling import ParentRequest
from cbjax.engine.request_book import Progressed, RequestBook
from cbjax.outputs import RequestOutput
from cbjax.sampling_params import SamplingParams
from cbjax.tokenizer.tokenizer import Tokenizer

_GONE = Request("(gone)", [0], None)  # the row of a request this side no longer holds: skipped as finished
_GONE.status = RequestStatus.FINISHED_ABORTED


class Frontend:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: list[int], stop: Callable[[str], None]):
        self.output_processor = OutputProcessor(tokenizer)
        self.book = RequestBook(self.output_processor)
        self.eos_token_ids = list(eos_token_ids)
        self.stop = stop  # asks the core to stop a child request (by its id)
        self._rows: tuple[Request, ...] = ()  # the mirrors of the latest step's rows

    def add_request(
        self, request_id: str, token_ids: list[int], params: SamplingParams, arrival_time: float, prompt: str | None,
        priority: int = 0, lora_request: Any = None,
    ) -> ParentRequest:
        """Mirror a request the core is being sent (ValueError if its id is in use here)."""
        self.book.check_free(request_id, params.n)
        return self.book.add_new(request_id, token_ids, params, self.eos_token_ids, arrival_time, prompt, priority,
                                 lora_request)

    def reject(self, request_id: str) -> tuple[str, list[str]] | None:
        """Forget a request the core refused, or one of whose completions (named by its child id) it
        could not prepare: the request's id and its other completions the core still runs (for the
        caller to abort there), None if this side holds it no longer."""
        parent = self.book.requests.get(request_id) or self.book.parents.get(request_id)
        if parent is None:
            return None
        siblings = [] if parent.request_id == request_id else [
            child.request_id for child in parent.children if not child.is_finished and child.request_id != request_id]
        for child in parent.children:
            child.status = RequestStatus.FINISHED_ABORTED
        self.book.finish(parent)  # (its output is dropped: the caller gets the core's ValueError)
        return parent.request_id, siblings

    def child_ids(self, request_id: str) -> list[str]:
        """The core's ids of what an abort of `request_id` ends (RequestBook.children_of)."""
        return [child.request_id for child in self.book.children_of(request_id)]

    def _mirror(self, child_id: str) -> Request | None:
        parent = self.book.parents.get(child_id)
        if parent is None:
            return None
        children = parent.children
        if len(children) == 1:
            return children[0]
        return next(child for child in children if child.request_id == child_id)

    def apply(self, progress: StepProgress) -> Progressed:
        """Apply one core step to the mirrors; the parents with news (RequestBook.progressed's)."""
        progressed: Progressed = []
        for state in progress.aborted:
            child = self._mirror(state.request_id)
            if child is not None and not child.is_finished:  # (a stop string here may have ended it first)
                _set_state(child, state)
                parent = self.book.parents[state.request_id]
                if parent.finished:
                    progressed.append((parent, True))
        mirror = self._mirror
        if progress.row_ids is not None:  # (else the rows of the step before, with the mirrors found for them then)
            self._rows = tuple(mirror(request_id) or _GONE for request_id in progress.row_ids)
        rows = self._rows if progress.token_ids else ()  # (no step: a message of rejections, aborts or stats)
        if progress.skipped:  # the core skipped them: their requests are finished, or gone here
            rows = list(rows)
            for row in progress.skipped:
                rows[row] = _GONE
            rows = tuple(rows)
        runs = progress.runs
        for request, token_id in zip(rows, progress.token_ids):
            if not request.is_finished:  # as the core's update: a request finished before the step skips it
                request.append_output_token(token_id)
        for row, run in runs.items():  # a row that verified drafts added its whole run: the tokens before its last too
            request = rows[row]
            if not request.is_finished:
                request.truncate_output(request.num_output_tokens - 1)
                for token_id in run:
                    request.append_output_token(token_id)
        for request_id, chunk in progress.prompt_logprobs.items():
            child = mirror(request_id)
            if child is not None and not child.is_finished:
                self.output_processor.add_prompt_logprobs(request_id, chunk)
        for state in progress.started:
            child = mirror(state.request_id)
            if child is not None and not child.is_finished:
                child.first_scheduled_time, child.first_token_time = state.first_scheduled_time, state.first_token_time
                child.num_cached_tokens = state.num_cached_tokens
        for request_id in progress.preempted:
            child = mirror(request_id)
            if child is not None:
                child.num_preemptions += 1
        finished_now = []
        for state in progress.finished:
            child = mirror(state.request_id)
            if child is not None and not child.is_finished:
                _set_state(child, state)
                finished_now.append(child)
        sampled = SampledTokens(rows, progress.token_ids, progress.logprobs, progress.ranks, progress.top, runs)
        return progressed + self.book.progressed(sampled, finished_now, self._stop)

    def outputs(self, progressed: Iterable[tuple[ParentRequest, bool]]) -> list[RequestOutput]:
        return self.book.outputs(progressed)

    def _stop(self, request: Request) -> None:
        request.status, request.finished_time = RequestStatus.FINISHED_STOPPED, time.monotonic()
        self.stop(request.request_id)


def _set_state(request: Request, state: ChildState) -> None:
    request.status = RequestStatus(state.status)
    request.stop_reason = state.stop_reason
    request.first_scheduled_time, request.first_token_time = state.first_scheduled_time, state.first_token_time
    request.finished_time, request.num_cached_tokens = state.finished_time, state.num_cached_tokens
    request.num_preemptions = state.num_preemptions
