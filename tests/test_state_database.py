"""The database under stored state (server/state/): the migrations build exactly the schema the code reads, on
SQLite and on a real PostgreSQL server; replicas starting together migrate once; API keys and their owners; the
quota; `previous_response_id` chains read in one query; a database the server cannot open stops it, saying why."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import insert, text, update
from sqlalchemy.engine import Connection
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from server.metrics import ServerMetrics
from server.middleware import APIKeyMiddleware
from server.openai.errors import APIError
from server.settings import ServerSettings
from server.state import responses, tables
from server.state.database import MIGRATIONS, Database, StateConfigError, database_url
from server.state.keys import ANONYMOUS, owner_of, read_keys, request_owner
from server.state.stored import StoredState, new_id
from tests.postgres_server import PostgresServer
from tests.server_harness import REPO_ROOT


def _head_revision() -> str:
    """The newest migration's revision: the one every database is brought to at start-up."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    head = ScriptDirectory.from_config(config).get_current_head()
    assert head is not None
    return head


async def _schema_differences(db: Database) -> list[object]:
    def compare(connection: Connection) -> list[object]:
        return compare_metadata(MigrationContext.configure(connection), tables.metadata)

    async with db.engine.connect() as connection:
        return await connection.run_sync(compare)


def test_sqlite_migrations_build_the_schema_the_code_reads(tmp_path: Path) -> None:
    async def scenario() -> None:
        db = await Database.open(database_url(None, str(tmp_path)))
        assert await _schema_differences(db) == []
        await db.close()
        await (await Database.open(database_url(None, str(tmp_path)))).close()  # again: nothing left to migrate

    asyncio.run(scenario())
    assert (tmp_path / "ferry.db").exists()


def test_postgres_migrations_build_the_schema_and_replicas_starting_together_migrate_once(
    postgres: PostgresServer,
) -> None:
    url = database_url(postgres.new_database(), None)

    async def scenario() -> None:
        databases = await asyncio.gather(*(Database.open(url) for _ in range(3)))
        assert await _schema_differences(databases[0]) == []
        async with databases[0].transaction() as connection:
            versions = [tuple(row) for row in await connection.execute(text("SELECT version_num FROM alembic_version"))]
        assert versions == [(_head_revision(),)]
        for db in databases:
            await db.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgresql://u:p@db:5432/ferry", "postgresql+asyncpg://u:p@db:5432/ferry"),
        ("postgres://u:p@db/ferry", "postgresql+asyncpg://u:p@db/ferry"),
        ("postgresql+asyncpg://u@db/ferry", "postgresql+asyncpg://u@db/ferry"),
    ],
)
def test_a_postgres_url_is_taken_to_the_async_driver(given: str, expected: str) -> None:
    assert database_url(given, None) == expected


@pytest.mark.parametrize(("given", "match"), [("mysql://db/x", "not 'mysql'"), ("not a url", "not a database URL")])
def test_other_databases_are_refused_by_name(given: str, match: str) -> None:
    with pytest.raises(StateConfigError, match=match):
        database_url(given, None)


