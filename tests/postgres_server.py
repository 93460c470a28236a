"""A real PostgreSQL server for the tests of stored state: Debian's `postgresql` package (installed by .ci/run),
started in a temporary folder on a free port, as the `postgres` user when the tests run as root (PostgreSQL
refuses to run as root, which CI is)."""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.server_harness import free_port

SUPERUSER = "ferry"


def _bin_dir() -> Path | None:
    """The newest installed server's binaries (Debian keeps them off PATH, under /usr/lib/postgresql/N/bin)."""
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name))
    if versions:
        return versions[-1].parent
    found = shutil.which("pg_ctl")
    return Path(found).parent if found else None


class PostgresServer:
    def __init__(self, host: str, port: int, bin_dir: Path) -> None:
        self.host, self.port, self._bin = host, port, bin_dir
        self._names = itertools.count()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@{self.host}:{self.port}/{database}"

    def new_database(self) -> str:
        """The URL of an empty database of its own (each test server starts from nothing)."""
        name = f"ferry_{os.getpid()}_{next(self._names)}"
        command = [str(self._bin / "createdb"), "-h", self.host, "-p", str(self.port), "-U", SUPERUSER, name]
        subprocess.run(command, check=True, capture_output=True)
        return self.url(name)


def unavailable_reason() -> str | None:
    """Why no PostgreSQL server can start here, or None."""
    if _bin_dir() is None:
        return "PostgreSQL's server binaries are not installed (Debian: apt-get install postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user to run the server as"
        if shutil.which("runuser") is None:
            return "running as root without `runuser` to start the server as `postgres`"
    return None


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    bin_dir = _bin_dir()
    assert bin_dir is not None, unavailable_reason()
    folder = Path(tempfile.mkdtemp(prefix="ferry-postgres-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(folder, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = folder / "data", free_port()
    try:
        subprocess.run(
            [*as_user, str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", SUPERUSER, "--no-sync"],
            check=True,
            capture_output=True,
        )
        options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        subprocess.run(
            [
                *as_user,
                str(bin_dir / "pg_ctl"),
                "-D",
                str(data),
                "-o",
                options,
                "-l",
                str(folder / "log"),
                "-w",
                "start",
            ],
            check=True,
            capture_output=True,
        )
        yield PostgresServer("127.0.0.1", port, bin_dir)
    finally:
        subprocess.run(
            [*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"], capture_output=True
        )
        shutil.rmtree(folder, ignore_errors=True)
