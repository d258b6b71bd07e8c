"""The requests a front end serves, and how a step's sampled tokens become their outputs.

LLMEngine keeps one book for the requests its EngineCore schedules (the same Request objects).
When the engine core runs in its own process (`process_client.py`), the front end keeps a book of
mirrors of the core's requests (`frontend.py`): the rules below run there on the tokens the core
sends, so a stream's text, stop strings and outputs come out the same either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from cbjax.core.outputs import SampledTokens
from cbjax.core.request import Request, RequestStatus
from cbjax.engine.iteration_stats import IterationStatsCollector
from cbjax.engine.output_processor import OutputProcessor
from cbjax.engine.parallel_sampling import ParentRequest, child_params, child_request_ids
from cbjax.outputs import RequestOutput
from cbjax.sampling_params import SamplingParams
from cbjax.tokenizer.tokenizer import Tokenizer

Prompt = str | dict[str, Any]

Progressed = list[tuple[ParentRequest, bool]]  # parents with news this step, and whether each finished


class RequestBook:
    def __init__(self, output_processor: OutputProcessor):
        self.output_processor = output_processor
        self.requests: dict[str, ParentRequest] = {}  # by the caller's request id
        self.parents: dict[str, ParentRequest] = {}  # by the scheduler's (child) request id
        # Set where a stat logger reads every step (core clients): every row is then counted there.
        self.iteration_stats: IterationStatsCollector | None = None

    def check_free(self, request_id: str, n: int) -> None:
        """Raise ValueError if `request_id`, or a child id of its n completions, is being served."""
        in_use = next((i for i in [request_id, *child_request_ids(request_id, n)] if i in self.requests or i in self.parents), None)
        if in_use is not None:
            raise ValueError(f"request_id {in_use!r} is already in use; give each request a unique id")

    def add_new(
        self, request_id: str, token_ids: list[int], params: SamplingParams, eos_token_ids: list[int],
        arrival_time: float, prompt: str | None, priority: int = 0,
    ) -> ParentRequest:
        """A request, one child per completion (n > 1), added to the book."""
        children = [
            Request(child_id, token_ids, child_params(params, index), eos_token_ids, arrival_time, priority)
            for index, child_id in enumerate(child_request_ids(request_id, params.n))
        ]
        parent = ParentRequest(request_id, children)
        self.requests[request_id] = parent
        for child in children:
            self.parents[child.request_id] = parent
            self.output_processor.add_request(child, prompt)
        return parent

    def children_of(self, request_id: str) -> list[Request]:
        """The unfinished children an abort of `request_id` ends: a request's (all its children), or
        one child named by its own id (vLLM's "{index}_{id}"); none for an id finished or unknown."""
        parent = self.requests.get(request_id) or self.parents.get(request_id)
        if parent is None:
            return []
        return [child for child in parent.children if not child.is_finished
                and (parent.request_id == request_id or child.request_id == request_id)]

    def forget(self, parent: ParentRequest) -> None:
        del self.requests[parent.request_id]
        for child in parent.children:
            del self.parents[child.request_id]
        if self.iteration_stats is not None:
            self.iteration_stats.forget(parent)

    def progressed(
        self, sampled: SampledTokens, finished_now: list[Request], stop: Callable[[Request], None],
    ) -> Progressed:
        """Read a step's tokens (already in its requests) into text and stop strings: the parents
        that have an output to give, in row order (those with several children after the others).

        A request finished since the step was launched (aborted, or stopped by the step before) is
        skipped: its speculative token is never shown or counted. `stop(request)` ends a request a
        stop string ended (its status and stop_reason are set after); the core frees what a
        finished one held.
        """
        output_processor, parents = self.output_processor, self.parents
        finished_by_update = set(finished_now)
        watched, wants_output = output_processor.watched, output_processor.wants_output
        iteration_stats = self.iteration_stats
        if watched or iteration_stats is not None:
            rows = enumerate(sampled.sampling_requests)
        else:  # nobody reads a token before its request finishes (LLM.generate's): only the finished need a
            rows = ((None, request) for request in finished_now)  # look, and no row (process_token is for watched ones)
        progressed: Progressed = []
        with_siblings: dict[str, ParentRequest] = {}  # n > 1: one output once all its rows are read
        for row, request in rows:
            finished = request.is_finished
            if finished and request not in finished_by_update:
                continue  # finished before the step's tokens came back (update skipped it too)
            if iteration_stats is not None:
                iteration_stats.sampled(request)
            if request in watched:
                stop_string = output_processor.process_token(request, sampled, row)
                if stop_string is not None:
                    if not finished:
                        stop(request)
                        finished = True
                    request.status = RequestStatus.FINISHED_STOPPED  # a stop string outranks "length", as in vLLM
                    request.stop_reason = stop_string
            if not finished and not wants_output(request):
                continue  # nothing to report (its siblings, if any, share its output kind)
            parent = parents[request.request_id]
            if len(parent.children) > 1:
                with_siblings[parent.request_id] = parent
            else:
                progressed.append((parent, finished))
        progressed += [(parent, parent.finished) for parent in with_siblings.values()]
        return progressed

    def outputs(self, progressed: Iterable[tuple[ParentRequest, bool]]) -> list[RequestOutput]:
        """The outputs of parents that progressed: a finished one's last, or, where someone reads
        its progress, an unfinished one's."""
        outputs = []
        wants_output = self.output_processor.wants_output
        for parent, finished in progressed:
            if finished:
                outputs.append(self.finish(parent))
            elif wants_output(parent.children[0]):
                outputs.append(self.output_processor.make_output(parent))
        return outputs

    def finish(self, parent: ParentRequest) -> RequestOutput:
        """A finished request's last output; the book forgets it."""
        self.forget(parent)
        return self.output_processor.make_output(parent)


def eos_token_ids(tokenizer: Tokenizer, model_config: Any) -> list[int]:
    """The ids that end a request unless ignore_eos: the tokenizer's, else the model config's."""
    return list(tokenizer.eos_token_ids or model_config.eos_token_id)


def tokenize_request(tokenizer: Tokenizer, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
    """A prompt's text (None if given as ids alone) and token ids; then `params.bad_words` become
    token ids too (without special tokens, as vLLM's)."""
    if isinstance(prompt, str):
        text, token_ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, token_ids = prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
    else:
        raise ValueError(f"a prompt must be a str or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
    params.update_from_tokenizer(tokenizer.encode_chat)
    return text, token_ids
