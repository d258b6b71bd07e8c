"""Tool-call parsers: hand-worked replies in each model's format, and streamed deltas that join to
the whole reply's content, with the calls once it ends, wherever the reply is cut."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk as ClientChunk

from cbjax.entrypoints.openai import chat
from cbjax.entrypoints.openai.protocol import ChatCompletionRequest
from cbjax.entrypoints.openai.reasoning import PARSERS as REASONING
from cbjax.outputs import CompletionOutput, RequestMetrics, RequestOutput
from cbjax.entrypoints.openai.tool_parsers import PARSERS, ToolCallStream

HERMES, LLAMA3 = PARSERS["hermes"], PARSERS["llama3_json"]
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'


def calls(parsed):
    content, found = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in found]


@pytest.mark.parametrize(("text", "want"), [
    (f"<tool_call>\n{WEATHER}\n</tool_call>", (None, [("get_weather", {"city": "Paris", "days": 2})])),
    (f"Let me check.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>"
     '{"name": "now", "arguments": {}}</tool_call>',
     ("Let me check.", [("get_weather", {"city": "Paris", "days": 2}), ("now", {})])),
    (f"<tool_call>{WEATHER}", (None, [("get_weather", {"city": "Paris", "days": 2})])),  # cut before its end tag
    ("<tool_call>{not json}</tool_call>", ("<tool_call>{not json}</tool_call>", [])),  # left as the model wrote it
    ('<tool_call>{"arguments": {}}</tool_call>', ('<tool_call>{"arguments": {}}</tool_call>', [])),  # no name
    ("Paris is sunny.", ("Paris is sunny.", [])),
])
def test_hermes_replies_parse_as_worked_out_by_hand(text, want):
    assert calls(HERMES.parse(text)) == want


@pytest.mark.parametrize(("text", "want"), [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', (None, [("get_weather", {"city": "Paris"})])),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
     (None, [("a", {}), ("b", {"x": 1})])),
    ('{"name": "a", "parameters": {}} and then prose', ('{"name": "a", "parameters": {}} and then prose', [])),
    ('{"name": "a", "parameters": ', ('{"name": "a", "parameters": ', [])),  # cut mid-call: content
    ("The weather is fine.", ("The weather is fine.", [])),
])
def test_llama3_json_replies_parse_as_worked_out_by_hand(text, want):
    assert calls(LLAMA3.parse(text)) == want


PIECES = st.lists(st.sampled_from(["Sure", " ", "\n", "<tool_call>", "</tool_call>", WEATHER, "<tool", "_call>",
                                   '{"name": "a", "parameters": {}}', ";", "<|python_tag|>", "{", "}"]), max_size=8)


@given(pieces=PIECES, cuts=st.lists(st.integers(0, 300), max_size=6), parser=st.sampled_from([HERMES, LLAMA3]))
def test_streamed_content_and_calls_equal_the_whole_parse_wherever_the_reply_is_cut(pieces, cuts, parser):
    text = "".join(pieces)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    if len(bounds) == 1:
        bounds = [0, 0]
    stream, content, found = ToolCallStream(parser), "", []
    for start, end in zip(bounds, bounds[1:]):
        delta, new_calls = stream.feed(text[start:end], final=end == bounds[-1])
        content, found = content + delta, found + new_calls
    whole_content, whole_calls = parser.parse(text)
    assert content == (whole_content or "")
    assert [(c.name, c.arguments) for c in found] == [(c.name, c.arguments) for c in whole_calls]


# ---- through the chat route's reply handling, assembled by the official openai client ----------

REPLY = ('<think>The user wants weather.</think>Checking both.\n<tool_call>\n' + WEATHER + '\n</tool_call>\n'
         '<tool_call>{"name": "now", "arguments": {"tz": "CET"}}</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]


async def replayed(pieces: list[str]):
    """The engine's delta outputs of one completion whose text arrives in `pieces`."""
    for i, piece in enumerate(pieces):
        done = i == len(pieces) - 1
        yield 0, RequestOutput("r", None, [1, 2], [CompletionOutput(0, piece, [7], "stop" if done else None)], done,
                               RequestMetrics(0.0, 0.0, 0.0, None, 0))


