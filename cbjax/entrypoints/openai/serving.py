"""What both generation endpoints share: the served model's facts and limits, request checks
(model name, fields, fan-out, overload, context length), tokenization off the event loop, OpenAI
fields -> SamplingParams, streams of several prompts merged, and disconnect -> abort for answers
that are not streamed."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from cbjax.engine.async_llm import AsyncLLM
from cbjax.engine.exceptions import EngineDeadError
from cbjax.entrypoints.openai.errors import APIError, error_json, short_repr
from cbjax.entrypoints.openai.protocol import RequestModel, SamplingFields, UsageInfo
from cbjax.entrypoints.openai.reasoning import ThinkingParser
from cbjax.entrypoints.openai.structured import structured_outputs
from cbjax.entrypoints.openai.tool_parsers import ToolParser
from cbjax.lora.request import LoRARequest
from cbjax.outputs import RequestOutput
from cbjax.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_AFTER_S = 1  # what an overloaded server asks clients to wait before retrying
# Names of ignored fields in the log: a body can hold thousands, the log line stays short.
_FIELD_NAMES = short_repr(maxlist=10, maxstring=40)


@dataclasses.dataclass
class ServerState:
    engine: AsyncLLM
    served_model_name: str
    max_model_len: int
    max_waiting_requests: int | None  # None: queue without limit
    max_completions_per_request: int = 128  # prompts x n (--max-completions-per-request)
    max_stop_strings: int = 16  # --max-stop-strings
    reasoning_parser: ThinkingParser | None = None  # --reasoning-parser: chat replies' thinking apart
    tool_parser: ToolParser | None = None  # --enable-auto-tool-choice --tool-call-parser: "auto" tool calls
    # Completions (prompts x n) this server handed the engine that have not finished: the core's
    # stats lag by a step and do not see adds it has not applied yet; this count does.
    num_unfinished: int = 0
    # One thread tokenizes and renders chat templates (as vLLM's tokenizer executor): the event
    # loop keeps streaming while a long prompt is encoded, and prompts are encoded one at a time.
    tokenizer_pool: ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="cbjax-tokenizer"))
    # LoRA adapters by the name a request's `model` gives (lora_adapters.py), and the latest id handed out.
    lora_adapters: dict[str, LoRARequest] = dataclasses.field(default_factory=dict)
    last_lora_int_id: int = 0


def check_model(state: ServerState, model: str | None) -> LoRARequest | None:
    """The LoRA adapter a request's `model` names (None: the base model, as no name is); 404 for a
    name the server does not serve."""
    if model is None or model == state.served_model_name:
        return None
    if model in state.lora_adapters:
        return state.lora_adapters[model]
    served = ", ".join(f"`{name}`" for name in [state.served_model_name, *state.lora_adapters])
    raise APIError(404, f"The model `{model}` does not exist; this server serves {served}", "model")


def response_model(state: ServerState, model: str | None) -> str:
    """The `model` an answer names: the LoRA adapter the request named (as vLLM's), else the served model."""
    return model if model in state.lora_adapters else state.served_model_name


def check_fields(body: RequestModel) -> None:
    """400 for fields cbjax does not implement (not silently ignored); unknown fields are logged and
    ignored, as vLLM does; `stream_options` needs `stream` (vLLM's rule and message)."""
    extra = body.model_extra or {}
    unsupported = [name for name, value in extra.items()
                   if name in body.unsupported_fields and value not in body.unsupported_fields[name]]
    if unsupported:
        raise APIError(400, f"{', '.join(unsupported)}: not supported by this server (cbjax does not implement "
                            f"it, and would otherwise ignore it); drop {'it' if len(unsupported) == 1 else 'them'} "
                            "from the request", unsupported[0])
    ignored = [name for name in extra if name not in body.unsupported_fields]
    if ignored:
        logger.warning("The following fields were present in the request but ignored: %s", _FIELD_NAMES.repr(ignored))
    if isinstance(body, SamplingFields) and body.stream_options is not None and not body.stream:
        raise APIError(400, "Stream options can only be defined when `stream=True`.", "stream_options")


def check_fan_out(state: ServerState, num_prompts: int, body: SamplingFields) -> None:
    """Bound what one request may queue, before anything is tokenized: prompts x n completions,
    and the stop strings every step of each is checked against."""
    limit = state.max_completions_per_request
    if num_prompts * body.n > limit:
        raise APIError(400, f"this request asks for {num_prompts} prompt(s) x n={body.n} = {num_prompts * body.n} "
                            f"completions; the limit is {limit} per request (--max-completions-per-request); send "
                            "fewer prompts or a smaller n per request", "n")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stop) > state.max_stop_strings:
        raise APIError(400, f"stop has {len(stop)} strings; the limit is {state.max_stop_strings} "
                            "(--max-stop-strings); send fewer stop strings", "stop")


