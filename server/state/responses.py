"""Stored responses (`store: true`, OpenAI's default): each response with the input of its own turn, so that a
later `previous_response_id` renders the whole conversation from the chain of earlier turns."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import delete, insert, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from server.state import tables
from server.state.stored import StoredState, now

MAX_CHAIN = 1_000
"""Turns a `previous_response_id` chain is followed back at most (a guard against a cycle no code makes)."""


def _live(owner: str) -> Any:
    responses = tables.responses
    return (responses.c.owner == owner) & or_(responses.c.expires_at.is_(None), responses.c.expires_at > now())


async def save(stored: StoredState, owner: str, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
    """Store a finished response and its turn's input (the quota checked in the same transaction)."""
    days = stored.settings.store_retention_days
    size = len(json.dumps(response)) + len(json.dumps(input_items))
    async with stored.db().transaction() as connection:
        await stored.check_quota(connection, owner, size)
        await connection.execute(
            insert(tables.responses).values(
                id=response["id"], owner=owner, created_at=response["created_at"],
                expires_at=response["created_at"] + int(days * 86400) if days else None, status=response["status"],
                previous_response_id=response.get("previous_response_id"), conversation_id=None,
                input_items=input_items, response=response, background=False, worker=None, lease_until=None,
                cancel_requested=False, bytes=size,
            )
        )  # fmt: skip


async def get(connection: AsyncConnection, owner: str, response_id: str) -> Any | None:
    """The row (response, input_items, previous_response_id), or None: missing, expired, or another owner's."""
    responses = tables.responses
    query = select(responses.c.response, responses.c.input_items, responses.c.previous_response_id).where(
        responses.c.id == response_id, _live(owner)
    )
    return (await connection.execute(query)).first()


async def conversation(connection: AsyncConnection, owner: str, response_id: str) -> list[dict[str, Any]] | None:
    """Every item of the chain ending at `response_id`, oldest first: each turn's input, then its output; None
    if a response of the chain is missing (expired, deleted, another owner's)."""
    turns: list[list[dict[str, Any]]] = []
    current: str | None = response_id
    while current is not None and len(turns) < MAX_CHAIN:
        row = await get(connection, owner, current)
        if row is None:
            return None
        turns.append([*row.input_items, *row.response["output"]])
        current = row.previous_response_id
    return [item for turn in reversed(turns) for item in turn]


async def remove(connection: AsyncConnection, owner: str, response_id: str) -> bool:
    responses = tables.responses
    result = await connection.execute(delete(responses).where(responses.c.id == response_id, _live(owner)))
    return result.rowcount == 1


async def remove_expired(connection: AsyncConnection) -> int:
    """Delete every response past its retention: how many went."""
    responses = tables.responses
    expired = (responses.c.expires_at.is_not(None)) & (responses.c.expires_at <= now())
    return (await connection.execute(delete(responses).where(expired))).rowcount
