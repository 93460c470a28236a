"""SSE frames (server/sse.py): one line of JSON a frame for every client, including those that split lines as
Python's `str.splitlines` does (httpx's `aiter_lines`: U+0085, U+2028 and U+2029 end a line there)."""

from __future__ import annotations

import asyncio
import json

import httpx
from hypothesis import given
from hypothesis import strategies as st

from server.sse import sse_data, sse_event


@given(st.text())
def test_a_frame_is_one_line_of_json_that_reads_back(text: str) -> None:
    payload = json.dumps({"text": text}, ensure_ascii=False)
    for frame, expected_lines in ((sse_data(payload), 2), (sse_event("response.output_text.delta", payload), 3)):
        lines = frame.decode().splitlines()
        assert len(lines) == expected_lines and lines[-1] == ""
        data = lines[-2]
        assert json.loads(data.removeprefix("data: ")) == {"text": text}


def test_httpx_reads_a_stream_of_line_separators_frame_by_frame() -> None:
    texts = ["a\u2028b", "\x85", "c\u2029"]
    body = b"".join(sse_data(json.dumps({"text": t}, ensure_ascii=False)) for t in texts)

    async def lines() -> list[str]:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
        async with httpx.AsyncClient(transport=transport) as client, client.stream("GET", "http://x/") as response:
            return [line async for line in response.aiter_lines() if line]

    received = asyncio.run(lines())
    assert [json.loads(line.removeprefix("data: "))["text"] for line in received] == texts
