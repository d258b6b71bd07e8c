"""A constraint applies to the answer, not to the reasoning (vLLM's reasoner in its structured-output
manager): with a reasoning parser set, a request's grammar allows every token until the reply's
`</think>`, then constrains the tokens after it.

Whether the thinking is open when the reply starts is read from the prompt as vLLM's
`is_reasoning_end` reads it: the last marker in the prompt decides (`</think>`: over, as in a Qwen3
prompt with thinking off; `<think>` or none: open, as in DeepSeek-R1's prompt). The markers are
found in the detokenized text, so they need not be single tokens; the grammar starts at the token
after the one that completes `</think>` (exact where `</think>` is one token, as in R1 and Qwen3).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
from jaxtyping import Int32

from cbjax.core.structured.backend import Grammar

THINK_START, THINK_END = "<think>", "</think>"
# The reasoning parsers (entrypoints/openai/reasoning.py splits their replies); all think in these markers.
REASONING_PARSERS = ("deepseek_r1", "qwen3")
_ALL_TOKENS = -1  # a mask word with every bit set


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r} is not known; choose one of {list(REASONING_PARSERS)} or None")


def reasoning_ended(text: str) -> bool:
    """Whether the last thinking marker in text closes the thinking (none: it is open)."""
    return text.rfind(THINK_END) > text.rfind(THINK_START)


class AfterReasoning(Grammar):
    """`grammar` applied from the token after the reply's `</think>`; every token allowed before it."""

    def __init__(self, grammar: Grammar, decode_token: Callable[[int], str], ended_in_prompt: bool) -> None:
        self._grammar = grammar
        self._decode_token = decode_token
        self._ended_in_prompt = ended_in_prompt
        self._ended = ended_in_prompt
        self._tail = ""  # the reply's last characters while thinking: a marker may span tokens

    @property
    def reasoning_ended(self) -> bool:
        return self._ended

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if self._ended:
            return self._grammar.accept_tokens(token_ids)
        for k, token_id in enumerate(token_ids):
            self._tail += self._decode_token(token_id)
            if THINK_END in self._tail:
                self._ended = True
                answer = token_ids[k + 1:]  # (several tokens a step: speculative decoding)
                return self._grammar.accept_tokens(answer) if answer else True
            self._tail = self._tail[-(len(THINK_END) - 1):]
        return True

    def fill_bitmask(self, bitmask: Int32[np.ndarray, "rows words"], row: int) -> None:
        if self._ended:
            self._grammar.fill_bitmask(bitmask, row)
        else:
            bitmask[row] = _ALL_TOKENS

    def is_terminated(self) -> bool:
        return self._ended and self._grammar.is_terminated()

    def reset(self) -> None:
        self._ended, self._tail = self._ended_in_prompt, ""
        self._grammar.reset()

    def fork(self) -> AfterReasoning:
        forked = copy.copy(self)
        forked._grammar = self._grammar.fork()
        return forked
