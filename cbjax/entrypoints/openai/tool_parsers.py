"""Tool-call parsers (`cbjax serve --enable-auto-tool-choice --tool-call-parser NAME`): the calls a
chat reply writes in its model's format become OpenAI `tool_calls`, whole or streamed, as vLLM's
parsers of the same names read them.

- `hermes` (Hermes 2 Pro, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them; the text before the first one is the content.
- `llama3_json` (Llama 3.1-3.3): a reply that is a JSON object `{"name": ..., "parameters": {...}}`
  (or several separated by `;`), after an optional `<|python_tag|>`; any other reply is content.

A call whose JSON does not parse, or has no name, is left in the content: the client sees what the
model wrote rather than a call that would fail. Arguments are re-serialised as a JSON string, as
the API defines them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str


def tool_call(obj: object) -> ToolCall | None:
    """The call a parsed {"name": ..., "arguments" | "parameters": {...}} writes; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments already as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False), f"chatcmpl-tool-{uuid.uuid4().hex}")


class HermesParser:
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole reply."""
        if self.START not in text:
            return text or None, []
        calls = []
        for body in self._CALL.findall(text):
            try:
                call = tool_call(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text or None, []
            calls.append(call)
        content = text[: text.index(self.START)].rstrip()
        return content or None, calls

    def content_so_far(self, text: str) -> int:
        """How much of a reply still being written is surely content: up to a call's start, less a
        tail that could still become one (`<tool_`) and the whitespace a call would strip."""
        if self.START in text:
            return len(text[: text.index(self.START)].rstrip())
        held = max((n for n in range(1, len(self.START)) if text.endswith(self.START[:n])), default=0)
        return len(text[: len(text) - held].rstrip())


class Llama3JsonParser:
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body[len(self.TAG):].lstrip() if body.startswith(self.TAG) else body
        if not body.startswith("{"):
            return text or None, []
        calls, decoder, position = [], json.JSONDecoder(), 0
        while position < len(body):
            try:
                obj, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text or None, []
            call = tool_call(obj)
            if call is None:
                return text or None, []
            calls.append(call)
            position = end
            rest = body[position:].lstrip()
            if rest and not rest.startswith(";"):
                return text or None, []
            position = len(body) - len(rest[1:].lstrip()) if rest else len(body)
        return None, calls

    def content_so_far(self, text: str) -> int:
        """A reply that starts (or may start) with a call is held whole until it ends."""
        body = text.lstrip()
        if not body or body.startswith("{") or body.startswith(self.TAG) or self.TAG.startswith(body):
            return 0
        return len(text)


ToolParser = HermesParser | Llama3JsonParser
PARSERS: dict[str, ToolParser] = {parser.name: parser for parser in (HermesParser(), Llama3JsonParser())}


def tool_call_parser(enable_auto_tool_choice: bool, name: str | None) -> ToolParser | None:
    """The parser that reads "auto" tool calls back (vLLM's two flags: both or neither)."""
    if enable_auto_tool_choice and name is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME, the model's tool-call format "
                         f"(one of {sorted(PARSERS)})")
    if name is not None and name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not known; choose one of {sorted(PARSERS)}")
    return PARSERS[name] if enable_auto_tool_choice else None


class ToolCallStream:
    """One streamed choice: content deltas while they are surely content, the calls once the reply ends."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent = 0

    def feed(self, delta: str, final: bool) -> tuple[str, list[ToolCall]]:
        """(content delta, calls); calls only with `final`, and then the content is the whole
        reply's content minus what was sent (all of it if the reply holds no call after all)."""
        self.text += delta
        if not final:
            sure = self.parser.content_so_far(self.text)
            out, self.sent = self.text[self.sent:max(sure, self.sent)], max(sure, self.sent)
            return out, []
        content, calls = self.parser.parse(self.text)
        return (content or "")[self.sent:], calls
