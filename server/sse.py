"""Server-sent events, framed as OpenAI streams them, sent through sse-starlette's EventSourceResponse.

Chat and completions send `data: <json>\\n\\n` frames closed by `data: [DONE]\\n\\n`; the Responses API names each
event (`event: response.output_text.delta\\ndata: <json>\\n\\n`) and ends with its terminal event, no [DONE].
Keep-alive pings are comment frames, `: ping\\n\\n`, which SSE clients skip.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pydantic_core
from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import AppStatus
from starlette.types import Receive, Scope, Send

SSE_DONE = b"data: [DONE]\n\n"

# Ferry's Lifecycle drains streams on SIGTERM itself (they finish, or fail at the drain timeout); left on,
# sse-starlette would cut every open stream as soon as uvicorn is told to exit.
AppStatus.disable_automatic_graceful_drain()


_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
"""Characters JSON may hold raw that Python's `str.splitlines` (and so httpx's `aiter_lines`, which many SSE
clients read streams with) takes for line ends: escaped, a line of JSON stays one line for every client. (JSON
escapes every control character below 0x20 itself.)"""


def _one_line(payload: str) -> bytes:
    return payload.translate(_LINE_BREAKS).encode()


def sse_data(payload: str) -> bytes:
    return b"data: " + _one_line(payload) + b"\n\n"


def sse_event(name: str, payload: str) -> bytes:
    """A named event; `payload` is one line of JSON (pydantic's JSON never holds a raw newline)."""
    return b"event: " + name.encode() + b"\ndata: " + _one_line(payload) + b"\n\n"


def sse_typed_events(events: list[dict[str, Any]]) -> bytes:
    """Responses API events (each a JSON-ready dict with its `type`) as named events, in one chunk."""
    return b"".join(sse_event(event["type"], pydantic_core.to_json(event).decode()) for event in events)


def _ping() -> ServerSentEvent:
    return ServerSentEvent(comment="ping", sep="\n")


class SSEResponse(EventSourceResponse):
    """An event stream of pre-framed bytes that notices a client leaving while it waits for the next event.

    sse-starlette listens for `http.disconnect` throughout, so a request still queued in the engine (which writes
    nothing for a while) frees its engine pages within one step of the client leaving. `on_close` runs however
    the response ends (finished, client gone, cancelled). `ping_interval` 0 sends no pings.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], ping_interval: float) -> None:
        # no-cache rather than sse-starlette's no-store: the OpenAI API's own header; proxies must not buffer.
        super().__init__(
            content,
            headers={"Cache-Control": "no-cache"},
            ping=ping_interval,
            sep="\n",
            ping_message_factory=_ping,
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
