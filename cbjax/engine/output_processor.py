"""Turns sampled tokens into text: incremental detokenization, stop strings, logprobs, outputs.

Outputs are built only where someone reads them (vLLM V1's OutputProcessor): a FINAL_ONLY
request (LLM.generate's, a server's non-streamed one) gets no RequestOutput until it finishes,
and a DELTA request (a server's stream) only what is new since its previous one. Text is made
the same way: a request's tokens are detokenized when an output reads its text, or as each
token comes where stop strings must be checked on it; the detokenizer sees the same tokens one
by one either way, so the text is the same.
"""

from __future__ import annotations

import dataclasses
import functools

from cbjax.core.outputs import PromptLogprobsChunk, SampledTokens
from cbjax.core.request import Request, RequestStatus
from cbjax.engine.parallel_sampling import ParentRequest
from cbjax.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from cbjax.sampling_params import RequestOutputKind
from cbjax.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer

_FINISHED_STOPPED = RequestStatus.FINISHED_STOPPED  # an enum member looked up on its class costs ~70 ns


@dataclasses.dataclass
class RequestText:
    """Host-side text state of one request."""

    prompt: str | None
    detokenizer: IncrementalDetokenizer
    longest_stop: int  # the longest stop string's length (0: none), asked of every token
    stop_ends: frozenset[str]  # the last character of each stop string: a new token's text must hold one to complete it
    text: str = ""
    num_detokenized: int = 0  # output tokens the text covers (the detokenizer has seen)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, Logprob]] | None = None  # from the second prompt token on
    # What earlier DELTA outputs carried: the text, the token ids and the logprobs before these.
    sent_text: int = 0
    sent_token_ids: int = 0
    sent_logprobs: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.texts: dict[str, RequestText] = {}
        # Requests the engine looks at every step they sample (stop strings are checked on each
        # token's text, logprobs come with the step, streams get an output): the others only when
        # they finish, so a step of LLM.generate's requests costs nothing here per request.
        self.watched: set[Request] = set()
        self.streamed: set[Request] = set()  # of which those whose output kind is not FINAL_ONLY

    def wants_output(self, request: Request) -> bool:
        """Whether an unfinished request's progress this step needs a RequestOutput (of its parent:
        the children of one parent share their output kind). Stat loggers need none: they count the
        rows (iteration_stats.py)."""
        return request in self.streamed

    def add_request(self, request: Request, prompt: str | None) -> None:
        params = request.sampling_params
        self.texts[request.request_id] = RequestText(
            prompt=prompt,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            ),
            longest_stop=max(map(len, params.stop), default=0),
            stop_ends=frozenset(stop[-1] for stop in params.stop),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
        )
        if params.output_kind is not RequestOutputKind.FINAL_ONLY:
            self.streamed.add(request)
        if params.stop or params.logprobs is not None or request in self.streamed:
            self.watched.add(request)

    def add_prompt_logprobs(self, request_id: str, chunk: PromptLogprobsChunk) -> None:
        """Record the prompt logprobs a step scored; positions already recorded (a preempted request
        computing its prompt again) are skipped."""
        recorded = self.texts[request_id].prompt_logprobs
        for i, token_id in enumerate(chunk.token_ids):
            if chunk.start + i == len(recorded) + 1:  # recorded[j] is prompt position j + 1
                recorded.append(self._logprob_dict(token_id, chunk.logprobs[i], chunk.ranks[i],
                                                   chunk.top_token_ids[i], chunk.top_logprobs[i]))

    def process_token(self, request: Request, sampled: SampledTokens, row: int) -> str | None:
        """Record the newest token of a watched request: its logprob (`row` of `sampled`) and, where
        stop strings are checked on it, its text; the stop string it completed, if any.

        A stop string is completed only by a token whose text holds its last character. A token that
        adds its own text as is (text_as_is) and holds none of them completes none: its text, like
        that of the tokens before it, waits until an output (or a token that may complete one) needs
        it, then is made token by token, stop strings checked at each, as if made now.
        """
        state = self.texts[request.request_id]
        if state.logprobs is not None:
            token_id, logprob = sampled.token_ids[row], sampled.logprobs[row]
            state.cumulative_logprob += logprob
            state.logprobs.append(self._logprob_dict(token_id, logprob, sampled.ranks[row], *sampled.top_of(row)))
        if not request.sampling_params.stop:
            return None
        if row not in sampled.runs:  # (a verified run's tokens before its last are checked one by one)
            text = state.detokenizer.text_as_is(request.output_token_ids[-1])
            if text and state.stop_ends.isdisjoint(text):
                return None
        return self._detokenize(request, state)

    def _detokenize(self, request: Request, state: RequestText) -> str | None:
        """Bring the text up to the request's newest token; the stop string found, if any (the text
        then ends there).

        vLLM's rules: a token that ended the request as EOS or a stop token id keeps its logprob
        but adds no text unless include_stop_str_in_output; stop strings are matched, token by
        token, only once more than min_tokens output tokens exist.
        """
        tokens, params = request.output_token_ids, request.sampling_params
        start, end = state.num_detokenized, len(tokens)
        if start == end:
            return None
        state.num_detokenized = end
        if (request.status is _FINISHED_STOPPED and not isinstance(request.stop_reason, str)
                and not params.include_stop_str_in_output and _is_stop_token(request, tokens[-1])):
            end -= 1  # the last token is the eos or stop token id that ended it (not a completed grammar's)
        # `state.text += delta` would copy the whole text every token (in place only for a string
        # nothing else refers to): take it out of state, append, put it back.
        add_token, stops, text, state.text = state.detokenizer.add_token, params.stop, state.text, ""
        for index in range(start, end):
            delta = add_token(tokens[index])
            if not delta:
                continue
            text += delta
            if stops and index >= params.min_tokens:
                # Only a window around the new text can hold a stop string that was not there before.
                window_start = len(text) - len(delta) - state.longest_stop + 1
                for stop in stops:
                    found = text.find(stop, window_start if window_start > 0 else 0)
                    if found != -1:
                        state.text = text[: found + len(stop) if params.include_stop_str_in_output else found]
                        if index + 1 < end:  # inside a verified run: the tokens after it never were
                            request.truncate_output(index + 1)
                            state.num_detokenized = index + 1
                        return stop
        state.text = text
        return None

    def _logprob_dict(
        self, token_id: int, logprob: float, rank: int, top_token_ids: list[int], top_logprobs: list[float]
    ) -> dict[int, Logprob]:
        """vLLM's dict: the chosen token first with its true rank, then the top N ranked 1..N."""
        decode = functools.partial(self.tokenizer.decode_token, skip_special_tokens=False)
        entry = {token_id: Logprob(logprob, rank, decode(token_id))}
        for top_rank, (top_id, top_logprob) in enumerate(zip(top_token_ids, top_logprobs), start=1):
            entry[top_id] = Logprob(top_logprob, top_rank, decode(top_id))
        return entry

    def make_output(self, parent: ParentRequest) -> RequestOutput:
        """One output per submitted request: a completion per child, index = its place among them.

        A DELTA request's completions hold only what its earlier outputs did not, and its
        prompt_token_ids are the request's own list (as vLLM's), not a copy per step.
        """
        first, finished = parent.children[0], parent.finished
        first_state = self.texts[first.request_id]
        delta = first.sampling_params.output_kind is RequestOutputKind.DELTA
        # Fields by position (made for every stream every step; keyword arguments double a dataclass's construction time).
        output = RequestOutput(
            parent.request_id,
            first_state.prompt,
            first.prompt_token_ids if delta else list(first.prompt_token_ids),
            [self._completion(child, index, delta) for index, child in enumerate(parent.children)],
            finished,
            _metrics(parent.children),
            None if first_state.prompt_logprobs is None else [None, *first_state.prompt_logprobs],
            first.num_cached_tokens,
        )
        if finished:
            for child in parent.children:
                del self.texts[child.request_id]
                self.watched.discard(child)
                self.streamed.discard(child)
        return output

    def _completion(self, request: Request, index: int, delta: bool) -> CompletionOutput:
        state = self.texts[request.request_id]
        self._detokenize(request, state)  # a watched request's text is up to date already, stop strings checked
        params, text_end = request.sampling_params, len(state.text)
        if not request.is_finished and params.stop and not params.include_stop_str_in_output:
            # As vLLM streams: hold back the characters that may yet begin a stop string.
            text_end = max(0, text_end - state.longest_stop + 1)
        logprobs = state.logprobs
        if delta:
            # A stop string found later can cut the text below what was sent; nothing can be unsent.
            text = state.text[state.sent_text : text_end]
            token_ids = request.output_token_ids[state.sent_token_ids :]
            state.sent_text = max(state.sent_text, text_end)
            state.sent_token_ids = request.num_output_tokens
            if logprobs is not None:
                logprobs, state.sent_logprobs = logprobs[state.sent_logprobs :], len(logprobs)
        else:
            text = state.text[:text_end]
            token_ids = list(request.output_token_ids)
            logprobs = None if logprobs is None else list(logprobs)
        return CompletionOutput(  # by position, as RequestOutput in make_output
            index,
            text,
            token_ids,
            request.status.finish_reason,
            request.stop_reason,
            logprobs,
            state.cumulative_logprob if state.logprobs is not None else None,
        )


def _metrics(children: list[Request]) -> RequestMetrics:
    """The request's times: its first child scheduled and token, its last child finished."""
    if len(children) == 1:  # the common case, every step: no scans over the children
        child = children[0]
        return RequestMetrics(child.arrival_time, child.first_scheduled_time, child.first_token_time,
                              child.finished_time, child.num_preemptions, child.num_output_tokens)
    first = lambda times: min((t for t in times if t is not None), default=None)  # noqa: E731
    finished = [child.finished_time for child in children]
    return RequestMetrics(
        arrival_time=children[0].arrival_time,
        first_scheduled_time=first(child.first_scheduled_time for child in children),
        first_token_time=first(child.first_token_time for child in children),
        finished_time=None if None in finished else max(finished),
        num_preemptions=sum(child.num_preemptions for child in children),
        num_generation_tokens=sum(child.num_output_tokens for child in children),
    )


def _is_stop_token(request: Request, token_id: int) -> bool:
    """Whether token_id stops the request by itself: an eos (unless ignore_eos) or a stop token id."""
    params = request.sampling_params
    return token_id in params.stop_token_ids or (not params.ignore_eos and token_id in request.eos_token_ids)
