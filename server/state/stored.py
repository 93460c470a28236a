"""What the routes of stored state share: the database once open, the settings, and this replica's name."""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from server.openai.errors import APIError, service_unavailable
from server.settings import ServerSettings
from server.state import tables
from server.state.database import Database

LEASE_SECONDS = 30.0
"""How long a replica's claim on running work (a background response, a batch) holds without renewal: a replica
renews its claims every third of it; work whose claim ran out belonged to a replica that died."""


def new_id(prefix: str) -> str:
    """An id no client can guess: 192 random bits after OpenAI's prefix (`resp`, `conv`, `file`, `batch`...)."""
    return f"{prefix}_{secrets.token_hex(24)}"


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's paged list object: the page, whether more follow, and the ids a next page starts `after`."""
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more}


def now() -> int:
    """OpenAI's timestamps: whole seconds since the epoch."""
    return int(time.time())


@dataclass
class StoredState:
    settings: ServerSettings
    database: Database | None = None
    """Set once the lifespan has opened it (before the server reports ready)."""
    worker: str = field(default_factory=lambda: f"replica_{uuid.uuid4().hex}")
    """This server process's name in the leases it takes."""
    jobs: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    """Loops the server runs while it serves (the batch runner, the retention sweep, lease renewal), started once
    the database is open and cancelled at shutdown; the route modules register theirs."""
    on_shutdown: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    """Run at shutdown after the jobs stop, before the database closes (work still running is recorded as ended)."""

    def db(self) -> Database:
        if self.database is None:
            raise service_unavailable("The state database is not open yet.", "loading")
        return self.database

    async def check_quota(self, connection: AsyncConnection, owner: str, adding: int) -> None:
        """Refuse (429, `insufficient_quota`) a store that would take `owner` past --max-stored-bytes-per-key;
        counted inside the writing transaction, so what it writes is what was checked."""
        limit = self.settings.max_stored_bytes_per_key
        if not limit:
            return
        stored = 0
        for table in (tables.responses, tables.conversation_items, tables.files):
            total = await connection.scalar(
                select(func.coalesce(func.sum(table.c.bytes), 0)).where(table.c.owner == owner)
            )
            stored += int(total or 0)
        if stored + adding > limit:
            raise APIError(
                429,
                f"Storing {adding} more bytes would exceed this key's quota of {limit} stored bytes "
                f"({stored} in use): delete stored responses, conversations or files first.",
                code="insufficient_quota",
            )
