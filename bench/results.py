"""What one system's run of a workload produced: tokens per request, wall time, and a per-request timeline."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestTrace:
    """When one request held a batch slot, in seconds from the start of the timed run."""

    index: int
    """Position of the request in the workload."""
    admitted: float
    finished: float
    """When its last token was produced."""
    released: float
    """When its slot became free: the wave barrier under static batching, `finished` otherwise."""
    slot: int = -1
    """Row of the batch it occupied; continuous systems get theirs from `assign_slots`."""


@dataclass
class SystemRun:
    system: str
    wall_seconds: float
    tokens: list[list[int]]
    """Generated ids per request, in workload order."""
    traces: list[RequestTrace]
    details: dict[str, object] = field(default_factory=dict)

    @property
    def generated_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_seconds if self.wall_seconds > 0 else float("inf")

    def summary(self) -> dict[str, object]:
        return {
            "system": self.system,
            "wall_seconds": self.wall_seconds,
            "generated_tokens": self.generated_tokens,
            "tokens_per_second": self.tokens_per_second,
            "details": self.details,
            "traces": [asdict(t) for t in self.traces],
        }


def assign_slots(traces: list[RequestTrace]) -> int:
    """Give each request the lowest slot free at its admission (first fit in admission order); returns slot count.

    A continuous engine does not name its slots, but at most `max_num_seqs` requests are alive at once, so first
    fit needs no more rows than that and draws each row as one slot's succession of requests.
    """
    slot_free_at: list[float] = []
    for trace in sorted(traces, key=lambda t: (t.admitted, t.index)):
        free = [slot for slot, free_at in enumerate(slot_free_at) if free_at <= trace.admitted]
        if free:
            trace.slot = free[0]
        else:
            trace.slot = len(slot_free_at)
            slot_free_at.append(0.0)
        slot_free_at[trace.slot] = trace.released
    return len(slot_free_at)
