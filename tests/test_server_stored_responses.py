"""Stored responses end to end: the official OpenAI SDK against a real `ferry serve` of the scripted chat model
(tests/scripted_chat.py), its state in SQLite and in a real PostgreSQL server: store, retrieve, the input items
paged, `previous_response_id` chains (a tool call and its result included) rendered as the whole conversation
sent at once would be, delete, retention, quota, and two keys that never see each other's responses."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.postgres_server import PostgresServer
from tests.scripted_chat import AFTER_TOOL_ANSWER, CALL, CALL_NAME, PLAIN, TOOL_RESULT
from tests.server_harness import ServerProcess, server_process

MODEL = "scripted"
KEY_A, KEY_B = "key-a", "key-b"
WEATHER = {
    "type": "function",
    "name": CALL_NAME,
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(f"{KEY_A}\n{KEY_B}\n")
    return path


def _serve(model: Path, keys: Path, *extra: str) -> Any:
    return server_process(
        model, "--served-model-name", MODEL, "--api-keys-file", str(keys), "--num-pages", "256",
        "--log-level", "warning", *extra,
    )  # fmt: skip


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest, scripted_chat_model: Path, keys: Path) -> Iterator[ServerProcess]:
    extra: tuple[str, ...] = ()
    if request.param == "postgresql":
        postgres: PostgresServer = request.getfixturevalue("postgres")
        extra = ("--database-url", postgres.new_database())
    with _serve(scripted_chat_model, keys, *extra) as running:
        yield running


def _client(server: ServerProcess, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def test_a_stored_response_is_retrieved_listed_and_deleted(server: ServerProcess) -> None:
    client = _client(server)
    created = client.responses.create(model=MODEL, input=PLAIN, temperature=0, metadata={"k": "v"})
    assert created.store is True and created.status == "completed"
    retrieved = client.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()
    (item,) = client.responses.input_items.list(created.id).data
    assert item.type == "message" and item.role == "user" and item.id.startswith("msg_")
    assert client.responses.delete(created.id) is None  # the SDK returns nothing on success
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)


def test_store_false_keeps_nothing(server: ServerProcess) -> None:
    client = _client(server)
    created = client.responses.create(model=MODEL, input=PLAIN, temperature=0, store=False)
    assert created.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_input_items_are_paged(server: ServerProcess) -> None:
    client = _client(server)
    turn = [{"role": "user", "content": f"part {i}"} for i in range(5)] + [{"role": "user", "content": PLAIN}]
    created = client.responses.create(model=MODEL, input=turn, temperature=0)
    first = client.responses.input_items.list(created.id, limit=4)
    assert [item.content[0].text for item in first.data] == [PLAIN, "part 4", "part 3", "part 2"]
    assert first.has_more and first.last_id == first.data[-1].id
    rest = client.responses.input_items.list(created.id, limit=4, after=first.last_id)
    assert [item.content[0].text for item in rest.data] == ["part 1", "part 0"] and not rest.has_more
    ascending = client.responses.input_items.list(created.id, order="asc", limit=2)
    assert [item.content[0].text for item in ascending.data] == ["part 0", "part 1"]


def test_a_chain_renders_as_the_whole_conversation_sent_at_once(server: ServerProcess) -> None:
    client = _client(server)
    first = client.responses.create(model=MODEL, input="Hello there.", temperature=0, instructions="Be brief.")
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id, temperature=0)
    third = client.responses.create(model=MODEL, input=PLAIN, previous_response_id=second.id, temperature=0)
    assert third.previous_response_id == second.id
    # The same three turns sent whole: earlier instructions are not carried over (OpenAI's rule).
    whole = [{"role": "user", "content": "Hello there."}, *[o.model_dump() for o in first.output],
             {"role": "user", "content": "And then?"}, *[o.model_dump() for o in second.output],
             {"role": "user", "content": PLAIN}]  # fmt: skip
    sent_whole = client.responses.create(model=MODEL, input=whole, temperature=0, store=False)
    assert third.usage.input_tokens == sent_whole.usage.input_tokens > second.usage.input_tokens
    assert third.output_text == sent_whole.output_text
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model=MODEL, input=PLAIN, previous_response_id="resp_" + "0" * 48)


def test_a_tool_call_and_its_result_over_a_chain(server: ServerProcess) -> None:
    client = _client(server)
    asked = client.responses.create(model=MODEL, input=f"Weather in Paris? {CALL}", tools=[WEATHER], temperature=0)
    (call,) = asked.output
    assert call.type == "function_call"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": f"Sunny. {TOOL_RESULT}"}
    answered = client.responses.create(
        model=MODEL, input=[result], previous_response_id=asked.id, tools=[WEATHER], temperature=0
    )
    assert answered.output_text == AFTER_TOOL_ANSWER


def test_a_streamed_response_is_stored(server: ServerProcess) -> None:
    client = _client(server)
    events = list(client.responses.create(model=MODEL, input=PLAIN, temperature=0, stream=True))
    completed = events[-1].response
    assert client.responses.retrieve(completed.id).output_text == completed.output_text


def test_two_keys_never_see_each_others_responses(server: ServerProcess) -> None:
    mine = _client(server, KEY_A).responses.create(model=MODEL, input=PLAIN, temperature=0)
    other = _client(server, KEY_B)
    for attempt in (lambda: other.responses.retrieve(mine.id), lambda: other.responses.delete(mine.id),
                    lambda: other.responses.input_items.list(mine.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            attempt()
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=MODEL, input=PLAIN, previous_response_id=mine.id)
    assert _client(server, KEY_A).responses.retrieve(mine.id).id == mine.id


def test_retention_and_quota(scripted_chat_model: Path, keys: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    # 0.00003 days: about 2.6 seconds; a quota that holds two or three small responses.
    with _serve(scripted_chat_model, keys, "--state-dir", str(state), "--store-retention-days", "0.00003",
                "--max-stored-bytes-per-key", "6000") as running:  # fmt: skip
        client = _client(running)
        kept = client.responses.create(model=MODEL, input=PLAIN, temperature=0)
        assert client.responses.retrieve(kept.id).id == kept.id
        with pytest.raises(openai.RateLimitError, match="quota"):
            for _ in range(10):
                client.responses.create(model=MODEL, input=PLAIN, temperature=0)
        assert _client(running, KEY_B).responses.create(model=MODEL, input=PLAIN, temperature=0).store
        time.sleep(3.5)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(kept.id)
