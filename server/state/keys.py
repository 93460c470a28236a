"""API keys and the owners of stored objects.

Each key accepted (--api-key, and every line of --api-keys-file) owns what is stored with it; an object's `owner`
column is a digest of its key, so the database never holds a key itself and a key's objects stay its own across
restarts and replicas. Without keys every request is one owner (`ANONYMOUS`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from starlette.requests import Request

ANONYMOUS = "anonymous"
"""The owner of everything stored on a server that takes no key."""
OWNER_SCOPE_KEY = "ferry_owner"
"""Where APIKeyMiddleware leaves the request's owner in the ASGI scope (which a client cannot set)."""


def owner_of(key: str) -> str:
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:40]


def read_keys(api_key: str | None, api_keys_file: str | None) -> tuple[str, ...]:
    """The keys the server accepts: --api-key's and the file's, one a line (blank lines and `#` comments skipped).
    Raises ValueError, saying where, for a file that cannot be read or a key with spaces in it."""
    keys = [api_key] if api_key else []
    if api_keys_file is not None:
        try:
            lines = Path(api_keys_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"--api-keys-file {api_keys_file}: {exc.strerror}") from None
        for number, line in enumerate(lines, 1):
            key = line.strip()
            if not key or key.startswith("#"):
                continue
            if any(character.isspace() for character in key):
                raise ValueError(f"--api-keys-file {api_keys_file}, line {number}: a key has no spaces in it")
            keys.append(key)
        if not keys:
            raise ValueError(f"--api-keys-file {api_keys_file} holds no key")
    return tuple(dict.fromkeys(keys))


def request_owner(request: Request) -> str:
    """The owner of what this request stores and may read: its key's, or ANONYMOUS without keys."""
    return request.scope.get(OWNER_SCOPE_KEY, ANONYMOUS)
