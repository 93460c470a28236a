"""Iteration-level scheduling: which requests run in the next step, and how many tokens each computes.

Pure Python (no torch). A request's progress is `num_computed_tokens` out of `num_tokens`, so prefill, chunked
prefill, decode and recompute after preemption are the same thing: compute the missing tokens, within the
step's token budget (`max_batch_tokens`) and sequence limit (`max_num_seqs`).

Memory pressure is handled by preemption with recompute: the newest running request gives back its pages and
goes back to the front of the waiting queue, keeping its generated tokens; on resume it re-matches the prefix
cache (its own pages are often still cached) and recomputes the rest.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache import BlockManager
from engine.kv_groups import KVCacheGroups
from engine.request import FinishReason, Request, RequestStatus


class RequestQueue:
    """Requests in order, keyed by id: O(1) append at either end, pop from the front and removal by id.

    Stands in for the deque/list of the interface: aborts and finishes remove requests from the middle, which
    is O(n) in a deque or list, and each comparison there would run the dataclass `__eq__` over every field.
    Supports `len()`, truthiness, iteration in order and `in` (by request id or request).
    """

    def __init__(self) -> None:
        self._items: OrderedDict[str, Request] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items.values())

    def __contains__(self, item: object) -> bool:
        if isinstance(item, Request):
            return self._items.get(item.request_id) is item
        return item in self._items

    def __repr__(self) -> str:
        return f"RequestQueue({list(self._items)})"

    def get(self, request_id: str) -> Request | None:
        return self._items.get(request_id)

    def first(self) -> Request:
        return next(iter(self._items.values()))

    def last(self) -> Request:
        return next(reversed(self._items.values()))

    def append(self, request: Request) -> None:
        self._items[request.request_id] = request

    def appendleft(self, request: Request) -> None:
        self._items[request.request_id] = request
        self._items.move_to_end(request.request_id, last=False)

    def popleft(self) -> Request:
        return self._items.popitem(last=False)[1]

    def remove(self, request_id: str) -> Request | None:
        """Remove and return the request, or None if it is not here."""
        return self._items.pop(request_id, None)


@dataclass
class ScheduledBatch:
    """One step's work: `requests[i]` computes `num_new_tokens[i]` tokens from its `num_computed_tokens`."""

    requests: list[Request] = field(default_factory=list)
    """Packing order."""
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    """Requests preempted while building this batch (now back in the waiting queue, holding no pages)."""

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class _BatchBuilder:
    """A ScheduledBatch under construction, with the budget left."""

    def __init__(self, max_tokens: int, max_seqs: int) -> None:
        self.batch = ScheduledBatch()
        self.budget = max_tokens
        self._max_seqs = max_seqs

    @property
    def full(self) -> bool:
        return self.budget == 0 or len(self.batch.requests) >= self._max_seqs

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.batch.requests.append(request)
        self.batch.num_new_tokens.append(num_new_tokens)
        self.budget -= num_new_tokens

    def preempted(self, request: Request) -> None:
        """Record a preemption; a request admitted earlier in this same step also leaves the batch."""
        self.batch.preempted.append(request)
        for i, scheduled in enumerate(self.batch.requests):
            if scheduled is request:
                del self.batch.requests[i]
                self.budget += self.batch.num_new_tokens.pop(i)
                return


