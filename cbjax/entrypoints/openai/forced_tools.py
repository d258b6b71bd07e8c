"""tool_choice "required" and a named function, as vLLM enforces them: a JSON-schema constraint built
from the tools' parameter schemas makes the reply a call (so its arguments always parse and
validate), and a parser reads the call back. "required": a JSON array of {"name", "parameters"}
objects, one of the tools each; a named function: the reply is that function's arguments object."""

from __future__ import annotations

import json
import uuid
from typing import Any

from cbjax.core.structured.guidance import check_constraint
from cbjax.entrypoints.openai.errors import APIError
from cbjax.entrypoints.openai.protocol import ChatTool
from cbjax.entrypoints.openai.tool_parsers import ToolCall, tool_call
from cbjax.sampling_params import StructuredOutputsParams

_NO_PARAMETERS = {"type": "object", "properties": {}}


class RequiredToolCalls:
    """Reads the reply of tool_choice "required": the whole reply, held until it ends, is the calls."""

    name = "required"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            calls = [tool_call(obj) for obj in json.loads(text)]
        except (json.JSONDecodeError, TypeError):  # (cut by max_tokens: the client sees the text)
            return text or None, []
        return (None, calls) if calls and None not in calls else (text or None, [])

    def content_so_far(self, text: str) -> int:
        return 0


class NamedToolCall:
    """Reads the reply of a named tool_choice: the whole reply is that function's arguments."""

    def __init__(self, function_name: str):
        self.name = function_name

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            arguments = json.loads(text)
        except json.JSONDecodeError:
            return text or None, []
        if not isinstance(arguments, dict):
            return text or None, []
        return None, [ToolCall(self.name, json.dumps(arguments, ensure_ascii=False), f"chatcmpl-tool-{uuid.uuid4().hex}")]

    def content_so_far(self, text: str) -> int:
        return 0


def forced_tool_choice(tools: list[ChatTool], choice: Any) -> tuple[StructuredOutputsParams, RequiredToolCalls | NamedToolCall] | None:
    """The constraint and the reply's parser of tool_choice "required" or a named function (its name
    checked already), else None; a 400 naming `tools` if their parameter schemas do not compile."""
    if choice == "required":
        forced = StructuredOutputsParams(json=_required_schema(tools)), RequiredToolCalls()
    elif isinstance(choice, dict):
        name = choice["function"]["name"]
        tool = next(tool for tool in tools if tool.function.name == name)
        forced = StructuredOutputsParams(json=tool.function.parameters or _NO_PARAMETERS), NamedToolCall(name)
    else:
        return None
    try:
        check_constraint(forced[0])
    except ValueError as error:
        raise APIError(400, f"the tools' parameter schemas do not make a constraint for tool_choice: {error}",
                       "tools") from error
    return forced


def _required_schema(tools: list[ChatTool]) -> dict[str, Any]:
    """vLLM's: an array of at least one call, each {"name": one tool's, "parameters": its schema}; the
    tools' $defs hoisted to the top, where their $refs point."""
    defs: dict[str, Any] = {}
    calls = []
    for tool in tools:
        parameters = dict(tool.function.parameters or _NO_PARAMETERS)
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise APIError(400, f"tools define $defs {name!r} twice, differently; tool_choice \"required\" "
                                    "puts every tool's $defs in one schema: rename one", "tools")
        calls.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if defs:
        schema["$defs"] = defs
    return schema
