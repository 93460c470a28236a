"""Stored state end to end: the official OpenAI SDK against a real `ferry serve` of the scripted chat model
(tests/scripted_chat.py), its state in SQLite and in a real PostgreSQL server: stored responses (retrieve, the input
items paged, `previous_response_id` chains, a tool call and its result included, rendered as the whole conversation
sent at once would be, delete, a stream cut short), background responses (polled, cancelled here and from another
replica, failed when their server stops or their replica dies, their streams picked up again here or on another
replica), the Conversations API and responses in a
conversation, retention, quota, and two keys that never see each other's state.

The module's servers run one sequence at a time (--max-num-seqs 1): long background responses queue behind each
other, so that one is still waiting when a test cancels it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select

from server.openai.stored_responses import ABANDONED_MESSAGE
from server.state import responses, tables
from server.state.database import Database, database_url
from server.state.keys import owner_of
from tests.postgres_server import PostgresServer
from tests.scripted_chat import AFTER_TOOL_ANSWER, CALL, CALL_NAME, PLAIN, TOOL_RESULT
from tests.server_harness import ServerProcess, engine_idle, metric, metric_samples, server_process, wait_until

MODEL = "scripted"
KEY_A, KEY_B, KEY_C = "key-a", "key-b", "key-c"
WEATHER = {
    "type": "function",
    "name": CALL_NAME,
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
LONG_TOKENS = 480
LONG: dict[str, Any] = {"model": MODEL, "input": PLAIN, "temperature": 0, "max_output_tokens": LONG_TOKENS,
                        "extra_body": {"min_tokens": LONG_TOKENS}}  # fmt: skip
"""A response of exactly LONG_TOKENS tokens (EOS is held off until then): most of a second of the engine's time."""


@dataclass
class Served:
    process: ServerProcess
    database: str
    """The SQLAlchemy URL of its state database, for the tests to look into."""
    database_flags: tuple[str, ...]
    """The flags that point a server at that database (another replica's)."""


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(f"{KEY_A}\n{KEY_B}\n{KEY_C}\n")
    return path


