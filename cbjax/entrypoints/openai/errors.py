"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, for every failure the server
answers, and the exception handlers that produce it (no traceback ever reaches a client)."""

from __future__ import annotations

import http
import logging
import reprlib

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from cbjax.engine.exceptions import EngineDeadError
from cbjax.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


def short_repr(**limits: int) -> reprlib.Repr:
    """A reprlib.Repr with these limits (maxstring, maxlist, ...; Python 3.11's constructor takes none)."""
    short = reprlib.Repr()
    for name, value in limits.items():
        setattr(short, name, value)
    return short


MAX_REPORTED_ERRORS = 5  # a body's validation errors named in the message; the rest are counted
# The input an error echoes, cut short: the message stays small however large the body.
_ECHOED_INPUT = short_repr(maxstring=60, maxother=60, maxlist=4, maxdict=4, maxlevel=2)

# The `type` each status gets, as OpenAI's and vLLM's servers name them.
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """A request the server refuses, with the HTTP status and the message the client should read."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    error_type = ERROR_TYPES.get(status, http.HTTPStatus(status).phrase.replace(" ", "") + "Error")
    body = ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def error_json(status: int, message: str, param: str | None = None) -> str:
    """The same body as one JSON string, for errors inside an already started stream."""
    error_type = ERROR_TYPES.get(status, "InternalServerError")
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=status)).model_dump_json()


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """The first MAX_REPORTED_ERRORS problems, each echoing its input cut short, then how many more."""
    problems, param = [], None
    items = error.errors()
    for item in items[:MAX_REPORTED_ERRORS]:
        if item.get("type") == "json_invalid":
            reason = item.get("ctx", {}).get("error", item.get("msg"))
            problems.append(f"the request body is not valid JSON ({reason}); send a JSON object")
            continue
        field = ".".join(str(part) for part in item.get("loc", ()) if part != "body") or "body"
        param = param or field
        problems.append(f"{field}: {item.get('msg')} (got {_ECHOED_INPUT.repr(item.get('input'))})")
    if len(items) > MAX_REPORTED_ERRORS:
        problems.append(f"... and {len(items) - MAX_REPORTED_ERRORS} more")
    return "; ".join(problems) or "invalid request", param


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error.status, error.message, error.param, error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return error_response(400, message, param)

    @app.exception_handler(jinja2.TemplateError)
    async def template_error(_: Request, error: jinja2.TemplateError) -> JSONResponse:
        return error_response(400, f"the chat template refused the messages: {error}", "messages")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return error_response(503, str(error))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {error.detail}"
        return error_response(error.status_code, message, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return error_response(500, f"internal error: {type(error).__name__}: {error}")
