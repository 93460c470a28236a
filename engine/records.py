"""What a start of Ferry remembers for the next: small JSON records under Ferry's cache directory, each named by a
digest of everything its content depends on, so a record is never stale, only absent.

A record spares a later start work that only repeats the first's result (which tokenizer class a model directory
loads with, what its config resolves to). A record that cannot be read or written costs that start its speed,
nothing else. Imports nothing heavy: the front end uses it before it has imported torch or transformers.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def ferry_cache_dir() -> Path:
    """Where Ferry keeps what it derives from models (a GGUF file's directory, records): $FERRY_CACHE_DIR, else
    $XDG_CACHE_HOME/ferry (~/.cache/ferry)."""
    configured = os.environ.get("FERRY_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "ferry"


def package_version(package: str) -> str:
    """`package` and its installed version (or that it is absent), for a record's key."""
    try:
        return f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{package} absent"


def record_path(kind: str, parts: Iterable[str | bytes]) -> Path:
    """The record of `kind` whose content depends on exactly `parts` (names, versions, files' bytes)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return ferry_cache_dir() / kind / f"{digest.hexdigest()}.json"


def read_record(path: Path) -> Any | None:
    """The record's JSON value; None when there is none, or it cannot be read (a warning says so)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("Ignoring the record %s (%s)", path, exc)
        return None


def write_record(path: Path, value: Any) -> None:
    """Written whole or not at all (a temporary file moved into place), since another server may read it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    except OSError as exc:
        logger.warning("Cannot write the record %s (%s)", path, exc)
        return
    try:
        os.fchmod(descriptor, 0o644)  # mkstemp's 0600 would keep the record from a cache's other users
        with os.fdopen(descriptor, "w", encoding="utf-8") as f:
            json.dump(value, f)
        os.replace(temporary, path)
    except OSError as exc:
        logger.warning("Cannot write the record %s (%s)", path, exc)
        with contextlib.suppress(OSError):
            os.unlink(temporary)
