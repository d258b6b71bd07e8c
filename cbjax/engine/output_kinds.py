"""A request's stream of cumulative outputs seen as vLLM's RequestOutputKind asks: cumulative, delta
or final only."""

from __future__ import annotations

import dataclasses

from cbjax.outputs import CompletionOutput, RequestOutput
from cbjax.sampling_params import RequestOutputKind


@dataclasses.dataclass
class _Sent:
    """How much of one completion earlier deltas already carried."""

    text: int = 0
    token_ids: int = 0
    logprobs: int = 0


class OutputKindView:
    """Turns the engine's cumulative outputs of one request into the kind it asked for."""

    def __init__(self, kind: RequestOutputKind):
        self.kind = kind
        self.sent: dict[int, _Sent] = {}

    def apply(self, output: RequestOutput) -> RequestOutput | None:
        """The output to hand on, or None when this kind shows nothing yet."""
        if self.kind is RequestOutputKind.CUMULATIVE:
            return output
        if self.kind is RequestOutputKind.FINAL_ONLY:
            return output if output.finished else None
        return dataclasses.replace(output, outputs=[self._delta(completion) for completion in output.outputs])

    def _delta(self, completion: CompletionOutput) -> CompletionOutput:
        sent = self.sent.setdefault(completion.index, _Sent())
        # A stop string found later can shorten the text below what was sent; nothing can be unsent.
        delta = dataclasses.replace(
            completion,
            text=completion.text[sent.text:],
            token_ids=completion.token_ids[sent.token_ids:],
            logprobs=None if completion.logprobs is None else completion.logprobs[sent.logprobs:],
        )
        sent.text = max(sent.text, len(completion.text))
        sent.token_ids = len(completion.token_ids)
        sent.logprobs = 0 if completion.logprobs is None else len(completion.logprobs)
        return delta
