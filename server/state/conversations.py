"""Stored conversations (`/v1/conversations`): a conversation's metadata, and its items in the order they were
added (`seq`), each row its owner's. A response created with `conversation` renders the items before its input and
appends its input and output items after it. Items go with their conversation (a cascading foreign key)."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from server.state import tables
from server.state.stored import StoredState, new_id, now

_conversations = tables.conversations
_items = tables.conversation_items


def _object(conversation_id: str, created_at: int, metadata: dict[str, str]) -> dict[str, Any]:
    return {"id": conversation_id, "object": "conversation", "created_at": created_at, "metadata": metadata}


async def create(
    connection: AsyncConnection, stored: StoredState, owner: str, metadata: dict[str, str], items: list[dict[str, Any]]
) -> dict[str, Any]:
    """A new conversation holding `items` (each with its id already)."""
    values = dict(id=new_id("conv"), owner=owner, created_at=now(), metadata=metadata)
    await connection.execute(insert(_conversations).values(**values))
    await append(connection, stored, owner, values["id"], items)
    return _object(values["id"], values["created_at"], metadata)


async def get(connection: AsyncConnection, owner: str, conversation_id: str) -> dict[str, Any] | None:
    """The conversation object, or None (missing, or another owner's: the same answer)."""
    query = select(_conversations).where(_conversations.c.id == conversation_id, _conversations.c.owner == owner)
    row = (await connection.execute(query)).first()
    return None if row is None else _object(row.id, row.created_at, row.metadata)


async def set_metadata(
    connection: AsyncConnection, owner: str, conversation_id: str, metadata: dict[str, str]
) -> dict[str, Any] | None:
    query = update(_conversations).where(_conversations.c.id == conversation_id, _conversations.c.owner == owner)
    if (await connection.execute(query.values(metadata=metadata))).rowcount != 1:
        return None
    return await get(connection, owner, conversation_id)


async def remove(connection: AsyncConnection, owner: str, conversation_id: str) -> bool:
    query = delete(_conversations).where(_conversations.c.id == conversation_id, _conversations.c.owner == owner)
    return (await connection.execute(query)).rowcount == 1


async def append(
    connection: AsyncConnection, stored: StoredState, owner: str, conversation_id: str, items: list[dict[str, Any]]
) -> None:
    """Add `items` (each with its id) after the conversation's last, its owner's quota checked first (the caller
    has checked that the conversation is the owner's)."""
    sizes = [len(json.dumps(item)) for item in items]
    await stored.check_quota(connection, owner, sum(sizes))
    created = now()
    for item, size in zip(items, sizes, strict=True):
        await connection.execute(
            insert(_items).values(
                id=item["id"], conversation_id=conversation_id, owner=owner, created_at=created, item=item, bytes=size
            )
        )


async def items(connection: AsyncConnection, owner: str, conversation_id: str) -> list[dict[str, Any]]:
    """Every item of the conversation, oldest first: what a response in it renders before its own input."""
    query = select(_items.c.item).where(_items.c.conversation_id == conversation_id, _items.c.owner == owner)
    return list((await connection.execute(query.order_by(_items.c.seq))).scalars())


async def listed(
    connection: AsyncConnection, owner: str, conversation_id: str, after: str | None, limit: int, ascending: bool
) -> tuple[list[dict[str, Any]], bool]:
    """A page of the conversation's items, newest first (or oldest), after the item `after`; and whether more
    follow. An `after` that is not an item of the conversation starts past the end: an empty page."""
    query = select(_items.c.item).where(_items.c.conversation_id == conversation_id, _items.c.owner == owner)
    if after is not None:
        anchor = await connection.scalar(
            select(_items.c.seq).where(_items.c.id == after, _items.c.conversation_id == conversation_id)
        )
        if anchor is None:
            return [], False
        query = query.where(_items.c.seq > anchor if ascending else _items.c.seq < anchor)
    query = query.order_by(_items.c.seq if ascending else _items.c.seq.desc()).limit(limit + 1)
    page = list((await connection.execute(query)).scalars())
    return page[:limit], len(page) > limit


async def item(connection: AsyncConnection, owner: str, conversation_id: str, item_id: str) -> dict[str, Any] | None:
    query = select(_items.c.item).where(
        _items.c.id == item_id, _items.c.conversation_id == conversation_id, _items.c.owner == owner
    )
    return await connection.scalar(query)


async def remove_item(connection: AsyncConnection, owner: str, conversation_id: str, item_id: str) -> bool:
    query = delete(_items).where(
        _items.c.id == item_id, _items.c.conversation_id == conversation_id, _items.c.owner == owner
    )
    return (await connection.execute(query)).rowcount == 1
