"""The database stored state lives in: opened once per server process, its migrations applied before serving.

SQLite (aiosqlite) in `--state-dir` by default: nothing to install, one replica. PostgreSQL (asyncpg) by
`--database-url`: what several replicas share. Both through SQLAlchemy's async engine, so the stores
(responses.py, conversations.py, files.py, batches.py) write one dialect-neutral SQL; every write is one
transaction (`Database.transaction`).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import event, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

MIGRATIONS = Path(__file__).parent / "migrations"
SQLITE_FILE = "ferry.db"
_MIGRATION_LOCK = 0x6665727279  # "ferry": the advisory lock replicas starting together migrate under, one at a time


class StateConfigError(ValueError):
    """A --database-url or --state-dir that cannot be used, said at start-up."""


def default_state_dir() -> Path:
    """$FERRY_STATE_DIR, else $XDG_DATA_HOME/ferry (~/.local/share/ferry)."""
    if os.environ.get("FERRY_STATE_DIR"):
        return Path(os.environ["FERRY_STATE_DIR"])
    data_home = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data_home) / "ferry"


def database_url(database_url: str | None, state_dir: str | None) -> str:
    """The SQLAlchemy URL: a PostgreSQL URL taken to asyncpg, else the SQLite file in the state folder."""
    if database_url is None:
        folder = Path(state_dir) if state_dir else default_state_dir()
        return f"sqlite+aiosqlite:///{folder / SQLITE_FILE}"
    try:
        url = make_url(database_url)
    except Exception as exc:  # sqlalchemy.exc.ArgumentError, with the text it could not read
        raise StateConfigError(f"--database-url is not a database URL ({exc})") from None
    if url.get_backend_name() not in ("postgresql", "postgres"):
        raise StateConfigError(
            f"--database-url: PostgreSQL is the server database Ferry keeps state in, not {url.drivername!r}"
        )
    return url.set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)


class Database:
    """The engine and its dialect; `transaction()` is how the stores read and write."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        """`sqlite` or `postgresql`."""

    @classmethod
    async def open(cls, url: str) -> Database:
        """Connect, apply the migrations the database has not seen, and return it ready for the stores."""
        if url.startswith("sqlite"):
            path = make_url(url).database
            assert path is not None
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            engine = create_async_engine(url)
            event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        else:
            engine = create_async_engine(url, pool_pre_ping=True)
        database = cls(engine)
        try:
            await database.migrate()
        except BaseException:
            await engine.dispose()
            raise
        return database

    async def migrate(self) -> None:
        async with self.engine.begin() as connection:
            if self.dialect == "postgresql":
                # Two replicas starting at once: the second waits for the first's migrations, then finds none left.
                await connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
            await connection.run_sync(_upgrade)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection]:
        """One transaction: committed when the block ends, rolled back if it raises."""
        async with self.engine.begin() as connection:
            yield connection

    async def close(self) -> None:
        await self.engine.dispose()


def _upgrade(connection: Connection) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


def _sqlite_pragmas(connection: Any, _record: Any) -> None:
    """Per connection: foreign keys enforced (items go with their conversation), write-ahead logging (readers do
    not block the writer), a wait instead of an error when another connection writes, and deleted rows
    overwritten in the file (deleting really deletes)."""
    cursor = connection.cursor()
    for pragma in ("foreign_keys=ON", "journal_mode=WAL", "busy_timeout=10000", "secure_delete=ON"):
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()
