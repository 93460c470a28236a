"""Stored batches (`/v1/batches`): the batch object, which replica runs it (a lease), and each request's result,
recorded once by its `custom_id` whatever restarts happen between running it and recording it."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from server.state import tables
from server.state.stored import LEASE_SECONDS, new_id, now

COMPLETION_WINDOW_SECONDS = 24 * 3600
RUNNABLE = ("validating", "in_progress", "finalizing", "cancelling")
"""Statuses a replica picks a batch up in (a batch whose replica died is resumed from where its results stop)."""


def new_batch(owner: str, endpoint: str, input_file_id: str, metadata: dict[str, str] | None) -> dict[str, Any]:
    created = now()
    return {
        "id": new_id("batch"),
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": "24h",
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": created,
        "in_progress_at": None,
        "expires_at": created + COMPLETION_WINDOW_SECONDS,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
    }


async def add(connection: AsyncConnection, owner: str, batch: dict[str, Any]) -> None:
    await connection.execute(
        insert(tables.batches).values(
            id=batch["id"], owner=owner, created_at=batch["created_at"], status=batch["status"],
            endpoint=batch["endpoint"], input_file_id=batch["input_file_id"], batch=batch,
        )
    )  # fmt: skip


async def get(connection: AsyncConnection, owner: str | None, batch_id: str) -> dict[str, Any] | None:
    """The batch object, or None (missing, or another owner's); `owner` None: whoever owns it (the runner)."""
    query = select(tables.batches.c.batch).where(tables.batches.c.id == batch_id)
    if owner is not None:
        query = query.where(tables.batches.c.owner == owner)
    return await connection.scalar(query)


async def owner_of(connection: AsyncConnection, batch_id: str) -> str:
    return await connection.scalar(select(tables.batches.c.owner).where(tables.batches.c.id == batch_id))


async def listed(
    connection: AsyncConnection, owner: str, after: str | None, limit: int
) -> tuple[list[dict[str, Any]], bool]:
    """A page of the owner's batches, newest first, after the batch `after`; and whether more follow."""
    batches = tables.batches
    query = select(batches.c.batch).where(batches.c.owner == owner)
    if after is not None:
        anchor = await get(connection, owner, after)
        if anchor is not None:
            created = anchor["created_at"]
            query = query.where(
                (batches.c.created_at < created) | ((batches.c.created_at == created) & (batches.c.id < after))
            )
    query = query.order_by(batches.c.created_at.desc(), batches.c.id.desc()).limit(limit + 1)
    rows = list((await connection.scalars(query)).all())
    return rows[:limit], len(rows) > limit


async def save(connection: AsyncConnection, batch: dict[str, Any], expected: str, release: bool = False) -> bool:
    """Write the batch object back (its status column follows it) if its status is still `expected`: whether it
    was. The condition is what keeps a cancel and the runner from overwriting each other (read, then write, with
    the other's write in between): the loser reads the batch again. `release`: it ended, so nobody holds it."""
    lease = {"worker": None, "lease_until": None} if release else {}
    written = await connection.execute(
        update(tables.batches)
        .where(tables.batches.c.id == batch["id"], tables.batches.c.status == expected)
        .values(status=batch["status"], batch=batch, **lease)
    )
    return written.rowcount == 1


async def claim(connection: AsyncConnection, worker: str) -> str | None:
    """Take the lease of one runnable batch nobody holds (or whose holder stopped renewing it, or this replica
    held before): its id, or None. The conditional UPDATE is the lock: two replicas never both win one batch."""
    batches = tables.batches
    free = or_(batches.c.lease_until.is_(None), batches.c.lease_until < time.time(), batches.c.worker == worker)
    candidates = select(batches.c.id).where(batches.c.status.in_(RUNNABLE), free).order_by(batches.c.created_at)
    for batch_id in (await connection.scalars(candidates.limit(8))).all():
        taken = await connection.execute(
            update(batches)
            .where(batches.c.id == batch_id, free)
            .values(worker=worker, lease_until=time.time() + LEASE_SECONDS)
        )
        if taken.rowcount == 1:
            return batch_id
    return None


async def renew(connection: AsyncConnection, worker: str, batch_id: str) -> bool:
    """Extend this replica's lease: False if it no longer holds it (it stalled past the lease, and another
    replica took the batch over)."""
    renewed = await connection.execute(
        update(tables.batches)
        .where(tables.batches.c.id == batch_id, tables.batches.c.worker == worker)
        .values(lease_until=time.time() + LEASE_SECONDS)
    )
    return renewed.rowcount == 1


async def release(connection: AsyncConnection, worker: str, batch_id: str | None = None) -> None:
    """Give up this replica's leases (it is stopping), or its lease on `batch_id` (it left the batch to resume):
    a restart, or another replica, takes them up at once."""
    query = update(tables.batches).where(tables.batches.c.worker == worker)
    if batch_id is not None:
        query = query.where(tables.batches.c.id == batch_id)
    await connection.execute(query.values(worker=None, lease_until=None))


async def status(connection: AsyncConnection, batch_id: str) -> str:
    return await connection.scalar(select(tables.batches.c.status).where(tables.batches.c.id == batch_id))


async def recorded_lines(connection: AsyncConnection, batch_id: str) -> set[int]:
    query = select(tables.batch_results.c.line).where(tables.batch_results.c.batch_id == batch_id)
    return set((await connection.scalars(query)).all())


async def record(
    connection: AsyncConnection, batch_id: str, line: int, custom_id: str, error: bool, result: dict[str, Any]
) -> bool:
    """Record a request's result unless one is already there (a line rerun after a crash): whether this was the
    first. Two replicas recording the same line at once both find none, and the second's INSERT then breaks the
    UNIQUE constraint: an IntegrityError, which rolls back its transaction (PostgreSQL allows nothing more in
    it), so the caller keeps that transaction to this and takes the error as "not the first". No savepoint: with
    the SQLite driver's own transaction handling, releasing one commits the enclosing transaction."""
    results = tables.batch_results
    query = select(results.c.line).where(results.c.batch_id == batch_id, results.c.custom_id == custom_id)
    if await connection.scalar(query) is not None:
        return False
    await connection.execute(
        insert(results).values(batch_id=batch_id, line=line, custom_id=custom_id, error=error, result=result)
    )
    return True


async def counts(connection: AsyncConnection, batch_id: str) -> tuple[int, int]:
    """(completed, failed) requests recorded so far."""
    results = tables.batch_results
    query = select(results.c.error, func.count()).where(results.c.batch_id == batch_id).group_by(results.c.error)
    by_error = {bool(error): count for error, count in (await connection.execute(query)).all()}
    return by_error.get(False, 0), by_error.get(True, 0)


async def results(connection: AsyncConnection, batch_id: str) -> list[tuple[bool, dict[str, Any]]]:
    """Every recorded result in input order: (error, the output or error file's line)."""
    results = tables.batch_results
    query = select(results.c.error, results.c.result).where(results.c.batch_id == batch_id).order_by(results.c.line)
    return [(bool(error), result) for error, result in (await connection.execute(query)).all()]


async def statuses(connection: AsyncConnection) -> dict[str, int]:
    """How many batches are in each status (all owners): the metrics' gauge."""
    query = select(tables.batches.c.status, func.count()).group_by(tables.batches.c.status)
    return {status: count for status, count in (await connection.execute(query)).all()}
