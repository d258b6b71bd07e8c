"""The FastAPI app: routes, middleware and error handlers wired to the handlers; no logic of its own."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from cbjax.engine.exceptions import EngineDeadError
from cbjax.entrypoints.openai.chat import create_chat_completion, rendered_chat
from cbjax.entrypoints.openai.completions import create_completion
from cbjax.entrypoints.openai.errors import ERROR_TYPES, add_error_handlers, error_response
from cbjax.entrypoints.openai.lora_adapters import add_runtime_routes, model_cards
from cbjax.entrypoints.openai.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware
from cbjax.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from cbjax.entrypoints.openai.serving import ServerState, check_fields, check_model, check_prompt_token_ids, off_loop


def cbjax_version() -> str:
    try:
        return version("cbjax")
    except PackageNotFoundError:
        return "unknown"


# A streamed answer (stream=true) is server-sent events of the response's chunks.
EVENT_STREAM = {200: {"content": {"text/event-stream": {}}}}


def build_app(state: ServerState, registry: CollectorRegistry, api_key: str | None, max_request_bytes: int) -> FastAPI:
    # Every route may answer OpenAI's error body; the fuzz test holds responses to this schema.
    app = FastAPI(title="cbjax", version=cbjax_version(),
                  responses={status: {"model": ErrorResponse} for status in ERROR_TYPES})
    add_error_handlers(app)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=EVENT_STREAM)
    async def completions(body: CompletionRequest, raw_request: Request) -> Response:
        return await create_completion(state, body, raw_request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=EVENT_STREAM)
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await create_chat_completion(state, body, raw_request)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=model_cards(state))

    add_runtime_routes(app, state)

    @app.get("/health", response_class=Response, responses={200: {"content": None}})
    async def health() -> Response:
        try:
            state.engine.check_health()
        except EngineDeadError as error:
            return error_response(503, str(error))
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_model(state, body.model)
        check_fields(body)
        if body.messages is not None:
            tokens = (await off_loop(state, rendered_chat, state, body.messages,
                                     body.add_generation_prompt))["prompt_token_ids"]
        else:
            tokens = await off_loop(state, state.engine.tokenizer.encode, body.prompt or "")
        return TokenizeResponse(count=len(tokens), max_model_len=state.max_model_len, tokens=tokens)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(state, body.model)
        check_fields(body)
        check_prompt_token_ids(state, body.tokens, "tokens")
        return DetokenizeResponse(prompt=await off_loop(state, state.engine.tokenizer.decode, body.tokens))

    @app.get("/version")
    async def server_version() -> JSONResponse:
        return JSONResponse({"version": cbjax_version()})

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app
