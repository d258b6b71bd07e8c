"""POST /v1/completions: prompts (text, token ids, or lists of either) -> OpenAI completion choices."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from cbjax.entrypoints.openai import serving
from cbjax.entrypoints.openai.errors import APIError
from cbjax.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from cbjax.entrypoints.openai.serving import ServerState
from cbjax.outputs import CompletionOutput, Logprob, RequestOutput


async def create_completion(state: ServerState, body: CompletionRequest, raw_request: Request) -> Response:
    lora_request = serving.check_model(state, body.model)
    serving.check_fields(body)
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo=true with logprobs needs the prompt's logprobs, which this server does not "
                            "compute; drop echo or logprobs", "echo")
    serving.check_fan_out(state, _num_prompts(body.prompt), body)
    await serving.check_overload(state)
    prompts = await serving.off_loop(state, _prompts, state, body.prompt)
    max_tokens = [serving.check_context_length(state, len(p["prompt_token_ids"]), body.max_tokens) for p in prompts]
    params = [serving.sampling_params(body, limit, body.logprobs) for limit in max_tokens]
    serving.check_engine_request(state, prompts, params, body.priority)
    request_id = random_id("cmpl")
    outputs = await serving.admit(state, prompts, params, request_id, priority=body.priority, lora_request=lora_request)
    if body.stream:
        return serving.stream(_stream(state, body, request_id, prompts, outputs), outputs)
    work = _collect(state, body, request_id, prompts, outputs)
    return serving.respond(await serving.cancel_on_disconnect(raw_request, work))


def _num_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    return 1 if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else len(prompt)


def _prompts(state: ServerState, prompt: str | list[str] | list[int] | list[list[int]]) -> list[dict[str, Any]]:
    """Engine prompts ({"prompt", "prompt_token_ids"}), tokenized here for usage, echo and length
    checks (in the tokenizer thread: a long prompt takes a while)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        texts = [prompt] if isinstance(prompt, str) else prompt
        prompts = [{"prompt": text, "prompt_token_ids": state.engine.tokenizer.encode(text)} for text in texts]
    elif prompt and isinstance(prompt[0], int):
        prompts = [{"prompt": None, "prompt_token_ids": list(prompt)}]
    else:
        prompts = [{"prompt": None, "prompt_token_ids": list(ids)} for ids in prompt]
    if not prompts:
        raise APIError(400, "prompt is an empty list; give at least one prompt", "prompt")
    for index, p in enumerate(prompts):
        field = "prompt" if len(prompts) == 1 else f"prompt[{index}]"
        serving.check_prompt_token_ids(state, p["prompt_token_ids"], field)
    return prompts


def _prompt_text(state: ServerState, prompt: dict[str, Any]) -> str:
    if prompt["prompt"] is not None:
        return prompt["prompt"]
    return state.engine.tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=False)


def completion_logprobs(
    completion: CompletionOutput, text_offset: int
) -> tuple[CompletionLogProbs, int]:
    """The legacy completions logprobs (tokens, token_logprobs, top_logprobs, text_offset) and the offset after."""
    result = CompletionLogProbs()
    for token_id, candidates in zip(completion.token_ids, completion.logprobs or []):
        sampled: Logprob = candidates[token_id]
        token = sampled.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(sampled.logprob)
        result.top_logprobs.append({c.decoded_token or "": c.logprob for c in candidates.values()})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result, text_offset


async def _collect(
    state: ServerState, body: CompletionRequest, request_id: str, prompts: list[dict[str, Any]],
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> CompletionResponse:
    finals: dict[int, RequestOutput] = {}
    async for prompt_index, output in outputs:
        finals[prompt_index] = output
    choices, num_completion_tokens = [], 0
    for prompt_index, prompt in enumerate(prompts):
        prefix = _prompt_text(state, prompt) if body.echo else ""
        for completion in finals[prompt_index].outputs:
            num_completion_tokens += len(completion.token_ids)
            logprobs = completion_logprobs(completion, 0)[0] if body.logprobs is not None else None
            choices.append(CompletionChoice(
                index=prompt_index * body.n + completion.index, text=prefix + completion.text, logprobs=logprobs,
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
            ))
    num_prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    return CompletionResponse(id=request_id, model=serving.response_model(state, body.model), choices=choices,
                              usage=serving.usage(num_prompt_tokens, num_completion_tokens))


async def _stream(
    state: ServerState, body: CompletionRequest, request_id: str, prompts: list[dict[str, Any]],
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[CompletionResponse]:
    text_offsets: dict[int, int] = {}  # per choice: where its next token's text starts
    finished: set[int] = set()  # choices whose finish_reason went out (with n > 1 others go on)
    num_completion_tokens = 0
    model = serving.response_model(state, body.model)
    async for prompt_index, output in outputs:
        for completion in output.outputs:
            index = prompt_index * body.n + completion.index
            if index in finished:
                continue
            text = completion.text
            if body.echo and index not in text_offsets:
                text = _prompt_text(state, prompts[prompt_index]) + text
            num_completion_tokens += len(completion.token_ids)
            logprobs = None
            if body.logprobs is not None:
                logprobs, text_offsets[index] = completion_logprobs(completion, text_offsets.get(index, 0))
            text_offsets.setdefault(index, 0)
            if completion.finish_reason is not None:
                finished.add(index)
            if text or completion.token_ids or completion.finish_reason is not None:
                yield CompletionResponse(id=request_id, model=model, choices=[CompletionChoice(
                    index=index, text=text, logprobs=logprobs,
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                )])
    if body.stream_options and body.stream_options.include_usage:
        num_prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        yield CompletionResponse(id=request_id, model=model, choices=[],
                                 usage=serving.usage(num_prompt_tokens, num_completion_tokens))
