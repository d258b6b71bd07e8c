"""POST /v1/chat/completions: messages through the model's chat template -> assistant replies."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from cbjax.entrypoints.openai import serving
from cbjax.entrypoints.openai.errors import APIError
from cbjax.entrypoints.openai.forced_tools import forced_tool_choice
from cbjax.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCallMessage,
    random_id,
)
from cbjax.entrypoints.openai.serving import ServerState
from cbjax.entrypoints.openai.tool_parsers import ToolCall, ToolCallStream, ToolParser
from cbjax.entrypoints.llm import chat_prompt
from cbjax.outputs import CompletionOutput, RequestOutput


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, raw_request: Request) -> Response:
    lora_request = serving.check_model(state, body.model)
    serving.check_fields(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, f"top_logprobs={body.top_logprobs} needs logprobs=true; set it or drop top_logprobs",
                       "top_logprobs")
    serving.check_fan_out(state, 1, body)
    tools = offered_tools(state, body)
    await serving.check_overload(state)
    prompt = await serving.off_loop(state, rendered_chat, state, body.messages, body.add_generation_prompt, tools)
    serving.check_prompt_token_ids(state, prompt["prompt_token_ids"], "messages")
    max_tokens = serving.check_context_length(state, len(prompt["prompt_token_ids"]),
                                      body.max_completion_tokens or body.max_tokens)
    params = serving.sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    tool_parser = state.tool_parser if tools else None  # tools offered: the parser reads the calls back
    forced = forced_tool_choice(body.tools, body.tool_choice) if tools else None
    if forced is not None:  # the reply is a call, by a grammar; its parser reads it back
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice {body.tool_choice!r} constrains the reply to a call, so it takes no "
                                "response_format or other output constraint; drop one", "tool_choice")
        params, tool_parser = dataclasses.replace(params, structured_outputs=forced[0]), forced[1]
    serving.check_engine_request(state, [prompt], [params], body.priority)
    request_id = random_id("chatcmpl")
    outputs = await serving.admit(state, [prompt], [params], request_id, priority=body.priority,
                                  lora_request=lora_request)
    if body.stream:
        return serving.stream(_stream(state, body, request_id, len(prompt["prompt_token_ids"]), outputs, tool_parser),
                              outputs)
    work = _collect(state, body, request_id, outputs, tool_parser)
    return serving.respond(await serving.cancel_on_disconnect(raw_request, work))


def offered_tools(state: ServerState, body: ChatCompletionRequest) -> list[dict] | None:
    """The tools the chat template shows the model, as vLLM decides: none for tool_choice "none";
    "auto" (the default with tools) needs a tool-call parser to read the calls back; "required" and a
    named function are forced by a grammar (forced_tools.py)."""
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    if choice != "none" and not body.tools:
        raise APIError(400, f"tool_choice={choice!r} needs tools; send the tools the model may call", "tool_choice")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in {tool.function.name for tool in body.tools}:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools sent "
                                f"({', '.join(tool.function.name for tool in body.tools)})", "tool_choice")
    if choice == "auto" and state.tool_parser is None:
        raise APIError(400, 'tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                            "--tool-call-parser NAME (the model's tool-call format); or send tool_choice \"none\"",
                       "tool_choice")
    return None if choice == "none" else [tool.model_dump() for tool in body.tools]


def rendered_chat(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                  tools: list[dict] | None = None) -> dict:
    """The conversation through the model's chat template, as an engine prompt (in the tokenizer
    thread: a long conversation takes a while); a model without a template is the client's 400."""
    try:
        return chat_prompt(state.engine.tokenizer, conversation(messages), add_generation_prompt, tools)
    except ValueError as error:
        raise APIError(400, str(error), "messages") from error


def conversation(messages: list[ChatMessage]) -> list[dict[str, object]]:
    """Messages as the chat template takes them; content parts are joined to their text; earlier
    tool calls carry their arguments as objects, as transformers' templates expect them."""
    if not messages:
        raise APIError(400, "messages is empty; send at least one message", "messages")
    rendered = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
        turn: dict[str, object] = {"role": message.role, "content": content or ""}
        if message.tool_calls:
            turn["tool_calls"] = [_template_call(call) for call in message.tool_calls]
        turn.update({k: v for k, v in (("tool_call_id", message.tool_call_id), ("name", message.name)) if v is not None})
        rendered.append(turn)
    return rendered


def _template_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError as error:
            raise APIError(400, f"a tool call's arguments are not JSON ({error}): {function['arguments'][:60]!r}",
                           "messages") from error
    return {**call, "function": function}


