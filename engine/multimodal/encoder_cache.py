"""The scheduler's account of the image encodings the runner holds: by content hash, within a budget of tokens.

The runner keeps each encoded image's embeddings (`[length, hidden]`) until a plan frees them; the scheduler
decides both. An image is encoded once while its embeddings stay cached, however many requests (or chunks of one
prefill) read them. Room is made by evicting, least recently used first, only encodings no request still needs: a
running request needs an image until its computed tokens pass the image's end (a chunked prefill may stop inside
an image and read the rest of its embeddings a step later). Pure Python: no tensors here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection


class EncoderCache:
    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"the encoder cache needs room for at least one token, got {capacity_tokens}")
        self.capacity = capacity_tokens
        self._lengths: OrderedDict[str, int] = OrderedDict()
        """Held encodings by hash, least recently used first: their lengths in tokens."""
        self.used = 0
        self.freed: list[str] = []
        """Hashes evicted since the last plan took them (`take_freed`): the runner drops their embeddings."""
        self.hits = 0
        self.misses = 0

    def __contains__(self, content_hash: object) -> bool:
        return content_hash in self._lengths

    def __len__(self) -> int:
        return len(self._lengths)

    def lookup(self, content_hash: str, first_read: bool = True) -> bool:
        """Whether the runner holds it (then made most recently used, and counted as a hit on a request's
        `first_read` of it: the chunk that reaches its first token) or not."""
        if content_hash in self._lengths:
            self._lengths.move_to_end(content_hash)
            self.hits += first_read
            return True
        return False

    def admit(self, content_hash: str, length: int, in_use: Callable[[], Collection[str]]) -> bool:
        """Make room for a new encoding of `length` tokens by evicting unused ones (not in `in_use()`, asked only
        when something must go), least recently used first, and record it as held; False (nothing evicted) when
        it cannot fit now."""
        if content_hash in self._lengths:
            raise ValueError(f"image {content_hash[:12]} is already encoded")
        if self.used + length <= self.capacity:
            self._hold(content_hash, length)
            return True
        needed = in_use()
        evictable = sum(n for h, n in self._lengths.items() if h not in needed)
        if self.used - evictable + length > self.capacity:
            return False
        for held in list(self._lengths):
            if self.used + length <= self.capacity:
                break
            if held not in needed:
                self.used -= self._lengths.pop(held)
                self.freed.append(held)
        self._hold(content_hash, length)
        return True

    def _hold(self, content_hash: str, length: int) -> None:
        self._lengths[content_hash] = length
        self.used += length
        self.misses += 1

    def take_freed(self) -> tuple[str, ...]:
        freed, self.freed = tuple(self.freed), []
        return freed
