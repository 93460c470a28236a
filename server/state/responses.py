"""Stored responses (`store: true`, OpenAI's default): each response with the input of its own turn, so that a
later `previous_response_id` renders the whole conversation from the chain of earlier turns.

A response is written once it ends (completed, incomplete, failed, or a stream cut off), except a background one:
its row is written when it is created (`queued`, leased by the replica that runs it) and updated when it ends.
Its lease (`worker`, `lease_until`) is renewed while it runs; a row whose lease ran out belonged to a replica that
died, and any replica's sweep records it failed. A cancel from any replica writes `cancelled` (and
`cancel_requested`, which the running replica polls): the runner's own last write only lands on a row still running,
so a cancelled response stays cancelled.
"""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy import ColumnElement, delete, insert, literal, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from server.state import tables
from server.state.stored import LEASE_SECONDS, StoredState, now

MAX_CHAIN = 1_000
"""Turns a `previous_response_id` chain is followed back at most (a guard against a cycle no code makes)."""
RUNNING = ("queued", "in_progress")
"""The statuses of a background response not yet ended."""

_responses = tables.responses
_events = tables.response_events


def _live(owner: str, table: Any = _responses) -> ColumnElement[bool]:
    """The owner's rows not past their retention: an expired row reads as missing before the sweep deletes it."""
    return (table.c.owner == owner) & or_(table.c.expires_at.is_(None), table.c.expires_at > now())


def _size(response: dict[str, Any], input_items: list[dict[str, Any]]) -> int:
    """What the row counts against its owner's quota: its stored JSON."""
    return len(json.dumps(response)) + len(json.dumps(input_items))


async def add(
    connection: AsyncConnection,
    stored: StoredState,
    owner: str,
    response: dict[str, Any],
    input_items: list[dict[str, Any]],
    *,
    worker: str | None = None,
) -> None:
    """Store a response and its turn's input, its owner's quota checked in the same transaction. `worker`: the
    replica running it in the background, leased to it from now."""
    days = stored.settings.store_retention_days
    size = _size(response, input_items)
    await stored.check_quota(connection, owner, size)
    conversation = response.get("conversation")
    await connection.execute(
        insert(_responses).values(
            id=response["id"], owner=owner, created_at=response["created_at"],
            expires_at=response["created_at"] + int(days * 86400) if days else None, status=response["status"],
            previous_response_id=response.get("previous_response_id"),
            conversation_id=conversation["id"] if conversation else None, input_items=input_items,
            response=response, background=bool(response.get("background")), worker=worker,
            lease_until=None if worker is None else time.time() + LEASE_SECONDS, cancel_requested=False, bytes=size,
        )
    )  # fmt: skip


async def get(connection: AsyncConnection, owner: str, response_id: str) -> Any | None:
    """The row (response, input_items, previous_response_id, status, background), or None: missing, expired, or
    another owner's."""
    query = select(
        _responses.c.response, _responses.c.input_items, _responses.c.previous_response_id, _responses.c.status,
        _responses.c.background,
    ).where(_responses.c.id == response_id, _live(owner))  # fmt: skip
    return (await connection.execute(query)).first()


async def conversation(connection: AsyncConnection, owner: str, response_id: str) -> list[dict[str, Any]] | None:
    """Every item of the chain ending at `response_id`, oldest first: each turn's input, then its output; None
    if a response of the chain is missing (expired, deleted, another owner's). One recursive query, however long
    the chain (an agent's hundredth turn is one round trip to the database, not a hundred)."""
    chain = (
        select(_responses.c.id, _responses.c.previous_response_id, literal(0).label("depth"))
        .where(_responses.c.id == response_id, _live(owner))
        .cte("chain", recursive=True)
    )
    earlier = _responses.alias("earlier")
    chain = chain.union_all(
        select(earlier.c.id, earlier.c.previous_response_id, chain.c.depth + 1).where(
            earlier.c.id == chain.c.previous_response_id, _live(owner, earlier), chain.c.depth < MAX_CHAIN - 1
        )
    )
    query = (
        select(_responses.c.input_items, _responses.c.response, chain.c.previous_response_id, chain.c.depth)
        .join(chain, _responses.c.id == chain.c.id)
        .order_by(chain.c.depth.desc())
    )
    rows = (await connection.execute(query)).all()
    if not rows or (rows[0].previous_response_id is not None and rows[0].depth < MAX_CHAIN - 1):
        return None  # the chain breaks before its first turn
    return [item for row in rows for item in (*row.input_items, *row.response["output"])]


async def remove(connection: AsyncConnection, owner: str, response_id: str) -> bool:
    result = await connection.execute(delete(_responses).where(_responses.c.id == response_id, _live(owner)))
    if result.rowcount != 1:
        return False
    await connection.execute(delete(_events).where(_events.c.response_id == response_id))
    return True


async def remove_expired(connection: AsyncConnection) -> int:
    """Delete every response past its retention, with its events: how many went."""
    expired = _responses.c.expires_at.is_not(None) & (_responses.c.expires_at <= now())
    await connection.execute(delete(_events).where(_events.c.response_id.in_(select(_responses.c.id).where(expired))))
    return (await connection.execute(delete(_responses).where(expired))).rowcount