def test_the_state_folder_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FERRY_STATE_DIR", str(tmp_path / "here"))
    assert database_url(None, None) == f"sqlite+aiosqlite:///{tmp_path / 'here' / 'ferry.db'}"
    monkeypatch.delenv("FERRY_STATE_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert database_url(None, None) == f"sqlite+aiosqlite:///{tmp_path / 'xdg' / 'ferry' / 'ferry.db'}"


# ---------------------------------------------------------------------------------------------------- the keys


def test_keys_come_from_the_flag_and_the_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# team a\nkey-a\n\n  key-b  \nkey-a\n")
    assert read_keys("key-0", str(path)) == ("key-0", "key-a", "key-b")
    assert read_keys(None, None) == ()
    assert owner_of("key-a") != owner_of("key-b") and "key-a" not in owner_of("key-a")


@pytest.mark.parametrize(("text", "match"), [("a b\n", "line 1: a key has no spaces"), ("# none\n", "holds no key")])
def test_a_bad_keys_file_is_refused_saying_where(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_keys(None, str(path))
    with pytest.raises(ValueError, match="No such file"):
        read_keys(None, str(tmp_path / "missing"))


def test_each_key_is_its_own_owner_and_a_wrong_key_is_refused() -> None:
    async def whoami(request: Request) -> PlainTextResponse:
        return PlainTextResponse(request_owner(request))

    app = APIKeyMiddleware(
        Starlette(routes=[Route("/v1/whoami", whoami), Route("/health", whoami)]),
        api_keys=("key-a", "key-b"),
        metrics=ServerMetrics("m", 1),
    )
    with TestClient(app) as client:
        assert client.get("/v1/whoami", headers={"Authorization": "Bearer key-a"}).text == owner_of("key-a")
        assert client.get("/v1/whoami", headers={"Authorization": "Bearer key-b"}).text == owner_of("key-b")
        assert client.get("/v1/whoami", headers={"Authorization": "Bearer key-c"}).status_code == 401
        assert client.get("/v1/whoami").status_code == 401
        assert client.get("/health").text == ANONYMOUS  # probes stay open and own nothing


# --------------------------------------------------------------------------------------------------- the quota


def test_the_quota_counts_what_an_owner_stores_everywhere(tmp_path: Path) -> None:
    async def scenario() -> None:
        database = await Database.open(database_url(None, str(tmp_path)))
        stored = StoredState(ServerSettings(max_stored_bytes_per_key=1_000), database=database)
        async with stored.db().transaction() as connection:
            await connection.execute(
                insert(tables.files).values(
                    id=new_id("file"), owner="a", created_at=0, purpose="batch", filename="f", bytes=600, content=b""
                )
            )
            await connection.execute(
                insert(tables.conversations).values(id="conv_1", owner="a", created_at=0, metadata={})
            )
            await connection.execute(
                insert(tables.conversation_items).values(
                    id="msg_1", conversation_id="conv_1", owner="a", created_at=0, item={}, bytes=300
                )
            )
        async with stored.db().transaction() as connection:
            await stored.check_quota(connection, "a", 100)  # 1,000 exactly: allowed
            await stored.check_quota(connection, "b", 1_000)  # another owner's bytes are its own
            with pytest.raises(APIError) as refused:
                await stored.check_quota(connection, "a", 101)
        assert refused.value.status_code == 429 and refused.value.info.code == "insufficient_quota"
        assert "900 in use" in refused.value.info.message
        await stored.db().close()

    asyncio.run(scenario())


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_chain_of_turns_is_read_in_order_and_a_broken_one_is_missing(
    dialect: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """`previous_response_id` chains (one recursive query): oldest turn first, each turn's input then output;
    a chain with a turn deleted, expired or another owner's reads as missing; a cycle stops at MAX_CHAIN."""
    if dialect == "sqlite":
        url = database_url(None, str(tmp_path))
    else:
        postgres: PostgresServer = request.getfixturevalue("postgres")
        url = database_url(postgres.new_database(), None)

    def turn(number: int, previous: int | None) -> dict[str, object]:
        return {"id": f"resp_{number}", "created_at": int(time.time()), "status": "completed",
                "previous_response_id": None if previous is None else f"resp_{previous}",
                "output": [{"type": "message", "text": f"answer {number}"}]}  # fmt: skip

    async def scenario() -> None:
        stored = StoredState(ServerSettings(), database=await Database.open(url))
        async with stored.db().transaction() as connection:
            for number in range(60):
                previous = number - 1 if number else None
                await responses.add(connection, stored, "a", turn(number, previous), [{"text": f"ask {number}"}])
            await responses.add(connection, stored, "b", turn(100, 59), [{"text": "ask 100"}])  # onto a's chain
            await responses.add(connection, stored, "a", turn(101, 102), [{"text": "ask 101"}])  # a cycle
            await responses.add(connection, stored, "a", turn(102, 101), [{"text": "ask 102"}])
        async with stored.db().transaction() as connection:
            items = await responses.conversation(connection, "a", "resp_59")
            assert items == [item for n in range(60) for item in ({"text": f"ask {n}"},
                             {"type": "message", "text": f"answer {n}"})]  # fmt: skip
            assert await responses.conversation(connection, "a", "resp_0") == items[:2]
            assert await responses.conversation(connection, "b", "resp_59") is None  # another owner's
            assert await responses.conversation(connection, "b", "resp_100") is None  # its earlier turns are a's
            assert await responses.conversation(connection, "a", "resp_nope") is None
            assert len(await responses.conversation(connection, "a", "resp_101") or []) == 2 * responses.MAX_CHAIN
            await connection.execute(update(tables.responses).where(tables.responses.c.id == "resp_3")
                                     .values(expires_at=1))  # fmt: skip
            assert await responses.conversation(connection, "a", "resp_59") is None  # expired mid-chain
            assert await responses.conversation(connection, "a", "resp_2") is not None
            assert await responses.remove(connection, "a", "resp_1")
            assert await responses.conversation(connection, "a", "resp_2") is None  # deleted mid-chain
        await stored.db().close()

    asyncio.run(scenario())


# ------------------------------------------------------------------------------------------------- start-up


def test_a_database_the_server_cannot_reach_stops_it_saying_why(tiny_llama: Path, tmp_path: Path) -> None:
    unused = PostgresServer("127.0.0.1", 9, Path("/nonexistent")).url()  # port 9 (discard): nothing listens
    result = subprocess.run(
        [sys.executable, "-m", "ferry", "serve", "--model", str(tiny_llama), "--port", "0", "--database-url",
         unused.replace("ferry@", "ferry:secret@")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Cannot open the state database (postgresql+asyncpg://ferry:***@127.0.0.1:9/postgres)" in result.stderr
    assert "secret" not in result.stderr


def test_a_bad_keys_file_stops_the_server_at_its_flags(tiny_llama: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ferry", "serve", "--model", str(tiny_llama), "--api-keys-file", str(tmp_path / "no")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "--api-keys-file" in result.stderr and "No such file" in result.stderr
