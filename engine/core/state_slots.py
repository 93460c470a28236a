"""The state slots of a model with recurrent layers (Mamba, Mamba2, and the hybrids around them): one fixed-size
state per running sequence, whatever its length, held in slot-indexed tensors beside the attention layers' pages
(engine/execution/kv_caches.py).

Pure Python, like `PagePool`. A request takes a slot when it is admitted and gives it back when it finishes or is
preempted; a resumed request gets a slot again and recomputes its state from its first token (its step starts at
position 0, which the runner reads as "start from a zero state": a slot is never cleared, only overwritten).
There are at most as many slots as the memory budget holds states (engine/execution/startup.py), so admission
counts them as it counts pages.
"""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("at least one state slot")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._held: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the slots held by running requests."""
        return 1.0 - len(self._free) / self.num_slots

    def slot(self, request_id: str) -> int | None:
        """The slot the request holds; None if it holds none."""
        return self._held.get(request_id)

    def take(self, request_id: str) -> int | None:
        """The request's slot, taking a free one if it holds none; None when none is free."""
        held = self._held.get(request_id)
        if held is not None:
            return held
        if not self._free:
            return None
        slot = self._held[request_id] = self._free.pop()
        return slot

    def free(self, request_id: str) -> None:
        slot = self._held.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def check_invariants(self) -> None:
        held = set(self._held.values())
        assert len(held) == len(self._held), "a slot is held twice"
        assert not held & set(self._free), "a held slot is free"
        assert len(held) + len(self._free) == self.num_slots, "a slot is lost"
