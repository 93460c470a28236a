"""What every draft source offers the engine: drafts for a running request, and a look at each finished one.

A source proposes tokens that may follow a request's known tokens (prompt + output); the runner verifies them in
the next step (engine/sampling/verify.py) and only those the target model would have produced are kept, so a
source may guess wrong at no cost to correctness, only to speed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class DraftingRequest(Protocol):
    """What a source reads of a request (engine/core/request.py `Request` is one)."""

    request_id: str

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def output_ids(self) -> Sequence[int]: ...


class DraftSource(Protocol):
    def propose(self, request: DraftingRequest, max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens guessed to follow the request's prompt and output, most likely first; empty
        when there is nothing worth proposing. Called once per step per request that may draft."""
        ...

    def finished(self, request: DraftingRequest) -> None:
        """The request finished (or was aborted): drop what was kept for it; a source that learns across
        requests (suffix) takes its output here."""
        ...
