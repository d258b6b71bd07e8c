"""The requests a front end serves, and how a step's sampled tokens become their outputs.

LLMEngine keeps one book for the requests its EngineCore schedules (the same Request objects).
When the engine core runs in its own process (`process_client.py`), the front end keeps a book of
mirrors of the core's requests (`frontend.py`): the rules below run there on the tokens the core
sends, so a stream's text, stop strings and outputs come out the same either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from cbjax.arguments import ArgumentTypeError, describe
from cbjax.core.outputs import SampledTokens
from cbjax.core.request import Request, RequestStatus
from cbjax.engine.iteration_stats import IterationStatsCollector
from cbjax.engine.output_processor import OutputProcessor
from cbjax.engine.parallel_sampling import ParentRequest, child_params, child_request_ids
from cbjax.outputs import RequestOutput
from cbjax.sampling_params import SamplingParams
from cbjax.tokenizer.tokenizer import Tokenizer

Prompt = str | dict[str, Any]  # vLLM's forms: a str, a TextPrompt or a TokensPrompt dict (parse_prompt)
PROMPT_FORMS = "a str, a dict with 'prompt' (vLLM's TextPrompt) or with 'prompt_token_ids' (TokensPrompt)"
# Keys of vLLM's prompt dicts for inputs cbjax does not take: refused by name, never ignored.
UNSUPPORTED_PROMPT_KEYS = {
    "multi_modal_data": "cbjax serves text-only models", "mm_processor_kwargs": "cbjax serves text-only models",
    "multi_modal_uuids": "cbjax serves text-only models", "prompt_embeds": "prompts are text or token ids",
    "token_type_ids": "no model here takes them", "cache_salt": "the prefix cache has no per-tenant salt",
}

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
        arrival_time: float, prompt: str | None, priority: int = 0, lora_request: Any = None,
    ) -> ParentRequest:
        """A request, one child per completion (n > 1), added to the book."""
        children = [
            Request(child_id, token_ids, child_params(params, index), eos_token_ids, arrival_time, priority, lora_request)
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
        runs = sampled.runs
        for row, request in rows:
            finished = request.is_finished
            if finished and request not in finished_by_update:
                continue  # finished before the step's tokens came back (update skipped it too)
            if iteration_stats is not None:
                iteration_stats.sampled(request, len(runs[row]) if runs and row in runs else 1)
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


def parse_prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of one of vLLM's prompt forms: a str or a TextPrompt ({"prompt": text}) has
    text alone, to tokenize; a TokensPrompt ({"prompt_token_ids": ids}) has ids, and may carry their
    text as "prompt". Raises ArgumentTypeError for another form, ValueError for a key it does not take."""
    if isinstance(prompt, str):
        return prompt, None
    unsupported = [key for key in prompt if key in UNSUPPORTED_PROMPT_KEYS] if isinstance(prompt, dict) else []
    if unsupported:
        raise ValueError(f"prompt keys {unsupported} are vLLM inputs cbjax does not take "
                         f"({UNSUPPORTED_PROMPT_KEYS[unsupported[0]]}); send the prompt's text or token ids alone")
    if not isinstance(prompt, dict) or ("prompt" not in prompt and "prompt_token_ids" not in prompt):
        raise ArgumentTypeError(f"a prompt must be {PROMPT_FORMS}, got {describe(prompt)}")
    unknown = sorted(map(str, set(prompt) - {"prompt", "prompt_token_ids"}))
    if unknown:
        raise ValueError(f"unknown prompt keys {unknown}; a prompt dict takes 'prompt' and 'prompt_token_ids'")
    text = prompt.get("prompt")
    if not isinstance(text, str) and (text is not None or "prompt_token_ids" not in prompt):
        raise ArgumentTypeError(f"'prompt' must be a str, got {describe(text)}")
    if "prompt_token_ids" not in prompt:
        return text, None
    token_ids = prompt["prompt_token_ids"]
    if isinstance(token_ids, (str, bytes, dict)) or not isinstance(token_ids, Iterable):
        raise ArgumentTypeError(f"prompt_token_ids must be a list of ints, got {describe(token_ids)}")
    token_ids = list(token_ids)
    for position, token_id in enumerate(token_ids):
        if isinstance(token_id, bool) or not hasattr(token_id, "__index__"):
            raise ArgumentTypeError(f"prompt_token_ids must be a list of ints; item {position} is {describe(token_id)}")
    return text, [int(token_id) for token_id in token_ids]


def tokenize_request(tokenizer: Tokenizer, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
    """A prompt's text (None if given as ids alone) and token ids (parse_prompt's forms); then
    `params.bad_words` become token ids too (without special tokens, as vLLM's)."""
    text, token_ids = parse_prompt(prompt)
    if token_ids is None:
        token_ids = tokenizer.encode(text)
    params.update_from_tokenizer(tokenizer.encode_chat)
    return text, token_ids