def _serve(model: Path, keys: Path, *extra: str) -> Any:
    return server_process(
        model, "--served-model-name", MODEL, "--api-keys-file", str(keys), "--num-pages", "256",
        "--log-level", "warning", *extra,
    )  # fmt: skip


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def served(
    request: pytest.FixtureRequest, scripted_chat_model: Path, keys: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    if request.param == "postgresql":
        postgres: PostgresServer = request.getfixturevalue("postgres")
        url = postgres.new_database()
        extra, database = ("--database-url", url), database_url(url, None)
    else:
        state = tmp_path_factory.mktemp("state")
        extra, database = ("--state-dir", str(state)), database_url(None, str(state))
    with _serve(scripted_chat_model, keys, "--max-num-seqs", "1", *extra) as running:
        yield Served(running, database, extra)


@pytest.fixture(scope="module")
def server(served: Served) -> ServerProcess:
    return served.process


def _client(server: ServerProcess, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def _in_database(database: str, work: Callable[[Any], Any]) -> Any:
    """What `work(connection)` (a coroutine function) returns, run in one transaction of the server's database."""

    async def run() -> Any:
        db = await Database.open(database)
        try:
            async with db.transaction() as connection:
                return await work(connection)
        finally:
            await db.close()

    return asyncio.run(run())


def _row(database: str, response_id: str) -> Any:
    query = select(tables.responses).where(tables.responses.c.id == response_id)
    return _in_database(database, lambda connection: _first(connection, query))


async def _first(connection: Any, query: Any) -> Any:
    return (await connection.execute(query)).first()


def _until_ended(client: openai.OpenAI, response_id: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{response_id} still {response.status}"
        time.sleep(0.05)
    return response


def test_a_stored_response_is_retrieved_listed_and_deleted(served: Served) -> None:
    client = _client(served.process)
    created = client.responses.create(model=MODEL, input=PLAIN, temperature=0, metadata={"k": "v"})
    assert created.store is True and created.status == "completed"
    retrieved = client.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()
    (item,) = client.responses.input_items.list(created.id).data
    assert item.type == "message" and item.role == "user" and item.id.startswith("msg_")
    assert item.status == "completed" and item.content[0].text == PLAIN
    row = _row(served.database, created.id)
    assert row.owner == owner_of(KEY_A) and row.response["output"][0]["content"][0]["text"] == created.output_text
    assert client.responses.delete(created.id) is None  # the SDK returns nothing on success
    assert _row(served.database, created.id) is None, "deleting deletes the row"
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


def test_a_stream_cut_short_is_stored_as_far_as_it_got(server: ServerProcess) -> None:
    client = _client(server)
    with client.responses.create(**LONG, stream=True) as stream:
        created = next(iter(stream)).response
    deadline = time.monotonic() + 30
    while True:  # stored by a task of its own once the server notices the client left
        try:
            cut = client.responses.retrieve(created.id)
            break
        except openai.NotFoundError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert cut.status == "incomplete" and cut.incomplete_details is None and cut.usage is None
    assert all(item.status == "incomplete" for item in cut.output)


# ------------------------------------------------------------------------------------------------ background


def test_a_background_response_is_polled_until_it_ends(server: ServerProcess) -> None:
    client = _client(server)
    queued = client.responses.create(model=MODEL, input=PLAIN, temperature=0, background=True)
    assert queued.status == "queued" and queued.background and queued.output == []
    done = _until_ended(client, queued.id)
    direct = client.responses.create(model=MODEL, input=PLAIN, temperature=0, store=False)
    assert done.status == "completed" and done.background and done.output_text == direct.output_text
    assert done.usage is not None and done.usage.output_tokens == direct.usage.output_tokens
    (item,) = client.responses.input_items.list(queued.id).data
    assert item.content[0].text == PLAIN


def test_background_responses_are_cancelled_here_and_from_another_replica(served: Served) -> None:
    client = _client(served.process)
    http = httpx.Client(base_url=served.process.base_url)
    tokens_before = metric(metric_samples(http), "ferry:generation_tokens_total")
    blockers = [client.responses.create(**LONG, background=True) for _ in range(3)]
    here, there = (client.responses.create(**LONG, background=True) for _ in range(2))
    cancelled = client.responses.cancel(here.id)
    assert cancelled.status == "cancelled" and cancelled.id == here.id
    # Another replica's cancel is a write to the shared database; the replica running the response notices it.
    elsewhere = _in_database(
        served.database, lambda connection: responses.cancel(connection, owner_of(KEY_A), there.id)
    )
    assert elsewhere["status"] == "cancelled"
    for blocker in blockers:
        assert _until_ended(client, blocker.id).status == "incomplete"  # its LONG_TOKENS tokens: the token limit
    wait_until(lambda: engine_idle(http), timeout=30)
    generated = metric(metric_samples(http), "ferry:generation_tokens_total") - tokens_before
    assert generated < (len(blockers) + 1) * LONG_TOKENS, "the response cancelled elsewhere stopped generating"
    assert generated >= len(blockers) * LONG_TOKENS
    for response in (here, there):
        assert client.responses.retrieve(response.id).status == "cancelled"
        assert not _row(served.database, response.id).worker, "its lease is released"
    assert client.responses.cancel(here.id).status == "cancelled", "cancelling again answers the same"
    with pytest.raises(openai.BadRequestError, match="incomplete"):
        client.responses.cancel(blockers[0].id)
    synchronous = client.responses.create(model=MODEL, input=PLAIN, temperature=0)
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        client.responses.cancel(synchronous.id)
    with pytest.raises(openai.NotFoundError):
        _client(served.process, KEY_B).responses.cancel(blockers[1].id)


def _text_of(events: list[Any]) -> str:
    return "".join(event.delta for event in events if event.type == "response.output_text.delta")


def test_a_background_stream_goes_on_without_its_client_and_is_picked_up_again(
    served: Served, scripted_chat_model: Path, keys: Path
) -> None:
    """The stream of a background response created with `stream`: its client leaves mid-way, the response runs
    on, and GET ?stream=true&starting_after=N picks the stream up where it left, here while it runs, from
    another replica (reading the shared database) while it runs, and again once it ended."""
    client = _client(served.process)
    with _serve(scripted_chat_model, keys, *served.database_flags) as other:
        stream = client.responses.create(**LONG, background=True, stream=True)
        first = []
        for event in stream:
            first.append(event)
            if event.type == "response.output_text.delta":
                break
        stream.close()  # the client leaves; the response runs on
        response_id, left_at = first[0].response.id, first[-1].sequence_number
        there = _client(other).responses.retrieve(response_id, stream=True, starting_after=left_at + 1)
        elsewhere = list(there)
    assert [event.type for event in first[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert [event.sequence_number for event in first] == list(range(left_at + 1))
    assert first[0].response.background and first[0].response.status == "queued"
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=left_at))
    assert [event.sequence_number for event in rest] == list(range(left_at + 1, left_at + 1 + len(rest)))
    assert len(rest) > 2 and [event.model_dump() for event in elsewhere] == [event.model_dump() for event in rest[1:]]
    assert rest[-1].type == "response.incomplete"  # its LONG_TOKENS tokens: the token limit
    done = client.responses.retrieve(response_id)
    assert done.status == "incomplete" and _text_of(first + rest) == done.output_text
    assert rest[-1].response.output_text == done.output_text
    replay = list(client.responses.retrieve(response_id, stream=True))
    assert [event.model_dump() for event in replay] == [event.model_dump() for event in first + rest]
    polled = client.responses.create(model=MODEL, input=PLAIN, temperature=0, background=True)
    _until_ended(client, polled.id)
    with pytest.raises(openai.BadRequestError, match="created with 'stream'"):
        list(client.responses.retrieve(polled.id, stream=True))
    with pytest.raises(openai.NotFoundError):
        list(_client(served.process, KEY_B).responses.retrieve(response_id, stream=True))


def test_a_cancelled_background_stream_ends(server: ServerProcess) -> None:
    client = _client(server)
    blocker = client.responses.create(**LONG, background=True)
    stream = client.responses.create(**LONG, background=True, stream=True)
    created = next(iter(stream))
    assert client.responses.cancel(created.response.id).status == "cancelled"
    assert [event.type for event in stream] == ["response.queued"]  # it never ran; its stream ends, no hang
    assert list(client.responses.retrieve(created.response.id, stream=True, starting_after=1)) == []
    _until_ended(client, blocker.id)


def test_a_replica_that_died_leaves_its_background_responses_failed(served: Served) -> None:
    client = _client(served.process)
    done = client.responses.create(model=MODEL, input=PLAIN, temperature=0, background=True)
    _until_ended(client, done.id)
    orphan = f"resp_{time.time_ns()}"

    async def orphaned(connection: Any) -> list[str]:
        """A background response of a replica that died: running, its lease run out; then any replica's sweep."""
        row = (await connection.execute(select(tables.responses).where(tables.responses.c.id == done.id))).first()
        response = {**row.response, "id": orphan, "status": "in_progress", "output": []}
        await connection.execute(
            tables.responses.insert().values({**row._mapping, "id": orphan, "status": "in_progress",
                                              "response": response, "worker": "replica_gone", "lease_until": 0.0})
        )  # fmt: skip
        return await responses.fail_running(connection, ABANDONED_MESSAGE)

    assert _in_database(served.database, orphaned) == [orphan]
    failed = client.responses.retrieve(orphan)
    assert failed.status == "failed" and failed.error is not None and "lease ran out" in failed.error.message
    # Had it been streamed, its stream would end saying it failed (its own events never got that far).
    created = {"type": "response.created", "sequence_number": 0, "response": failed.model_dump(mode="json")}
    _in_database(served.database, lambda connection: responses.add_events(connection, orphan, [created]))
    events = list(client.responses.retrieve(orphan, stream=True))
    assert [event.type for event in events] == ["response.created", "response.failed"]
    assert events[-1].response.error is not None and "lease ran out" in events[-1].response.error.message


# ------------------------------------------------------------------------------------------------ conversations


def _texts(items: list[Any]) -> list[str]:
    return [item.content[0].text for item in items]


def test_the_conversations_api(served: Served) -> None:
    client = _client(served.process)
    first = [{"role": "user", "content": f"item {i}"} for i in range(3)]
    conversation = client.conversations.create(items=first, metadata={"topic": "ferries"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "ferries"}
    added = client.conversations.items.create(
        conversation.id, items=[{"role": "user", "content": "item 3"}, {"role": "assistant", "content": "item 4"}]
    )
    assert _texts(added.data) == ["item 3", "item 4"] and added.data[1].content[0].type == "output_text"
    page = client.conversations.items.list(conversation.id, limit=2)
    assert _texts(page.data) == ["item 4", "item 3"] and page.has_more and page.last_id == page.data[-1].id
    rest = client.conversations.items.list(conversation.id, limit=10, after=page.last_id, include=["x.y"])
    assert _texts(rest.data) == ["item 2", "item 1", "item 0"] and not rest.has_more
    ascending = client.conversations.items.list(conversation.id, order="asc", limit=4)
    assert _texts(ascending.data) == [f"item {i}" for i in range(4)] and ascending.has_more
    item_1 = ascending.data[1]
    assert item_1.id.startswith("msg_") and item_1.status == "completed"
    assert client.conversations.items.retrieve(item_1.id, conversation_id=conversation.id).model_dump() == (
        item_1.model_dump()
    )
    assert client.conversations.items.delete(item_1.id, conversation_id=conversation.id).id == conversation.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(item_1.id, conversation_id=conversation.id)
    left = client.conversations.items.list(conversation.id, order="asc")
    assert _texts(left.data) == ["item 0", "item 2", "item 3", "item 4"]
    updated = client.conversations.update(conversation.id, metadata={"topic": "boats", "k": "v"})
    assert updated.metadata == {"topic": "boats", "k": "v"}
    assert client.conversations.retrieve(conversation.id).metadata == {"topic": "boats", "k": "v"}
    deleted = client.conversations.delete(conversation.id)
    assert deleted.deleted and deleted.object == "conversation.deleted" and deleted.id == conversation.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.list(conversation.id)
    items = tables.conversation_items
    query = select(items.c.id).where(items.c.conversation_id == conversation.id)
    assert _in_database(served.database, lambda connection: _first(connection, query)) is None, "items went with it"


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (lambda c: c.conversations.create(items=[{"role": "user", "content": "x"}] * 21), "items"),
        (lambda c: c.conversations.create(metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
        (lambda c: c.conversations.create(metadata={"k" * 65: "v"}), "metadata." + "k" * 65),
        (lambda c: c.conversations.create(metadata={"k": "v" * 513}), "metadata.k"),
        (lambda c: c.conversations.create(items=[{"type": "item_reference", "id": "msg_1"}]), "items[0].type"),
        (lambda c: c.conversations.create(items=[{"role": "user", "content": [{"type": "input_image",
                                                                               "image_url": "x"}]}]),
         "items[0].content[0].type"),
    ],
)  # fmt: skip
def test_conversation_limits_are_refused_by_name(
    server: ServerProcess, call: Callable[[openai.OpenAI], Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        call(_client(server))
    assert info.value.param == param


def test_responses_in_a_conversation(server: ServerProcess) -> None:
    client = _client(server)
    conversation = client.conversations.create(items=[{"role": "developer", "content": "Be brief."}])
    first = client.responses.create(model=MODEL, input="Hello there.", conversation=conversation.id, temperature=0)
    second = client.responses.create(model=MODEL, input=PLAIN, conversation={"id": conversation.id}, temperature=0)
    assert second.conversation is not None and second.conversation.id == conversation.id
    items = client.conversations.items.list(conversation.id, order="asc").data
    turns = [("message", "developer"), ("message", "user"), *[(o.type, "assistant") for o in first.output],
             ("message", "user"), *[(o.type, "assistant") for o in second.output]]  # fmt: skip
    assert [(item.type, item.role) for item in items] == turns
    assert [item.id for item in items[2 : 2 + len(first.output)]] == [o.id for o in first.output]
    whole = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hello there."},
             *[o.model_dump() for o in first.output], {"role": "user", "content": PLAIN}]  # fmt: skip
    sent_whole = client.responses.create(model=MODEL, input=whole, temperature=0, store=False)
    assert second.usage.input_tokens == sent_whole.usage.input_tokens > first.usage.input_tokens
    assert second.output_text == sent_whole.output_text
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL, input=PLAIN, conversation=conversation.id,
                                previous_response_id=first.id)  # fmt: skip
    background = client.responses.create(model=MODEL, input=PLAIN, conversation=conversation.id, background=True)
    _until_ended(client, background.id)
    assert len(client.conversations.items.list(conversation.id, limit=100).data) == len(items) + 2


def test_two_keys_never_see_each_others_conversations(server: ServerProcess) -> None:
    mine = _client(server, KEY_A).conversations.create(items=[{"role": "user", "content": "mine"}])
    item_id = _client(server, KEY_A).conversations.items.list(mine.id).data[0].id
    other = _client(server, KEY_B)
    for attempt in (
        lambda: other.conversations.retrieve(mine.id),
        lambda: other.conversations.update(mine.id, metadata={"k": "v"}),
        lambda: other.conversations.delete(mine.id),
        lambda: other.conversations.items.list(mine.id),
        lambda: other.conversations.items.create(mine.id, items=[{"role": "user", "content": "theirs"}]),
        lambda: other.conversations.items.retrieve(item_id, conversation_id=mine.id),
        lambda: other.conversations.items.delete(item_id, conversation_id=mine.id),
        lambda: other.responses.create(model=MODEL, input=PLAIN, conversation=mine.id),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert _texts(_client(server, KEY_A).conversations.items.list(mine.id).data) == ["mine"]


# ------------------------------------------------------------------------------------------------ restarts


def test_quota_a_stop_mid_response_and_retention(scripted_chat_model: Path, keys: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    database = database_url(None, str(state))
    # A quota that holds two or three small responses; no drain, so that SIGTERM stops what runs at once.
    with _serve(scripted_chat_model, keys, "--state-dir", str(state), "--max-stored-bytes-per-key", "6000",
                "--drain-timeout", "0", "--max-num-seqs", "1") as first:  # fmt: skip
        client = _client(first)
        kept = client.responses.create(model=MODEL, input=PLAIN, temperature=0)
        with pytest.raises(openai.RateLimitError, match="quota"):
            for _ in range(10):
                client.responses.create(model=MODEL, input=PLAIN, temperature=0)
        with pytest.raises(openai.RateLimitError, match="quota"):
            client.conversations.create(items=[{"role": "user", "content": "x" * 6000}])
        # A background response is checked again when it ends: what it keeps then (its output, and the stream's
        # events, each snapshot of the response echoing its instructions) would not fit.
        third = _client(first, KEY_C)
        events = list(third.responses.create(model=MODEL, input=PLAIN, instructions="Answer. " * 40,
                                             max_output_tokens=100, background=True, stream=True))  # fmt: skip
        over = third.responses.retrieve(events[0].response.id)
        assert events[-1].type == "response.failed" and events[-2].type == "error"
        assert over.status == "failed" and over.output == []
        assert over.error is not None and "quota" in over.error.message
        running = [_client(first, KEY_B).responses.create(**LONG, background=True) for _ in range(2)]
    with _serve(scripted_chat_model, keys, "--state-dir", str(state), "--store-retention-days", "0.00003") as second:
        client = _client(second, KEY_B)
        for response in running:
            failed = client.responses.retrieve(response.id)
            assert failed.status == "failed" and failed.error is not None and "shut down" in failed.error.message
        assert _client(second).responses.retrieve(kept.id).output_text == kept.output_text
        # 0.00003 days: about 2.6 seconds; the sweep runs as often as that.
        brief = client.responses.create(model=MODEL, input=PLAIN, temperature=0)
        assert client.responses.retrieve(brief.id).id == brief.id
        time.sleep(3)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(brief.id)
        wait_until(lambda: _row(database, brief.id) is None, timeout=10)
        assert _row(database, kept.id) is not None, "kept for the retention it was stored with"
