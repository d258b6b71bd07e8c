"""POST /v1/chat/completions: messages through the model's chat template -> assistant replies."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from cbjax.entrypoints.openai import serving
from cbjax.entrypoints.openai.errors import APIError
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
    random_id,
)
from cbjax.entrypoints.openai.serving import ServerState
from cbjax.entrypoints.llm import chat_prompt
from cbjax.outputs import CompletionOutput, RequestOutput


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, raw_request: Request) -> Response:
    serving.check_model(state, body.model)
    serving.check_fields(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, f"top_logprobs={body.top_logprobs} needs logprobs=true; set it or drop top_logprobs",
                       "top_logprobs")
    serving.check_fan_out(state, 1, body)
    await serving.check_overload(state)
    prompt = await serving.off_loop(state, rendered_chat, state, body.messages, body.add_generation_prompt)
    serving.check_prompt_token_ids(state, prompt["prompt_token_ids"], "messages")
    max_tokens = serving.check_context_length(state, len(prompt["prompt_token_ids"]),
                                      body.max_completion_tokens or body.max_tokens)
    params = serving.sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    serving.check_engine_request(state, [prompt], [params], body.priority)
    request_id = random_id("chatcmpl")
    outputs = await serving.admit(state, [prompt], [params], request_id, priority=body.priority)
    if body.stream:
        return serving.stream(_stream(state, body, request_id, len(prompt["prompt_token_ids"]), outputs), outputs)
    work = _collect(state, body, request_id, outputs)
    return serving.respond(await serving.cancel_on_disconnect(raw_request, work))


def rendered_chat(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool) -> dict:
    """The conversation through the model's chat template, as an engine prompt (in the tokenizer
    thread: a long conversation takes a while); a model without a template is the client's 400."""
    try:
        return chat_prompt(state.engine.tokenizer, conversation(messages), add_generation_prompt)
    except ValueError as error:
        raise APIError(400, str(error), "messages") from error


def conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template takes them; content parts are joined to their text."""
    if not messages:
        raise APIError(400, "messages is empty; send at least one message", "messages")
    rendered = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
        rendered.append({"role": message.role, "content": content or ""})
    return rendered


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


async def _collect(
    state: ServerState, body: ChatCompletionRequest, request_id: str, outputs: AsyncIterator[tuple[int, RequestOutput]]
) -> ChatCompletionResponse:
    final = None
    async for _, output in outputs:
        final = output
    choices = [
        ChatChoice(
            index=completion.index, message=_message(state, completion.text),
            logprobs=chat_logprobs(completion, body.top_logprobs or 0) if body.logprobs else None,
            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
        )
        for completion in final.outputs
    ]
    num_completion_tokens = sum(len(completion.token_ids) for completion in final.outputs)
    return ChatCompletionResponse(id=request_id, model=state.served_model_name, choices=choices,
                                  usage=serving.usage(len(final.prompt_token_ids), num_completion_tokens))


def _message(state: ServerState, text: str) -> ChatResponseMessage:
    if state.reasoning_parser is None:
        return ChatResponseMessage(content=text)
    reasoning, content = state.reasoning_parser.split(text)
    return ChatResponseMessage(content=content, reasoning_content=reasoning)


async def _stream(
    state: ServerState, body: ChatCompletionRequest, request_id: str, num_prompt_tokens: int,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[ChatCompletionChunk]:
    def chunk(choice: ChatStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, model=state.served_model_name, choices=[choice])

    started = False
    finished: set[int] = set()  # choices whose finish_reason went out (with n > 1 others go on)
    parser = state.reasoning_parser
    thinking = {index: parser.stream() for index in range(body.n)} if parser is not None else {}
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
                delta = DeltaMessage(content=completion.text)
                if parser is not None:
                    reasoning, content = thinking[completion.index].feed(completion.text,
                                                                         completion.finish_reason is not None)
                    delta = DeltaMessage(content=content or None, reasoning_content=reasoning or None)
                yield chunk(ChatStreamChoice(
                    index=completion.index, delta=delta,
                    logprobs=chat_logprobs(completion, body.top_logprobs or 0) if body.logprobs else None,
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                ))
    if body.stream_options and body.stream_options.include_usage:
        yield ChatCompletionChunk(id=request_id, model=state.served_model_name, choices=[],
                                  usage=serving.usage(num_prompt_tokens, num_completion_tokens))