class Scheduler:
    """Builds each step's batch from the running and waiting requests; owns their status transitions.

    `waiting` and `running` are RequestQueues (ordered, O(1) removal by id) rather than the deque and list
    the interface names; they support the same len/iteration/`in` uses.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager | KVCacheGroups) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting = RequestQueue()
        """Arrival order; preempted requests go back to the front."""
        self.running = RequestQueue()
        """Admission order: the last one is the newest, the first to be preempted."""
        self.num_preemptions = 0
        # Whole pages; rounded first so that float noise (0.07 * 100 = 7.000000000000001) does not add a page.
        self._margin_blocks = math.ceil(round(config.safety_margin * block_manager.num_blocks, 6))

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def add(self, request: Request) -> None:
        if request.request_id in self.waiting or request.request_id in self.running:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a waiting or running request with ABORT; None (and no effect) for unknown or finished ids."""
        request = self.running.get(request_id) or self.waiting.get(request_id)
        if request is None:
            return None
        self.finish(request, FinishReason.ABORT)
        return request

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Free the request's pages now, so the next schedule() can admit a waiting request into them."""
        if request.finished:
            return
        self.running.remove(request.request_id)
        self.waiting.remove(request.request_id)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def schedule(self) -> ScheduledBatch:
        """Pick this step's requests and token counts (see the module docstring and SPEC.md for the rules)."""
        builder = _BatchBuilder(self.config.max_batch_tokens, self.config.max_num_seqs)
        if self.config.scheduler_policy == "prefill_first":
            already_running = list(self.running)
            self._admit_waiting(builder)
            self._schedule_running(already_running, builder)
        else:
            self._schedule_running(list(self.running), builder)
            # Pages just taken from a preempted request go to running ones: admitting now would only thrash.
            if not builder.batch.preempted:
                self._admit_waiting(builder)
        return builder.batch

    def advance(self, batch: ScheduledBatch) -> None:
        """After the forward pass: the batch's tokens now have K/V in the cache."""
        for request, num_new in zip(batch.requests, batch.num_new_tokens, strict=True):
            # Aborted while the step ran: its pages are already free.
            if request.finished:
                continue
            request.num_computed_tokens += num_new
            self.block_manager.commit(request)

    # -- internals -----------------------------------------------------------------------------------------------

    def _schedule_running(self, requests: list[Request], builder: _BatchBuilder) -> None:
        """Give each running request (oldest first) its missing tokens, up to the budget left."""
        for request in requests:
            if builder.full:
                return
            # Preempted earlier in this loop, to make room for an older request.
            if request.status is not RequestStatus.RUNNING:
                continue
            needed = request.num_tokens - request.num_computed_tokens
            if needed <= 0:
                raise RuntimeError(
                    f"running request {request.request_id!r} has nothing to compute: the engine must append "
                    "a sampled token or finish() it after every step that computes its last token"
                )
            num_new = min(needed, builder.budget)
            if self._reserve_pages(request, num_new, builder):
                builder.add(request, num_new)

    def _reserve_pages(self, request: Request, num_new: int, builder: _BatchBuilder) -> bool:
        """Allocate pages for `num_new` more tokens, preempting the newest running requests until they fit.

        Returns False when the request had to preempt itself. Terminates: every failed try removes one request
        from `running`, and the request itself is in it.
        """
        while not self.block_manager.allocate(request, num_new):
            victim = self.running.last()
            self._preempt(victim, builder)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, builder: _BatchBuilder) -> None:
        self.block_manager.free(request.request_id)
        self.running.remove(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Front of the queue: it was admitted before everything still waiting. Victims are taken newest first,
        # so several preempted in one step end up in their original admission order.
        self.waiting.appendleft(request)
        builder.preempted(request)

    def _admit_waiting(self, builder: _BatchBuilder) -> None:
        """Admit waiting requests in order until one does not fit; never skip ahead (no starvation)."""
        bm = self.block_manager
        while self.waiting and not builder.full and len(self.running) < self.config.max_num_seqs:
            # The margin keeps room for running sequences to grow; with none running it would only block the
            # queue forever when a first chunk needs more than the pages outside the margin.
            reserve = self._margin_blocks if self.running else 0
            # Every admission needs at least one new page (the last token's page is never a prefix hit), so a
            # full cache can stop here without hashing the prompt.
            if bm.num_free_blocks - 1 < reserve:
                return
            request = self.waiting.first()
            # Its prefix is being computed right now: wait for it (a step or two) and share it, rather than compute
            # it twice. No skipping ahead, so the queue behind it waits too.
            if bm.prefix_in_flight(request):
                return
            hit = bm.match_prefix(request)
            request.num_computed_tokens = hit
            num_new = min(request.num_tokens - hit, builder.budget)
            new_pages = bm.blocks_needed(hit + num_new) - len(bm.block_table(request.request_id))
            if bm.num_free_blocks - new_pages < reserve or not bm.allocate(request, num_new):
                # Give back the prefix pages just matched: holding them while waiting could keep an older
                # request (preempted to the front of the queue) from ever fitting.
                bm.free(request.request_id)
                request.num_computed_tokens = 0
                return
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.num_preemptions == 0:
                request.num_cached_tokens = hit
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            builder.add(request, num_new)
