"""Server-sent events as OpenAI streams them: `data: <json>\\n\\n` frames, closed by `data: [DONE]\\n\\n`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_DONE = b"data: [DONE]\n\n"


def sse_data(payload: str) -> bytes:
    return b"data: " + payload.encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    """A stream that notices a client leaving while it waits for the next event, not only when it next writes.

    Starlette listens for `http.disconnect` only below ASGI spec 2.4, and a request still queued in the engine
    writes nothing for a while; listening ourselves frees its engine pages within one step either way.
    `on_close` runs however the response ends (finished, client gone, cancelled).
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        # no-cache and no proxy buffering: each event must reach the client as soon as it is produced.
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as task_group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-write
                        await self.stream_response(send)
                    task_group.cancel_scope.cancel()

                task_group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                task_group.cancel_scope.cancel()
        finally:
            self._on_close()