# ---------------------------------------------------------------------------------------------------- events


async def add_events(connection: AsyncConnection, response_id: str, events: list[dict[str, Any]]) -> None:
    """Keep stream events of a background response created with `stream`, for those who stream it again."""
    if events:
        rows = [{"response_id": response_id, "sequence_number": e["sequence_number"], "event": e} for e in events]
        await connection.execute(insert(_events), rows)


async def events_after(connection: AsyncConnection, response_id: str, after: int) -> list[dict[str, Any]]:
    """The response's kept events whose sequence_number is above `after`, in order."""
    query = (
        select(_events.c.event)
        .where(_events.c.response_id == response_id, _events.c.sequence_number > after)
        .order_by(_events.c.sequence_number)
    )
    return list((await connection.execute(query)).scalars())


async def streamed(connection: AsyncConnection, response_id: str) -> bool:
    """Whether the response keeps stream events (a background response created with `stream`)."""
    query = select(_events.c.sequence_number).where(_events.c.response_id == response_id).limit(1)
    return await connection.scalar(query) is not None


# ------------------------------------------------------------------------------------------------ background


async def update_running(
    connection: AsyncConnection,
    response: dict[str, Any],
    events: list[dict[str, Any]] | None = None,
    quota: StoredState | None = None,
) -> bool:
    """Write a background response's new state (`in_progress`, or how it ended), with its stream `events` since
    the last write, if it is still running; False if it is not (cancelled meanwhile, or recorded failed): that
    state stays. An ended response leaves its lease, and from then on counts against its owner's quota what it
    keeps (its output and events); `quota`: refuse (APIError, nothing written) an end that would take the owner
    past it."""
    values: dict[str, Any] = dict(status=response["status"], response=response)
    if response["status"] not in RUNNING:
        # Only an end reads the row (its size and quota); a progress write is the conditional UPDATE alone.
        query = select(_responses.c.input_items, _responses.c.owner, _responses.c.bytes).where(
            _responses.c.id == response["id"], _responses.c.status.in_(RUNNING)
        )
        row = (await connection.execute(query)).first()
        if row is None:
            return False
        kept = await events_after(connection, response["id"], -1)
        size = _size(response, row.input_items) + sum(len(json.dumps(event)) for event in [*kept, *(events or ())])
        if quota is not None:
            await quota.check_quota(connection, row.owner, size - row.bytes)
        values.update(worker=None, lease_until=None, bytes=size)
    written = update(_responses).where(_responses.c.id == response["id"], _responses.c.status.in_(RUNNING))
    if (await connection.execute(written.values(**values))).rowcount != 1:
        return False
    await add_events(connection, response["id"], events or [])
    return True


async def cancel(connection: AsyncConnection, owner: str, response_id: str) -> dict[str, Any] | None:
    """Record a running background response cancelled (and ask its replica to stop it); the response as it now
    stands, or None if it is not running (the caller reads why)."""
    row = await get(connection, owner, response_id)
    if row is None or not row.background or row.status not in RUNNING:
        return None
    response = {**row.response, "status": "cancelled"}
    query = update(_responses).where(_responses.c.id == response_id, _responses.c.status.in_(RUNNING))
    values = dict(status="cancelled", response=response, cancel_requested=True, worker=None, lease_until=None)
    if (await connection.execute(query.values(**values))).rowcount != 1:
        return None  # it ended in the meantime
    return response


async def running(connection: AsyncConnection, response_ids: list[str]) -> set[str]:
    """Which of these background responses are still running: the others were cancelled or deleted (from whichever
    replica), or recorded failed, and their generation stops."""
    query = select(_responses.c.id).where(
        _responses.c.id.in_(response_ids), _responses.c.status.in_(RUNNING), ~_responses.c.cancel_requested
    )
    return set((await connection.execute(query)).scalars())


async def renew(connection: AsyncConnection, worker: str, response_ids: list[str]) -> None:
    """Extend `worker`'s lease on the background responses it is running."""
    query = update(_responses).where(
        _responses.c.id.in_(response_ids), _responses.c.worker == worker, _responses.c.status.in_(RUNNING)
    )
    await connection.execute(query.values(lease_until=time.time() + LEASE_SECONDS))


async def fail_running(connection: AsyncConnection, message: str, worker: str | None = None) -> list[str]:
    """Record failed, saying `message`, the background responses still running that `worker` holds (it is
    stopping), or, with no `worker`, those whose lease ran out (their replica died); their ids."""
    held = _responses.c.worker == worker if worker is not None else _responses.c.lease_until < time.time()
    query = select(_responses.c.id, _responses.c.response).where(_responses.c.status.in_(RUNNING), held)
    failed = []
    for row in await connection.execute(query):
        response = {**row.response, "status": "failed", "error": {"code": "server_error", "message": message}}
        if await update_running(connection, response):
            failed.append(row.id)
    return failed
