"""Reasoning parsers (`cbjax serve --reasoning-parser NAME`): a chat reply's thinking goes to
`reasoning_content`, the answer to `content`, whole or streamed, as vLLM's parsers of the same names.

They read the detokenized text: a model's `<think>` and `</think>` must survive detokenization, as
they do for DeepSeek-R1 and Qwen3, whose tokenizers mark them as added but not special tokens.

- `deepseek_r1`: everything up to `</think>` is reasoning (DeepSeek-R1's template opens `<think>` in
  the prompt, so the reply may not repeat it; a leading one is dropped); a reply that never closes
  it is all reasoning (cut by max_tokens while thinking).
- `qwen3`: a reply that opens with `<think>` reasons until `</think>`; any other reply is all answer
  (Qwen3 with thinking turned off).

The same option tells the engine (EngineConfig.reasoning_parser) to apply a request's output
constraint only after the thinking (core/structured/reasoning.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from cbjax.core.structured.reasoning import THINK_END as END
from cbjax.core.structured.reasoning import THINK_START as START


@dataclass(frozen=True)
class ThinkingParser:
    """Splits a reply at `<think>...</think>`; `opened_by_prompt`: the reply may start inside the
    thinking without its own `<think>` (deepseek_r1), else only a reply opening with it thinks (qwen3)."""

    name: str
    opened_by_prompt: bool

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply; None for a part that is empty or absent."""
        body = text.lstrip()
        opens = body.startswith(START)
        if opens:
            body = body[len(START):]
        elif not self.opened_by_prompt:
            return None, text or None
        else:
            body = text
        reasoning, closed, content = body.partition(END)
        return reasoning or None, (content or None) if closed else None

    def stream(self) -> ThinkingStream:
        return ThinkingStream(self)


class ThinkingStream:
    """One streamed choice: feed each text delta, get the (reasoning, content) deltas that are sure.

    A tail that could still become a tag (`</thi`, or a reply so far that is a prefix of `<think>`)
    is held back until the next delta or the end, so what was sent is always a prefix of the whole
    reply's split, and the concatenated deltas equal `split` of the whole text.
    """

    def __init__(self, parser: ThinkingParser):
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self.text += delta
        sure = self.text if final else self.text[: len(self.text) - _undecided_tail(self.text)]
        reasoning, content = self.parser.split(sure)
        reasoning, content = reasoning or "", content or ""
        out = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return out


def _undecided_tail(text: str) -> int:
    """How many final characters of `text` could still turn into a tag with more text."""
    body = text.lstrip()
    if START.startswith(body) and body != START:  # the reply so far (whitespace too) may be opening <think>
        return len(text)
    if END in text:
        return 0
    return max((n for n in range(1, len(END)) if text.endswith(END[:n])), default=0)


PARSERS = {parser.name: parser for parser in (ThinkingParser("deepseek_r1", True), ThinkingParser("qwen3", False))}


def reasoning_parser(name: str | None) -> ThinkingParser | None:
    """The parser called `name` (None: none); an unknown name lists the known ones."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not known; choose one of {sorted(PARSERS)}")
    return PARSERS[name]
