"""Issue 5's acceptance through the real server: `ferry serve` with no --model answers in words and stops."""

from __future__ import annotations

import httpx

from tests.server_harness import server_process
from tests.test_demo_model import MAX_NEW_TOKENS, MIN_STOPPED, PROMPTS


def _mostly_words(text: str) -> bool:
    letters_and_spaces = sum(ch.isascii() and (ch.isalpha() or ch == " ") for ch in text)
    return len(text) > 0 and letters_and_spaces / len(text) >= 0.8


def test_default_model_answers_in_words_and_stops() -> None:
    with server_process(None) as server, httpx.Client(base_url=server.base_url, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        stopped = 0
        for prompt in PROMPTS:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": MAX_NEW_TOKENS,
                "temperature": 0,
            }
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            text = choice["message"]["content"]
            text.encode("utf-8")
            assert _mostly_words(text), text
            stopped += choice["finish_reason"] == "stop"
        assert stopped >= MIN_STOPPED