def chat_logprobs(completion: CompletionOutput, num_top: int) -> ChatLogProbs:
    content = []
    for token_id, candidates in zip(completion.token_ids, completion.logprobs or []):
        sampled = candidates[token_id]
        ranked = sorted((c for c in candidates.values() if c.rank is not None and c.rank <= num_top),
                        key=lambda c: c.rank)
        content.append(ChatTokenLogprob(
            token=sampled.decoded_token or "", logprob=sampled.logprob, bytes=_bytes(sampled.decoded_token),
            top_logprobs=[ChatTopLogprob(token=c.decoded_token or "", logprob=c.logprob, bytes=_bytes(c.decoded_token))
                          for c in ranked],
        ))
    return ChatLogProbs(content=content)


def _bytes(token: str | None) -> list[int]:
    return list((token or "").encode("utf-8"))


class ReplyText:
    """One choice's text split into reasoning, content and tool calls (with the server's parsers),
    whole or delta by delta."""

    def __init__(self, state: ServerState, tool_parser: ToolParser | None):
        self.reasoning = state.reasoning_parser
        self.tool_parser = tool_parser
        self.thinking = self.reasoning.stream() if self.reasoning is not None else None
        self.calls = ToolCallStream(tool_parser) if tool_parser is not None else None
        self.num_calls = 0

    def whole(self, text: str) -> tuple[ChatResponseMessage, bool]:
        """The message of a whole reply, and whether it called tools."""
        reasoning, content = self.reasoning.split(text) if self.reasoning is not None else (None, text)
        calls = []
        if self.tool_parser is not None:
            content, calls = self.tool_parser.parse(content or "")
        return ChatResponseMessage(content=content, reasoning_content=reasoning,
                                   tool_calls=[_call_message(call) for call in calls]), bool(calls)

    def delta(self, text: str, final: bool) -> DeltaMessage:
        reasoning, content = self.thinking.feed(text, final) if self.thinking is not None else ("", text)
        calls = []
        if self.calls is not None:
            content, calls = self.calls.feed(content, final)
        out = [DeltaToolCall(index=self.num_calls + i, **_call_message(call).model_dump()) for i, call in enumerate(calls)]
        self.num_calls += len(calls)
        return DeltaMessage(content=content or None, reasoning_content=reasoning or None, tool_calls=out)


def _call_message(call: ToolCall) -> ToolCallMessage:
    return ToolCallMessage(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _finish_reason(completion: CompletionOutput, called_tools: bool) -> str | None:
    return "tool_calls" if called_tools and completion.finish_reason is not None else completion.finish_reason


async def _collect(
    state: ServerState, body: ChatCompletionRequest, request_id: str, outputs: AsyncIterator[tuple[int, RequestOutput]],
    tool_parser: ToolParser | None = None,
) -> ChatCompletionResponse:
    final = None
    async for _, output in outputs:
        final = output
    choices = []
    for completion in final.outputs:
        message, called = ReplyText(state, tool_parser).whole(completion.text)
        choices.append(ChatChoice(
            index=completion.index, message=message,
            logprobs=chat_logprobs(completion, body.top_logprobs or 0) if body.logprobs else None,
            finish_reason=_finish_reason(completion, called), stop_reason=completion.stop_reason,
        ))
    num_completion_tokens = sum(len(completion.token_ids) for completion in final.outputs)
    return ChatCompletionResponse(id=request_id, model=serving.response_model(state, body.model), choices=choices,
                                  usage=serving.usage(len(final.prompt_token_ids), num_completion_tokens))


async def _stream(
    state: ServerState, body: ChatCompletionRequest, request_id: str, num_prompt_tokens: int,
    outputs: AsyncIterator[tuple[int, RequestOutput]], tool_parser: ToolParser | None = None,
) -> AsyncIterator[ChatCompletionChunk]:
    def chunk(choice: ChatStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, model=serving.response_model(state, body.model), choices=[choice])

    started = False
    finished: set[int] = set()  # choices whose finish_reason went out (with n > 1 others go on)
    replies = {index: ReplyText(state, tool_parser) for index in range(body.n)}
    num_completion_tokens = 0
    async for _, output in outputs:
        if not started:  # the role goes first, once the engine has taken the request
            started = True
            for index in range(body.n):
                yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
        for completion in output.outputs:
            if completion.index in finished:
                continue
            num_completion_tokens += len(completion.token_ids)
            if completion.finish_reason is not None:
                finished.add(completion.index)
            if completion.text or completion.token_ids or completion.finish_reason is not None:
                reply = replies[completion.index]
                delta = reply.delta(completion.text, completion.finish_reason is not None)
                yield chunk(ChatStreamChoice(
                    index=completion.index, delta=delta,
                    logprobs=chat_logprobs(completion, body.top_logprobs or 0) if body.logprobs else None,
                    finish_reason=_finish_reason(completion, reply.num_calls > 0), stop_reason=completion.stop_reason,
                ))
    if body.stream_options and body.stream_options.include_usage:
        yield ChatCompletionChunk(id=request_id, model=serving.response_model(state, body.model), choices=[],
                                  usage=serving.usage(num_prompt_tokens, num_completion_tokens))
