"""Request gates in front of every route: the API key (`--api-key`) and the body size limit.

Plain ASGI middleware, not Starlette's BaseHTTPMiddleware, so streamed responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cbjax.entrypoints.openai.errors import error_response


class ApiKeyMiddleware:
    """Every /v1/* route demands `Authorization: Bearer KEY` (vLLM's --api-key); others stay open."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "Unauthorized: send the server's API key as 'Authorization: Bearer KEY'"
                await error_response(401, message)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Refuse request bodies whose Content-Length is over `max_bytes` with 413; a chunked body
    (no Content-Length) is cut off at the limit and refused the same way."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        size = int(declared) if declared is not None and declared.isdigit() else None
        app_receive: Receive | None = receive
        if declared is None and scope["method"] in ("POST", "PUT", "PATCH"):
            app_receive = await self._buffered(receive)
        if app_receive is None or (size is not None and size > self.max_bytes):
            amount = f"{size} bytes" if size is not None else f"more than {self.max_bytes} bytes"
            message = (f"the request body has {amount}; the limit is {self.max_bytes} bytes "
                       "(--max-request-bytes); send a smaller request")
            await error_response(413, message)(scope, receive, send)
            return
        await self.app(scope, app_receive, send)

    async def _buffered(self, receive: Receive) -> Receive | None:
        """Read a chunked body up to the limit; a receive that replays it, or None when it is too long."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return None
            more = message.get("more_body", False)
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay_receive() -> Message:
            return replay.pop() if replay else await receive()

        return replay_receive
