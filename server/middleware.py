"""What every request passes through before routing: its request id, the API key, then the body size.

Plain ASGI middleware, so they answer before FastAPI parses anything (a wrong key never costs a JSON parse, an
oversized body is never buffered past the limit) and their errors still use OpenAI's error object.
"""

from __future__ import annotations

import hmac
import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.logs import request_id
from server.metrics import ServerMetrics
from server.openai.errors import APIError
from server.state.keys import OWNER_SCOPE_KEY, owner_of

REQUEST_ID_HEADER = b"x-request-id"
MAX_REQUEST_ID_LENGTH = 128
# Visible ASCII only: an id is echoed into a response header and log lines, so no spaces, controls or other text.
_NOT_IN_REQUEST_ID = re.compile(rb"[^\x21-\x7e]")


def client_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The client's X-Request-Id, sanitised (visible ASCII, at most MAX_REQUEST_ID_LENGTH); None if it has none."""
    for name, value in headers:
        if name.lower() == REQUEST_ID_HEADER:
            cleaned = _NOT_IN_REQUEST_ID.sub(b"", value)[:MAX_REQUEST_ID_LENGTH]
            return cleaned.decode("ascii") or None
    return None


class RequestIdMiddleware:
    """Every HTTP response carries `X-Request-Id`: the client's own (sanitised) or a new one, and the request's log
    records carry it too (server/logs.py). The app wraps its whole stack in this one (server/app.py), so even the
    500 of an unhandled error, sent by Starlette's outermost middleware, has the header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = client_request_id(scope["headers"]) or uuid.uuid4().hex
        header = (REQUEST_ID_HEADER, rid.encode("ascii"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        token = request_id.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(token)


GUARDED_PATHS = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/rerank", "/score")
"""Where the API key is required: the API itself (probes, /metrics and the page at / stay open)."""


class APIKeyMiddleware:
    """Require `Authorization: Bearer <key>` with one of the server's keys on the API (GUARDED_PATHS); probes and
    /metrics stay open for orchestrators. The request's owner (server/state/keys.py) goes into its scope."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...], metrics: ServerMetrics) -> None:
        self.app = app
        self._owners = [(key.encode(), owner_of(key)) for key in api_keys]
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED_PATHS):
            scheme, _, provided = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            provided = provided.strip()
            owner = None
            # Constant-time, and every key compared: the time taken must reveal neither how much of a guessed key
            # was right nor which key matched.
            for key, key_owner in self._owners:
                if hmac.compare_digest(provided, key):
                    owner = key_owner
            if scheme.lower() != b"bearer" or owner is None:
                self._metrics.count_rejection("unauthorized")
                error = APIError(401, "Incorrect or missing API key.", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
            scope[OWNER_SCOPE_KEY] = owner
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Refuse request bodies over `max_bytes` with 413, whether or not they declare a Content-Length.

    The body is read here (up to the limit) and replayed to the app, which reads it whole anyway; after the
    replay, `receive` goes back to the server so a handler can still hear the client disconnect. An upload route
    (`uploads`: its own limit by method and path) is not buffered: its body streams through, counted, to a route
    that spools it to disk as it parses it; past the limit the client gets the 413 and the route a disconnect.
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, metrics: ServerMetrics, uploads: dict[tuple[str, str], int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._metrics = metrics
        self._uploads = uploads or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        upload_limit = self._uploads.get((scope["method"], scope["path"]))
        max_bytes = self.max_bytes if upload_limit is None else upload_limit
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await self._reject(scope, receive, send, max_bytes)
            return
        if upload_limit is not None:
            await self._stream(scope, receive, send, upload_limit)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its request
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                await self._reject(scope, receive, send, max_bytes)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _stream(self, scope: Scope, receive: Receive, send: Send, max_bytes: int) -> None:
        size = 0
        rejected = started = False

        async def counted() -> Message:
            nonlocal size, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            size += len(message.get("body", b""))
            if size <= max_bytes:
                return message
            rejected = True
            if not started:
                await self._reject(scope, receive, send, max_bytes)
            return {"type": "http.disconnect"}  # the route stops reading; what it answers is dropped

        async def unless_rejected(message: Message) -> None:
            nonlocal started
            if not rejected:
                started = True
                await send(message)

        await self.app(scope, counted, unless_rejected)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, max_bytes: int) -> None:
        self._metrics.count_rejection("invalid")
        error = APIError(
            413, f"The request body exceeds the server's limit of {max_bytes} bytes.", code="request_too_large"
        )
        await error.response()(scope, receive, send)