def test_a_streamed_and_a_whole_reply_give_the_openai_client_the_same_calls_and_reasoning():
    state = SimpleNamespace(reasoning_parser=REASONING["deepseek_r1"], served_model_name="m", lora_adapters={})
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, stream=True)
    pieces = [REPLY[i:i + 7] for i in range(0, len(REPLY), 7)]  # tags cut across deltas

    async def run():
        chunks = [c async for c in chat._stream(state, body, "id", 2, replayed(pieces), HERMES)]
        whole = await chat._collect(state, body, "id", replayed([REPLY]), HERMES)
        return chunks, whole

    chunks, whole = asyncio.run(run())
    assembler = ChatCompletionStreamState(input_tools=TOOLS)
    for chunk in chunks:
        assembler.handle_chunk(ClientChunk.model_validate(chunk.model_dump()))
    streamed = assembler.get_final_completion().choices[0]
    want_calls = [("get_weather", {"city": "Paris", "days": 2}), ("now", {"tz": "CET"})]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed.message.tool_calls] == want_calls
    assert streamed.finish_reason == "tool_calls" and streamed.message.content == "Checking both."
    assert "".join(c.choices[0].delta.reasoning_content or "" for c in chunks) == "The user wants weather."
    (choice,) = whole.choices
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == want_calls
    assert (choice.message.content, choice.message.reasoning_content, choice.finish_reason) == (
        "Checking both.", "The user wants weather.", "tool_calls")


def test_earlier_calls_and_tool_answers_reach_the_template_as_transformers_passes_them():
    from cbjax.tokenizer.chat_template import render_chat_template

    template = ("{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
                "{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}{% endfor %}")
    body = ChatCompletionRequest(tools=TOOLS, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}])
    state = SimpleNamespace(tool_parser=HERMES)
    text = render_chat_template(template, chat.conversation(body.messages), False, tools=chat.offered_tools(state, body))
    assert text == ('[tool get_weather][tool now]<user>Weather?<assistant>[call get_weather {"city": "Paris"}]'
                    "<tool>sunny[for c1]")


@pytest.mark.parametrize(("choice", "parser", "message"), [
    ("auto", None, "--enable-auto-tool-choice"),
    ({"type": "function", "function": {"name": "fly"}}, HERMES, "'fly', which is not among the tools sent"),
])
def test_tool_choices_this_server_cannot_honour_are_refused_by_name(choice, parser, message):
    from cbjax.entrypoints.openai.errors import APIError

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice=choice)
    with pytest.raises(APIError, match=message):
        chat.offered_tools(SimpleNamespace(tool_parser=parser), body)
    none = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none")
    assert chat.offered_tools(SimpleNamespace(tool_parser=parser), none) is None  # "none": the template sees no tools


def test_forced_tool_choice_reads_calls_back_and_refuses_clashing_defs():
    """tool_choice "required": the reply is the calls' JSON array (a cut one stays content); tools
    whose $defs clash cannot share the one schema "required" builds: a 400 naming tools."""
    from cbjax.entrypoints.openai.errors import APIError
    from cbjax.entrypoints.openai.forced_tools import RequiredToolCalls, forced_tool_choice

    content, calls = RequiredToolCalls().parse('[{"name": "now", "parameters": {}}, {"name": "f", "parameters": {"a": 1}}]')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("now", {}), ("f", {"a": 1})]
    assert RequiredToolCalls().parse('[{"name": "now", "param') == ('[{"name": "now", "param', [])
    clash = [ChatCompletionRequest(messages=[], tools=[
        {"type": "function", "function": {"name": name, "parameters": {"$defs": {"u": {"enum": [name]}}}}}
        for name in ("a", "b")]).tools]
    with pytest.raises(APIError, match="tools define \\$defs 'u' twice"):
        forced_tool_choice(clash[0], "required")
