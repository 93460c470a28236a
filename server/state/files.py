"""Stored files (`/v1/files`): what a client uploads (a batch's requests) and what the server writes back (a batch's
output and error files), each row its owner's, its bytes in the database so every replica reads the same."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from server.state import tables
from server.state.stored import new_id, now

_LISTED = [c for c in tables.files.c if c.name != "content"]


def file_object(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row (its mapping) as OpenAI's file object."""
    fields = ("id", "bytes", "created_at", "expires_at", "filename", "purpose")
    return {"object": "file", "status": "processed", **{name: row[name] for name in fields}}


async def add(connection: AsyncConnection, owner: str, purpose: str, filename: str, content: bytes) -> dict[str, Any]:
    values = dict(
        id=new_id("file"), owner=owner, created_at=now(), expires_at=None, purpose=purpose, filename=filename,
        bytes=len(content), content=content,
    )  # fmt: skip
    await connection.execute(insert(tables.files).values(**values))
    return file_object(values)


async def get(connection: AsyncConnection, owner: str, file_id: str) -> Any | None:
    """The file's row without its content, or None (missing, or another owner's: the same answer)."""
    query = select(*_LISTED).where(tables.files.c.id == file_id, tables.files.c.owner == owner)
    return (await connection.execute(query)).first()


async def content(connection: AsyncConnection, owner: str, file_id: str) -> bytes | None:
    query = select(tables.files.c.content).where(tables.files.c.id == file_id, tables.files.c.owner == owner)
    return await connection.scalar(query)


async def listed(
    connection: AsyncConnection, owner: str, purpose: str | None, after: str | None, limit: int, ascending: bool
) -> tuple[list[Any], bool]:
    """A page of the owner's files, newest first (or oldest), after the file `after`; and whether more follow."""
    files = tables.files
    query = select(*_LISTED).where(files.c.owner == owner)
    if purpose is not None:
        query = query.where(files.c.purpose == purpose)
    order = (files.c.created_at, files.c.id)
    if after is not None:
        anchor = await get(connection, owner, after)
        if anchor is not None:
            key = (anchor.created_at, anchor.id)
            query = query.where(
                (files.c.created_at > key[0]) | ((files.c.created_at == key[0]) & (files.c.id > key[1]))
                if ascending
                else (files.c.created_at < key[0]) | ((files.c.created_at == key[0]) & (files.c.id < key[1]))
            )
    query = query.order_by(*(o.asc() if ascending else o.desc() for o in order)).limit(limit + 1)
    rows = list((await connection.execute(query)).all())
    return rows[:limit], len(rows) > limit


async def remove(connection: AsyncConnection, owner: str, file_id: str) -> bool:
    result = await connection.execute(
        delete(tables.files).where(tables.files.c.id == file_id, tables.files.c.owner == owner)
    )
    return result.rowcount == 1
