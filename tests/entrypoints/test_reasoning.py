"""Reasoning parsers: hand-worked splits of whole replies, and streamed deltas that join to the
whole reply's split however the reply is cut into deltas (tags split across deltas included)."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cbjax.entrypoints.openai.reasoning import PARSERS, reasoning_parser

R1, QWEN3 = PARSERS["deepseek_r1"], PARSERS["qwen3"]


@pytest.mark.parametrize(("text", "r1", "qwen3"), [
    ("<think>plan</think>answer", ("plan", "answer"), ("plan", "answer")),
    ("\n<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer"), ("\nplan\n", "\n\nanswer")),
    ("plan</think>answer", ("plan", "answer"), (None, "plan</think>answer")),  # R1: <think> was in the prompt
    ("<think>still planning", ("still planning", None), ("still planning", None)),  # cut while thinking
    ("just an answer", ("just an answer", None), (None, "just an answer")),
    ("<think>plan</think>", ("plan", None), ("plan", None)),  # stopped right after thinking
    ("", (None, None), (None, None)),
    ("a</think>b</think>c", ("a", "b</think>c"), (None, "a</think>b</think>c")),  # the first </think> ends it
])
def test_whole_replies_split_as_worked_out_by_hand(text, r1, qwen3):
    assert R1.split(text) == r1
    assert QWEN3.split(text) == qwen3


PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "plan ", "\n", "ans", "<th", "k>"]),
                  max_size=12)


@example(pieces=["\n", "<think>"], cuts=[1], parser=R1)  # leading whitespace, then <think>: found by hypothesis
@given(pieces=PIECES, cuts=st.lists(st.integers(0, 200), max_size=8), parser=st.sampled_from([R1, QWEN3]))
def test_streamed_deltas_join_to_the_whole_split_wherever_the_reply_is_cut(pieces, cuts, parser):
    text = "".join(pieces)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    stream = parser.stream()
    reasoning = content = ""
    for start, end in zip(bounds, bounds[1:]):
        r, c = stream.feed(text[start:end], final=end == len(text))
        reasoning, content = reasoning + r, content + c
    if len(bounds) == 1:  # an empty reply: one final, empty delta
        reasoning, content = stream.feed("", final=True)
    assert (reasoning or None, content or None) == parser.split(text)


def test_an_unknown_parser_names_the_known_ones():
    assert reasoning_parser(None) is None
    with pytest.raises(ValueError, match=r"'granite' is not known; choose one of \['deepseek_r1', 'qwen3'\]"):
        reasoning_parser("granite")
