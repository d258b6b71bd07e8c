"""What both generation endpoints share: the served model's facts, request checks (model name,
overload, context length), OpenAI fields -> SamplingParams, streams of several prompts merged,
and disconnect -> abort for answers that are not streamed."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from cbjax.engine.async_llm import AsyncLLM
from cbjax.engine.exceptions import EngineDeadError
from cbjax.entrypoints.openai.errors import APIError, error_json
from cbjax.entrypoints.openai.protocol import SamplingFields, UsageInfo
from cbjax.outputs import RequestOutput
from cbjax.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")
RETRY_AFTER_S = 1  # what an overloaded server asks clients to wait before retrying


@dataclasses.dataclass
class ServerState:
    engine: AsyncLLM
    served_model_name: str
    max_model_len: int
    max_waiting_requests: int | None  # None: queue without limit


def check_model(state: ServerState, model: str | None) -> None:
    """404 for another model's name (no name means the served model)."""
    if model is not None and model != state.served_model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{state.served_model_name}`",
                       "model")


def check_request(state: ServerState, model: str | None) -> None:
    """A generation request's gate: the model name, then 503 (+Retry-After) when the waiting queue is full."""
    check_model(state, model)
    limit = state.max_waiting_requests
    if limit is not None and state.engine.num_waiting_requests() >= limit:
        raise APIError(
            503,
            f"the server is overloaded: {limit} requests are already waiting (--max-waiting-requests={limit}); "
            f"retry after {RETRY_AFTER_S} s",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


def check_context_length(state: ServerState, num_prompt_tokens: int, max_tokens: int | None) -> int:
    """The request's max_tokens (the rest of the context when unset), in vLLM's wording when too long."""
    limit = state.max_model_len
    if num_prompt_tokens >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your request has "
                            f"{num_prompt_tokens} input tokens. Please reduce the length of the input messages.")
    if max_tokens is None:
        return limit - num_prompt_tokens
    if num_prompt_tokens + max_tokens > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
            "max_tokens",
        )
    return max_tokens


def sampling_params(request: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """OpenAI's fields (None = OpenAI's default) as SamplingParams; streams take deltas, others the final output."""
    kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
    return SamplingParams(
        n=request.n,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=0 if request.top_k is None else request.top_k,
        min_p=0.0 if request.min_p is None else request.min_p,
        seed=request.seed,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        output_kind=kind,
        logit_bias=logit_bias(request.logit_bias),
        allowed_token_ids=request.allowed_token_ids,
        bad_words=request.bad_words,
    )


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids are JSON strings) with each bias clamped to [-100, 100], as vLLM does."""
    if bias is None:
        return None
    keys = [key for key in bias if not key.strip().lstrip("-").isdigit()]
    if keys:
        raise ValueError(f"logit_bias keys must be token ids (integers, as strings), got {keys[:3]}")
    return {int(token_id): min(100.0, max(-100.0, value)) for token_id, value in bias.items()}


async def merged_outputs(
    engine: AsyncLLM, prompts: list[dict[str, Any]], params: list[SamplingParams], request_id: str, *, priority: int
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every prompt's request as they come; leaving early aborts them all."""
    if len(prompts) == 1:
        async for output in engine.generate(prompts[0], params[0], request_id, priority=priority):
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None] | BaseException] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for output in engine.generate(prompts[index], params[index], f"{request_id}-{index}", priority=priority):
                queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as error:  # handed to the consumer, which raises it
            queue.put_nowait(error)

    tasks = [asyncio.create_task(pump(index)) for index in range(len(prompts))]
    try:
        remaining = len(prompts)
        while remaining:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            index, output = item
            if output is None:
                remaining -= 1
            else:
                yield index, output
    finally:
        for task in tasks:
            task.cancel()  # each task's generate() aborts its request when cancelled
        await asyncio.gather(*tasks, return_exceptions=True)


def check_prompt_token_ids(state: ServerState, token_ids: list[int], field: str) -> None:
    """Refuse an empty or out-of-vocabulary prompt before anything is queued or streamed."""
    if not token_ids:
        raise APIError(400, f"{field} is empty (0 tokens); give at least one token", field)
    vocab = state.engine.model_config.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"{field} holds token id {bad[0]}, outside the vocabulary [0, {vocab}); "
                            "use ids from this model's tokenizer", field)


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                     total_tokens=num_prompt_tokens + num_completion_tokens)


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def sse_stream(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Server-sent events ending in `data: [DONE]`; an error after the headers went out becomes an
    error event (the status line is already sent)."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except APIError as error:
        yield f"data: {error_json(error.status, error.message, error.param)}\n\n"
    except ValueError as error:
        yield f"data: {error_json(400, str(error))}\n\n"
    except EngineDeadError as error:
        yield f"data: {error_json(503, str(error))}\n\n"
    yield "data: [DONE]\n\n"


async def first_chunk_or_error(chunks: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for the first chunk before any header goes out, so that a rejected request (bad input)
    still gets its 400 status."""
    first = await anext(chunks)

    async def stream() -> AsyncIterator[T]:
        yield first
        async for chunk in chunks:
            yield chunk

    return stream()


def respond(answer: BaseModel | AsyncIterator[BaseModel] | None) -> Response:
    """The HTTP response for a handler's answer: JSON, an event stream, or 499 for a client that left
    (its requests are aborted already)."""
    if answer is None:
        return Response(status_code=499)
    if isinstance(answer, BaseModel):
        return JSONResponse(answer.model_dump())
    return StreamingResponse(sse_stream(answer), media_type="text/event-stream")


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work` until it is done or the client disconnects (then cancel it: its requests abort)."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_disconnected(request))
    done, _ = await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if work_task in done:
        watcher.cancel()
        return work_task.result()
    work_task.cancel()
    await asyncio.gather(work_task, return_exceptions=True)
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