async def check_overload(state: ServerState) -> None:
    """503 (+Retry-After) once --max-waiting-requests completions are queued: those the core says
    wait, or, where more, those this server sent that the core neither runs nor finished (its
    stats are a step old and miss adds it has not applied yet)."""
    limit = state.max_waiting_requests
    if limit is None:
        return
    stats = await state.engine.get_stats()
    queued = max(stats["num_waiting"], state.num_unfinished - stats["num_running"])
    if queued >= limit:
        raise APIError(
            503,
            f"the server is overloaded: {queued} completions are already queued (--max-waiting-requests={limit}); "
            f"retry after {RETRY_AFTER_S} s",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


async def off_loop(state: ServerState, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` in the tokenizer thread (tokenizing, rendering a chat template), while the loop serves others."""
    return await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, work, *args)


def check_engine_request(state: ServerState, prompts: list[dict[str, Any]], params: list[SamplingParams],
                         priority: int) -> None:
    """Every check the engine would make on each prompt, now: a bad request gets its 400 before a
    stream's headers go out."""
    for prompt, prompt_params in zip(prompts, params):
        try:
            state.engine.check_request(prompt, prompt_params, priority)
        except ValueError as error:
            raise APIError(400, str(error)) from error


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
    """OpenAI's fields (None = OpenAI's default) as SamplingParams; streams take deltas, others the
    final output. A value SamplingParams refuses is the client's error: 400."""
    try:
        return _sampling_params(request, max_tokens, logprobs)
    except ValueError as error:
        raise APIError(400, str(error)) from error


def _sampling_params(request: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
        structured_outputs=structured_outputs(request),
    )


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids are JSON strings) with each bias clamped to [-100, 100], as vLLM does."""
    if bias is None:
        return None
    keys = [key for key in bias if not key.strip().lstrip("-").isdigit()]
    if keys:
        raise APIError(400, f"logit_bias keys must be token ids (integers, as strings), got {keys[:3]}", "logit_bias")
    return {int(token_id): min(100.0, max(-100.0, value)) for token_id, value in bias.items()}


class UnfinishedCompletions:
    """One request's completions in state.num_unfinished: each leaves it once, when it finishes or
    when the request ends (however it ends: done, failed, aborted, or its stream never started)."""

    def __init__(self, state: ServerState, count: int):
        self.state, self.count = state, count
        state.num_unfinished += count

    def finish(self, count: int = 1) -> None:
        count = min(count, self.count)
        self.count -= count
        self.state.num_unfinished -= count

    def finish_all(self) -> None:
        self.finish(self.count)


async def admit(
    state: ServerState, prompts: list[dict[str, Any]], params: list[SamplingParams], request_id: str, *,
    priority: int, lora_request: LoRARequest | None = None,
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """The overload gate, then the request's outputs (merged_outputs). Its completions count as
    unfinished from here, with no await between the gate and the count, so a burst of requests
    cannot all pass a gate that none of them has counted in yet."""
    await check_overload(state)
    unfinished = UnfinishedCompletions(state, sum(p.n for p in params))
    outputs = merged_outputs(state.engine, prompts, params, request_id, priority, unfinished, lora_request)
    weakref.finalize(outputs, unfinished.finish_all)  # a stream whose client left before it started
    return outputs


async def merged_outputs(
    engine: AsyncLLM, prompts: list[dict[str, Any]], params: list[SamplingParams], request_id: str, priority: int,
    unfinished: UnfinishedCompletions, lora_request: LoRARequest | None = None,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every prompt's request as they come; leaving early aborts them
    all. The engine's ValueError (a request it refused) is the client's 400."""
    finished: set[tuple[int, int]] = set()
    try:
        async for prompt_index, output in _merged_outputs(engine, prompts, params, request_id, priority, lora_request):
            for completion in output.outputs:
                if completion.finish_reason is not None and (prompt_index, completion.index) not in finished:
                    finished.add((prompt_index, completion.index))
                    unfinished.finish()
            yield prompt_index, output
    except ValueError as error:
        raise APIError(400, str(error)) from error
    finally:
        unfinished.finish_all()


async def _merged_outputs(
    engine: AsyncLLM, prompts: list[dict[str, Any]], params: list[SamplingParams], request_id: str, priority: int,
    lora_request: LoRARequest | None,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    if len(prompts) == 1:
        async for output in engine.generate(prompts[0], params[0], request_id, priority=priority, lora_request=lora_request):
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None] | BaseException] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for output in engine.generate(prompts[index], params[index], f"{request_id}-{index}", priority=priority,
                                                lora_request=lora_request):
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


async def sse_stream(chunks: AsyncIterator[BaseModel], outputs: AsyncGenerator) -> AsyncIterator[str]:
    """Server-sent events ending in `data: [DONE]`; an error after the headers went out becomes an
    error event (the status line is already sent). The engine's `outputs` behind the chunks are
    closed however the stream ends (a failing chunk leaves them suspended, its requests running)."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except APIError as error:
        yield f"data: {error_json(error.status, error.message, error.param)}\n\n"
    except EngineDeadError as error:
        yield f"data: {error_json(503, str(error))}\n\n"
    except Exception as error:  # a bug: the client hears 500, the log gets the traceback
        logger.exception("unexpected error while streaming a response")
        yield f"data: {error_json(500, f'internal error: {type(error).__name__}: {error}')}\n\n"
    finally:
        await outputs.aclose()
    yield "data: [DONE]\n\n"


def respond(answer: BaseModel | None) -> Response:
    """The HTTP response for an answer: JSON, or 499 for a client that left (its requests are
    aborted already)."""
    if answer is None:
        return Response(status_code=499)
    return JSONResponse(answer.model_dump())


def stream(chunks: AsyncIterator[BaseModel], outputs: AsyncGenerator) -> StreamingResponse:
    """An event stream of `chunks`, made from the engine's `outputs`: its status and headers go out
    now, before the first token (every check was made before)."""
    return StreamingResponse(sse_stream(chunks, outputs), media_type="text/event-stream")


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
