"""Turns sampled tokens into text: incremental detokenization, stop strings, logprobs, outputs."""

from __future__ import annotations

import dataclasses

from cbjax.engine.request import Request
from cbjax.engine.runner import SampledToken
from cbjax.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from cbjax.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclasses.dataclass
class RequestText:
    """Host-side text state of one request."""

    prompt: str | None
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.texts: dict[str, RequestText] = {}

    def add_request(self, request: Request, prompt: str | None) -> None:
        params = request.sampling_params
        self.texts[request.request_id] = RequestText(
            prompt=prompt,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            ),
            logprobs=[] if params.logprobs is not None else None,
        )

    def process_token(self, request: Request, sampled: SampledToken) -> str | None:
        """Record the request's newest token; the stop string it completed, if any."""
        state = self.texts[request.request_id]
        params = request.sampling_params
        state.cumulative_logprob += sampled.logprob
        if state.logprobs is not None:
            state.logprobs.append(self._logprobs(sampled))
        delta = state.detokenizer.add_tokens([sampled.token_id])
        state.text += delta
        if not params.stop or not delta:
            return None
        # Only a window around the new text can hold a stop string that was not there before.
        window_start = max(0, len(state.text) - len(delta) - max(map(len, params.stop)) + 1)
        for stop in params.stop:
            index = state.text.find(stop, window_start)
            if index != -1:
                end = index + len(stop) if params.include_stop_str_in_output else index
                state.text = state.text[:end]
                return stop
        return None

    def _logprobs(self, sampled: SampledToken) -> dict[int, Logprob]:
        entry = {
            token_id: Logprob(logprob, rank, self.tokenizer.decode([token_id], skip_special_tokens=False))
            for rank, (token_id, logprob) in enumerate(zip(sampled.top_token_ids, sampled.top_logprobs), start=1)
        }
        if sampled.token_id not in entry:
            decoded = self.tokenizer.decode([sampled.token_id], skip_special_tokens=False)
            entry[sampled.token_id] = Logprob(sampled.logprob, None, decoded)
        return entry

    def make_output(self, request: Request) -> RequestOutput:
        state = self.texts[request.request_id]
        if request.is_finished:
            del self.texts[request.request_id]
        completion = CompletionOutput(
            index=0,
            text=state.text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=state.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=[completion],
            finished=request.is_finished,
            metrics=RequestMetrics(
                arrival_time=request.arrival_time,
                first_scheduled_time=request.first_scheduled_time,
                first_token_time=request.first_token_time,
                finished_time=request.finished_time,
                num_preemptions=request.num_preemptions,
                num_generation_tokens=request.num_output_tokens,
            ),
        )
