"""Iteration-level scheduling: which requests run in the next step, and how many tokens each computes; and,
after the step, what it did to each request (tokens appended, stop rules, finishing, freeing).

Only the scheduler changes a `Request`. Pure Python (no torch). A request's progress is `num_computed_tokens`
out of `num_tokens`, so prefill, chunked prefill, decode and recompute after preemption are the same thing:
compute the missing tokens, within the step's token budget (`max_batch_tokens`) and sequence limit
(`max_num_seqs`).

Memory pressure is handled by preemption with recompute: the newest running request gives back its pages and
goes back to the front of the waiting queue, keeping its generated tokens; on resume it re-matches the prefix
cache (its own pages are often still cached) and recomputes the rest.

Batch requests (`Request.batch`: the Batch API's lines) are a class below interactive ones under both policies:
every waiting interactive request is admitted before any waiting batch request, and a running batch request is
preempted before any interactive one. Without batch requests the order is exactly the policy's own.

Plans may run ahead of results by one step (async scheduling: step N+1 is planned while step N runs). A request
then counts the tokens of planned steps not yet applied (`num_in_flight_tokens`) and the tokens those steps will
sample for it (`num_pending_samples`): the next plan starts after them, and a decode of a token not yet known is
a `PLACEHOLDER` the runner fills in. Results are applied in plan order. What only a result can tell comes one step
late: a request that stops (EOS, a stop token) had one more token planned, whose result is dropped; one preempted
while a step computed for it keeps the token that step sampled.

A result may bring several tokens for a request (see `ModelRunnerOutput`): each goes through the stop rules in
order. A token at a position the request already knows (a step planned ahead sampled where an earlier result
brought more than one token) is dropped, and so is that step's pending sample. Drafts (`schedule(drafts)`) are
planned only for a decode with nothing in flight, and the request waits for that result before its next plan;
`schedule(hold=...)` leaves requests out of a plan ahead, so that the plan after it can give them drafts.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from engine.config import SchedulerConfig
from engine.core.kv_cache import NO_NEW_PAGES, KVCacheManager
from engine.core.request import FinishReason, Request, RequestStatus, StepOutput, TokenLogprob
from engine.core.step import (
    PLACEHOLDER,
    ModelRunnerOutput,
    NewRequest,
    PageTables,
    PromptLogprobs,
    SchedulerOutput,
    num_accepted,
)
from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.inputs import ImageInput


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

    def __reversed__(self) -> Iterator[Request]:
        return reversed(self._items.values())

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


class InteractiveFirstQueue:
    """Waiting requests under the `fcfs` policy: the same interface as RequestQueue, where every interactive
    request comes before every batch request and each class keeps RequestQueue's order (arrival, preempted ones
    back at the front). Requests are routed by `Request.batch`, so a preempted batch request goes back to the
    front of the batch requests, still behind every interactive one. Without batch requests it is RequestQueue."""

    def __init__(self) -> None:
        self._interactive = RequestQueue()
        self._batch = RequestQueue()

    def _queue(self, request: Request) -> RequestQueue:
        return self._batch if request.batch else self._interactive

    def __len__(self) -> int:
        return len(self._interactive) + len(self._batch)

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain(self._interactive, self._batch)

    def __contains__(self, item: object) -> bool:
        return item in self._interactive or item in self._batch

    def __repr__(self) -> str:
        return f"InteractiveFirstQueue({[request.request_id for request in self]})"

    def get(self, request_id: str) -> Request | None:
        return self._interactive.get(request_id) or self._batch.get(request_id)

    def first(self) -> Request:
        return self._interactive.first() if self._interactive else self._batch.first()

    def last(self) -> Request:
        return self._batch.last() if self._batch else self._interactive.last()

    def append(self, request: Request) -> None:
        self._queue(request).append(request)

    def appendleft(self, request: Request) -> None:
        self._queue(request).appendleft(request)

    def popleft(self) -> Request:
        return self._interactive.popleft() if self._interactive else self._batch.popleft()

    def remove(self, request_id: str) -> Request | None:
        """Remove and return the request, or None if it is not here."""
        return self._interactive.remove(request_id) or self._batch.remove(request_id)


def priority_key(request: Request) -> tuple[bool, int, float]:
    """Order under the `priority` policy: interactive before batch requests, then lower priority value first,
    then earlier arrival."""
    return (request.batch, request.priority, request.arrival_time)


class PriorityRequestQueue:
    """Waiting requests kept sorted by `priority_key`: the same interface as RequestQueue, where `append` places
    a request by its key (so a preempted request goes back ahead of later arrivals of its priority)."""

    def __init__(self) -> None:
        self._items: dict[str, Request] = {}
        self._order: list[tuple[tuple[bool, int, float], str]] = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return (self._items[request_id] for _, request_id in self._order)

    def __contains__(self, item: object) -> bool:
        if isinstance(item, Request):
            return self._items.get(item.request_id) is item
        return item in self._items

    def __repr__(self) -> str:
        return f"PriorityRequestQueue({[request_id for _, request_id in self._order]})"

    def get(self, request_id: str) -> Request | None:
        return self._items.get(request_id)

    def first(self) -> Request:
        return self._items[self._order[0][1]]

    def last(self) -> Request:
        return self._items[self._order[-1][1]]

    def append(self, request: Request) -> None:
        self._items[request.request_id] = request
        bisect.insort(self._order, (priority_key(request), request.request_id))

    def popleft(self) -> Request:
        _, request_id = self._order.pop(0)
        return self._items.pop(request_id)

    def remove(self, request_id: str) -> Request | None:
        """Remove and return the request, or None if it is not here."""
        request = self._items.pop(request_id, None)
        if request is not None:
            self._order.remove((priority_key(request), request_id))
        return request


@dataclass(slots=True)
class _Planned:
    """What one plan scheduled, per request in its order."""

    requests: list[Request]
    starts: list[int]
    num_new_tokens: list[int]
    samples: list[bool]
    """Cleared for a request whose sample position an earlier result already filled (see `update`)."""


class _StepBuilder:
    """One step's plan under construction, with the budget left."""

    def __init__(self, max_tokens: int, max_seqs: int) -> None:
        self.requests: list[Request] = []
        self.num_new_tokens: list[int] = []
        self.samples: list[bool] = []
        self.drafts: dict[str, tuple[int, ...]] = {}
        self.preempted: list[Request] = []
        self.admitted: set[str] = set()
        """Requests admitted this step: new to the runner."""
        self.grants: dict[str, PageTables] = {}
        """Pages appended this step, per request."""
        self.encodes: list[ImageInput] = []
        """Images this step encodes, each content once."""
        self.images_read: set[str] = set()
        """Content hashes of the images this step's chunks read (encoded now or held): none is evicted now."""
        self.budget = max_tokens
        self._max_seqs = max_seqs

    @property
    def full(self) -> bool:
        return self.budget == 0 or len(self.requests) >= self._max_seqs

    def add(self, request: Request, num_new_tokens: int, samples: bool, grant: PageTables) -> None:
        """`samples`: this step computes the request's last known token, so a new one is sampled after it."""
        self.requests.append(request)
        self.num_new_tokens.append(num_new_tokens)
        self.samples.append(samples)
        self.budget -= num_new_tokens
        if grant is not NO_NEW_PAGES and any(grant):
            self.grants[request.request_id] = grant

    def preempt(self, request: Request) -> None:
        """Record a preemption; a request added earlier in this same step also leaves the plan."""
        self.preempted.append(request)
        self.admitted.discard(request.request_id)
        self.grants.pop(request.request_id, None)
        self.drafts.pop(request.request_id, None)
        for i, scheduled in enumerate(self.requests):
            if scheduled is request:
                del self.requests[i]
                del self.samples[i]
                self.budget += self.num_new_tokens.pop(i)
                return


class Scheduler:
    """Plans each step from the running and waiting requests (`schedule`) and applies its result (`update`).

    `waiting` and `running` are RequestQueues or queues of the same interface (ordered, O(1) removal by id)
    rather than the deque and list the interface names; they support the same len/iteration/`in` uses.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        max_loras: int | None = None,
        encoder_cache: EncoderCache | None = None,
    ) -> None:
        """`max_loras`: LoRA adapters the running requests may use at once (None: LoRA off). `encoder_cache`: an
        image model's account of the image encodings the runner holds (None: the model takes no images)."""
        self.config = config
        self.encoder_cache = encoder_cache
        self.max_loras = max_loras
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self._by_priority = config.scheduling_policy == "priority"
        self.waiting: InteractiveFirstQueue | PriorityRequestQueue = (
            PriorityRequestQueue() if self._by_priority else InteractiveFirstQueue()
        )
        """Interactive requests before batch ones; within each, arrival order with preempted requests back at the
        front (`fcfs`); or by `priority_key` (`priority`), which puts batch requests last too."""
        self.running = RequestQueue()
        """Admission order: the last one is the newest, the first to be preempted (after any batch request)."""
        self.num_preemptions = 0
        # Whole pages; rounded first so that float noise (0.07 * 100 = 7.000000000000001) does not add a page.
        self._margin_pages = math.ceil(round(config.safety_margin * kv_cache.num_pages, 6))
        self._finished_ids: list[str] = []
        """Finished since the last plan (the runner forgets them)."""
        self._pending: list[StepOutput] = []
        """Final outputs of aborted requests, emitted by the next update()."""
        self._planned: deque[_Planned] = deque()
        """Each plan whose result is not applied yet, oldest first: update() applies a step's result to its
        requests and takes their planned tokens out of flight."""
        self._drafting: set[str] = set()
        """Requests with drafts in flight: not planned again until that result is applied."""
        self._shrunk: dict[str, tuple[int, ...]] = {}
        """Table lengths per group of requests whose rejected drafts' pages went, for the next plan."""

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.running) or bool(self._pending)

    def add(self, request: Request) -> None:
        if request.request_id in self.waiting or request.request_id in self.running:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        params = request.params
        stop_ids = frozenset(params.stop_token_ids)
        request.stop_ids = stop_ids if params.ignore_eos else stop_ids | request.eos_token_ids
        request.max_output_tokens = min(params.max_new_tokens, self.max_model_len - len(request.prompt_ids))
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort(self, request_id: str, error: str | None = None) -> bool:
        """Finish a waiting or running request with ABORT now (its pages free at once); the next update() emits
        its final output, with `error` when given. False (and no effect) for unknown or finished ids."""
        request = self.running.get(request_id) or self.waiting.get(request_id)
        if request is None:
            return False
        self._pending.append(self._aborted(request, error))
        return True

    def _aborted(self, request: Request, error: str | None) -> StepOutput:
        """Finish `request` with ABORT now; its final output, carrying `error`."""
        self._finish(request, FinishReason.ABORT)
        output = _delta(request, [], None, None)
        output.error = error
        return output

    def schedule(
        self, drafts: Mapping[str, Sequence[int]] | None = None, hold: Collection[str] = ()
    ) -> SchedulerOutput:
        """Pick this step's requests and token counts (see the module docstring for the rules).

        `drafts`: proposed next tokens by request id, planned (as many as fit) for running decodes. `hold`: running
        requests with a step in flight not to plan ahead of its result (so that the next plan can give them drafts,
        which only a request with nothing in flight carries)."""
        builder = _StepBuilder(self.config.max_batch_tokens, self.config.max_num_seqs)
        # Under the priority policy the most important running requests get the budget first (batch ones last).
        running = sorted(self.running, key=priority_key) if self._by_priority else list(self.running)
        if self.config.scheduler_policy == "prefill_first":
            self._admit_waiting(builder)
            self._schedule_running(running, builder, drafts or {}, hold)
        else:
            self._schedule_running(running, builder, drafts or {}, hold)
            # Pages just taken from a preempted request go to running ones: admitting now would only thrash.
            if not builder.preempted:
                self._admit_waiting(builder)
        return self._plan(builder)

    def update(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[StepOutput]:
        """Apply a step's result: its tokens now have K/V in the cache, sampled tokens are appended, stop rules
        finish requests (freeing their pages for the next plan). Returns every request's news, aborts included."""
        planned = self._planned.popleft() if self._planned else _Planned([], [], [], [])
        requests = planned.requests
        if len(requests) != len(plan.request_ids):
            raise ValueError("update() takes the results of the plans schedule() returned, oldest first")
        if len(result.token_ids) != plan.num_sampling or len(result.logprobs) != plan.num_sampling:
            raise ValueError(f"the plan samples {plan.num_sampling} requests, the result has other counts")
        outputs, self._pending = self._pending, []
        sampled = zip(result.token_ids, result.logprobs, strict=True)
        now = time.monotonic()
        commit = self.kv_cache.commit  # bound once: this loop is per request
        scored = {entry.request_id: entry for entry in result.prompt_logprobs}
        closed_rows, row = set(result.closed_by_budget), -1
        for request, num_planned, sampling in zip(requests, planned.num_new_tokens, planned.samples, strict=True):
            request.num_in_flight_tokens -= num_planned
            request.num_pending_samples -= sampling
        for request, start, num_new, samples, drafts in zip(
            requests,
            plan.num_computed_tokens,
            plan.num_new_tokens,
            plan.samples,
            plan.draft_token_ids or ((),) * len(requests),
            strict=True,
        ):
            tokens, logprobs = next(sampled) if samples else (None, None)
            row += samples
            if closed_rows and row in closed_rows and samples:
                request.closed_by_budget = True
            if drafts:
                self._drafting.discard(request.request_id)
            # Aborted while the step ran (its pages already free, its final output queued), or, one plan ahead,
            # stopped by the step before: these tokens were never part of it.
            if request.finished:
                continue
            error = result.grammar_errors.get(row) if result.grammar_errors and samples else None
            if error is not None:
                outputs.append(self._aborted(request, error))
                continue
            if tokens is not None and not tokens:
                raise ValueError(f"the result has no token for sampled request {request.request_id!r}")
            accepted = num_accepted(drafts, tokens) if drafts else 0
            # Preempted after this step was planned: its K/V are gone, but the tokens sampled from them are its own.
            if request.status is RequestStatus.RUNNING:
                request.num_computed_tokens += num_new - len(drafts) + accepted
                commit(request)
                if accepted < len(drafts):
                    self._free_rejected(request)
            prompt_logprobs = self._fresh_prompt_logprobs(request, scored.get(request.request_id)) if scored else None
            pooled = result.pooled.get(request.request_id) if result.pooled else None
            if pooled is not None:
                # Its prompt is computed and pooled (preempted after this step was planned or not: the step ran
                # its last chunk over its whole history).
                self._finish(request, FinishReason.STOP)
                output = _delta(request, [], None, None)
                output.pooled = pooled
                outputs.append(output)
                continue
            if tokens is None:
                if prompt_logprobs:
                    outputs.append(_delta(request, [], None, None, prompt_logprobs))
                continue
            # Positions the request knows already (an earlier result brought several tokens) keep their tokens.
            known = len(request.prompt_ids) + len(request.output_ids) - (start + num_new - len(drafts))
            appended = self._append(request, tokens[known:] if known > 0 else tokens)
            if not appended:
                continue
            # A step in flight samples at the end of what it computes: a position this result may have filled.
            if (
                request.num_pending_samples
                and request.num_computed_tokens + request.num_in_flight_tokens < request.num_tokens
                and not request.finished
            ):
                self._void_known_samples(request)
            new_logprobs = None
            if logprobs is not None:
                first = max(0, known)
                new_logprobs = logprobs[first : first + len(appended)]
            timestamps = [now] * len(appended) if request.params.record_timestamps else None
            outputs.append(_delta(request, appended, new_logprobs, timestamps, prompt_logprobs))
        return outputs

    def _append(self, request: Request, tokens: list[int]) -> list[int]:
        """Append `tokens` in order until one stops the request (that one included); returns those appended.

        The stop rules, in order: a stop token (EOS unless ignored, `stop_token_ids`) once `min_new_tokens` are
        out, then `max_new_tokens` or the model length, whichever comes first (`Request.max_output_tokens`)."""
        output_ids = request.output_ids
        for n, token in enumerate(tokens, 1):
            output_ids.append(token)
            if token in request.stop_ids and len(output_ids) >= request.params.min_new_tokens:
                self._finish(request, FinishReason.LENGTH if request.closed_by_budget else FinishReason.STOP)
            elif len(output_ids) >= request.max_output_tokens:
                self._finish(request, FinishReason.LENGTH)
            else:
                continue
            return tokens[:n]
        return tokens

    def _free_rejected(self, request: Request) -> None:
        """Give back the pages that hold only slots of rejected drafts (nothing else of it is in flight)."""
        lengths = self.kv_cache.shrink(request, request.num_computed_tokens + request.num_in_flight_tokens)
        if lengths is not None:
            self._shrunk[request.request_id] = lengths

    def _void_known_samples(self, request: Request) -> None:
        """Planned steps in flight that sample `request` at a position it now knows: their tokens will be dropped,
        so they are no longer pending (the next plan must not wait for them)."""
        for planned in self._planned:
            for j, scheduled in enumerate(planned.requests):
                if (
                    scheduled is request
                    and planned.samples[j]
                    and planned.starts[j] + planned.num_new_tokens[j] < request.num_tokens
                ):
                    planned.samples[j] = False
                    request.num_pending_samples -= 1

    @staticmethod
    def _fresh_prompt_logprobs(request: Request, scored: PromptLogprobs | None) -> list[TokenLogprob] | None:
        """The prompt-token logprobs of this step not reported before (a recompute after preemption repeats
        positions already handed out)."""
        if scored is None:
            return None
        fresh = scored.entries[max(0, request.num_prompt_logprobs + 1 - scored.first_position) :]
        request.num_prompt_logprobs += len(fresh)
        return fresh or None

    # -- internals -----------------------------------------------------------------------------------------------

    def _plan(self, builder: _StepBuilder) -> SchedulerOutput:
        requests = builder.requests
        starts = [r.num_computed_tokens + r.num_in_flight_tokens for r in requests]
        self._planned.append(_Planned(requests, starts, builder.num_new_tokens, list(builder.samples)))
        drafts = builder.drafts
        token_ids = tuple(
            _planned_tokens(r, start, n, drafts.get(r.request_id, ()) if drafts else ())
            for r, start, n in zip(requests, starts, builder.num_new_tokens, strict=True)
        )
        self._drafting.update(drafts)
        for request, num_new, samples in zip(requests, builder.num_new_tokens, builder.samples, strict=True):
            request.num_in_flight_tokens += num_new
            request.num_pending_samples += samples
        finished, self._finished_ids = self._finished_ids, []
        shrunk, self._shrunk = self._shrunk, {}
        return SchedulerOutput(
            request_ids=tuple(r.request_id for r in requests),
            num_computed_tokens=tuple(starts),
            num_new_tokens=tuple(builder.num_new_tokens),
            token_ids=token_ids,
            samples=tuple(builder.samples),
            draft_token_ids=tuple(drafts.get(r.request_id, ()) for r in requests) if drafts else (),
            new_requests=tuple(self._new_request(r) for r in requests if r.request_id in builder.admitted),
            new_pages=tuple((rid, grant) for rid, grant in builder.grants.items() if rid not in builder.admitted),
            shrunk_tables=tuple((rid, lengths) for rid, lengths in shrunk.items() if rid not in builder.admitted),
            preempted_ids=tuple(r.request_id for r in builder.preempted),
            finished_ids=tuple(finished),
            encodes=tuple(builder.encodes),
            freed_encodings=self.encoder_cache.take_freed() if self.encoder_cache is not None else (),
        )

    def _new_request(self, request: Request) -> NewRequest:
        return NewRequest(
            request_id=request.request_id,
            prompt_ids=tuple(request.prompt_ids),
            output_ids=tuple(request.output_ids),
            params=request.params,
            eos_token_ids=request.eos_token_ids,
            generator_seed=request.generator_seed,
            page_tables=self.kv_cache.page_tables(request.request_id),
            noncausal_spans=request.noncausal_spans,
            max_output_tokens=request.max_output_tokens,
            pooling=request.pooling,
            lora=request.lora,
            images=request.images,
            state_slot=self.kv_cache.state_slot(request.request_id),
        )

    def _lora_waits(self, request: Request, adapters: set[int] | None) -> bool:
        """Whether `request` needs an adapter slot none of the running requests' `adapters` leaves free."""
        if adapters is None or request.lora is None or request.lora.lora_id in adapters:
            return False
        return len(adapters) >= (self.max_loras or 0)

    def lora_adapters(self) -> dict[str, tuple[str, ...]]:
        """Names of the adapters running and waiting requests use (the engine's stats)."""
        if self.max_loras is None:
            return {}
        return {
            "running_lora_adapters": _adapter_names(self.running),
            "waiting_lora_adapters": _adapter_names(self.waiting),
        }

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Free the request's pages now, so the next schedule() can admit a waiting request into them."""
        self.running.remove(request.request_id)
        self.waiting.remove(request.request_id)
        self.kv_cache.free(request.request_id)
        self._shrunk.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _schedule_running(
        self,
        requests: list[Request],
        builder: _StepBuilder,
        drafts: Mapping[str, Sequence[int]],
        hold: Collection[str],
    ) -> None:
        """Give each running request (oldest first) its missing tokens, up to the budget left."""
        drafting = self._drafting  # per request below: the common case (no drafts, none held) tests three empties
        for request in requests:
            if builder.full:
                return
            # Preempted earlier in this loop, to make room for an older request; or its drafts are being checked.
            if request.status is not RequestStatus.RUNNING or (drafting and request.request_id in drafting):
                continue
            if hold and request.num_in_flight_tokens and request.request_id in hold:
                continue
            pending = request.num_pending_samples
            # The token being sampled for it now is its last by length: the result finishes it.
            if pending and self._ends_by_length(request, pending):
                continue
            known = len(request.prompt_ids) + len(request.output_ids)
            needed = known + pending - request.num_computed_tokens - request.num_in_flight_tokens
            if needed <= 0 and request.pooling is not None:
                continue  # its whole prompt is in flight: the result of that step finishes it
            if needed <= 0:
                raise RuntimeError(
                    f"running request {request.request_id!r} has nothing to compute: update() must append "
                    "a sampled token or finish it after every step that computes its last token"
                )
            num_new = min(needed, builder.budget)
            start = request.num_computed_tokens + request.num_in_flight_tokens
            # Images first: encoding one may shorten the chunk, which must then still not end inside a span.
            if request.images:
                num_new = self._fit_images(request, start, num_new, builder)
            if num_new and request.noncausal_spans:
                num_new = _within_spans(request, start, num_new)
            if not num_new:
                continue
            proposed = (
                self._plannable_drafts(request, needed, drafts.get(request.request_id, ()), builder.budget)
                if drafts
                else ()
            )
            grant = self._reserve_pages(request, num_new + len(proposed), builder)
            if grant is not None:
                samples = num_new == needed and request.pooling is None
                builder.add(request, num_new + len(proposed), samples, grant)
                if proposed:
                    builder.drafts[request.request_id] = proposed

    @staticmethod
    def _plannable_drafts(request: Request, needed: int, proposed: Sequence[int], budget: int) -> tuple[int, ...]:
        """The drafts this decode can carry: none while anything of it is in flight, and no more than the budget,
        the model length and `max_new_tokens` leave room for (the token sampled after them included)."""
        if not proposed or needed != 1 or request.num_in_flight_tokens or request.num_pending_samples:
            return ()
        room = min(budget - 1, request.max_output_tokens - len(request.output_ids) - 1)
        return tuple(proposed[: max(0, room)])

    @staticmethod
    def _ends_by_length(request: Request, pending: int) -> bool:
        """Whether `pending` tokens still to be applied bring the request to a length stop (see `_append`)."""
        return len(request.output_ids) + pending >= request.max_output_tokens

    def _reserve_pages(self, request: Request, num_new: int, builder: _StepBuilder) -> PageTables | None:
        """Allocate pages for `num_new` more tokens after those in flight, preempting running requests until they
        fit (see `_victim`).

        Returns None when the request had to preempt itself. Terminates: every failed try removes one request
        from `running`, and the request itself is in it.
        """
        while (grant := self.kv_cache.allocate(request, request.num_in_flight_tokens + num_new)) is None:
            victim = self._victim()
            self._preempt(victim, builder)
            if victim is request:
                return None
        return grant

    def _victim(self) -> Request:
        """The running request to preempt next: a batch request before any interactive one, since batch work gives
        way first; within a class, the newest (`fcfs`) or the lowest-priority one, the latest arrival among equals
        (`priority`: the maximum of `priority_key`, whose first field is `batch`)."""
        if self._by_priority:
            return max(self.running, key=priority_key)
        return next((request for request in reversed(self.running) if request.batch), self.running.last())

    def _preempt(self, request: Request, builder: _StepBuilder) -> None:
        self.kv_cache.free(request.request_id)
        self._shrunk.pop(request.request_id, None)  # its table goes whole: no cut of it to send
        self.running.remove(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        if isinstance(self.waiting, PriorityRequestQueue):
            self.waiting.append(request)
        else:
            # Front of its class's queue: it was admitted before everything of its class still waiting. Victims of
            # a class are taken newest first, so several preempted in one step end up in their admission order.
            self.waiting.appendleft(request)
        builder.preempt(request)

    def _admit_waiting(self, builder: _StepBuilder) -> None:
        """Admit waiting requests in order until one does not fit; never skip ahead (no starvation), except past a
        request whose LoRA adapter has no slot while max_loras others run (vLLM's rule: it waits for one of them to
        drain, and requests for the running adapters or the base go ahead meanwhile)."""
        kv = self.kv_cache
        adapters = None if self.max_loras is None else {r.lora.lora_id for r in self.running if r.lora is not None}
        skipped = 0
        while len(self.waiting) > skipped and not builder.full and len(self.running) < self.config.max_num_seqs:
            # The margin keeps room for running sequences to grow; with none running it would only block the
            # queue forever when a first chunk needs more than the pages outside the margin.
            reserve = self._margin_pages if self.running else 0
            # Every admission needs at least one new page (the last token's page is never a prefix hit), so a
            # full cache can stop here without hashing the prompt.
            if kv.num_free_pages - 1 < reserve:
                return
            request = self.waiting.first() if not skipped else next(itertools.islice(self.waiting, skipped, None))
            if self._lora_waits(request, adapters):
                skipped += 1
                continue
            # Preempted while a step computed for it, whose result is not applied yet: its tokens are not all
            # known, so it waits (a step at most) where it is.
            if request.num_in_flight_tokens:
                return
            # Its prefix is being computed right now: wait for it (a step or two) and share it, rather than compute
            # it twice. No skipping ahead, so the queue behind it waits too.
            scores_prompt = request.params.prompt_logprobs is not None or request.pooling is not None
            if not scores_prompt and kv.prefix_in_flight(request):
                return
            # A request scoring its prompt computes all of it: cached positions would have no logits, and a
            # pooling request pools the hidden states of its tokens.
            hit = 0 if scores_prompt else kv.match_prefix(request)
            request.num_computed_tokens = hit
            needed = request.num_tokens - hit
            num_new = min(needed, builder.budget)
            if request.images:
                num_new = self._fit_images(request, hit, num_new, builder)
            if num_new and request.noncausal_spans:
                num_new = _within_spans(request, hit, num_new)
            if not num_new:
                # A span, or an image's encoding, that does not fit this step's budget (or the encoder cache): it
                # waits for a step with room, and so does the queue behind it (no skipping ahead).
                kv.free(request.request_id)
                request.num_computed_tokens = 0
                return
            grant = kv.allocate(request, num_new, keep_free=reserve)
            if grant is None:
                # Give back the prefix pages just matched: holding them while waiting could keep an older
                # request (preempted to the front of the queue) from ever fitting.
                kv.free(request.request_id)
                request.num_computed_tokens = 0
                return
            self.waiting.remove(request.request_id)
            if adapters is not None and request.lora is not None:
                adapters.add(request.lora.lora_id)
            request.status = RequestStatus.RUNNING
            if request.num_preemptions == 0:
                request.num_cached_tokens = hit
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            builder.admitted.add(request.request_id)
            builder.add(request, num_new, num_new == needed and request.pooling is None, grant)

    def _fit_images(self, request: Request, start: int, num_new: int, builder: _StepBuilder) -> int:
        """`num_new` tokens from `start`, cut so that every image the chunk reaches is encoded by this step or
        held: an image not held is encoded now, its length in tokens taken from the step's budget (the encoder's
        work, so a burst of images cannot crowd out decodes), if the budget and the encoder cache have room for it;
        otherwise the chunk stops before it (0 when it starts there). A chunk may end inside an image: the rest of
        its embeddings are held for the next chunk."""
        cache = self.encoder_cache
        assert cache is not None, "a request with images on a model without an encoder cache"
        end = start + num_new
        for image in request.images:
            if image.end <= start:
                continue
            if image.offset >= end:
                break
            content = image.content_hash
            # Held: encoded by an earlier step, or by this one for another request (a hit either way).
            if cache.lookup(content, first_read=image.offset >= start):
                builder.images_read.add(content)
                continue
            before = max(0, image.offset - start)
            room = builder.budget - image.length  # tokens of the chunk the budget leaves once it is encoded
            if room <= before or not cache.admit(content, image.length, lambda: self._images_in_use(builder)):
                return before
            builder.budget -= image.length
            builder.encodes.append(image)
            builder.images_read.add(content)
            end = min(end, start + room)
        return end - start

    def _images_in_use(self, builder: _StepBuilder) -> set[str]:
        """Images whose encodings must stay: those this step reads, and those running requests have yet to
        compute past (a chunked prefill inside an image reads the rest of it later)."""
        in_use = set(builder.images_read)
        for request in self.running:
            in_use.update(i.content_hash for i in request.images if request.num_computed_tokens < i.end)
        return in_use


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))


def _within_spans(request: Request, start: int, num_new: int) -> int:
    """`num_new` tokens from `start`, cut so that the chunk does not end inside one of the request's non-causal
    spans (a span's queries see keys up to its end, which must be computed with them): the chunk stops before
    such a span, 0 when it starts there."""
    end = start + num_new
    for span_start, span_end in request.noncausal_spans:
        if span_start < end < span_end:
            return max(0, span_start - start)
    return num_new


def _planned_tokens(request: Request, start: int, num_new: int, drafts: Sequence[int] = ()) -> list[int]:
    """Tokens [start, start + num_new) of the request, its drafts last; a position it has not sampled yet is a
    PLACEHOLDER."""
    if drafts:
        return request.token_slice(start, start + num_new - len(drafts)) + list(drafts)
    known = len(request.prompt_ids) + len(request.output_ids)
    if start + num_new <= known:
        return request.token_slice(start, start + num_new)
    return request.token_slice(start, known) + [PLACEHOLDER] * (start + num_new - known)


def _delta(
    request: Request,
    tokens: list[int],
    logprobs: list[TokenLogprob] | None,
    timestamps: list[float] | None,
    prompt_logprobs: list[TokenLogprob] | None = None,
) -> StepOutput:
    """One request's news from one step."""
    queue = None
    if len(request.output_ids) == len(tokens) and request.first_scheduled_time is not None:
        queue = request.first_scheduled_time - request.arrival_time
    return StepOutput(
        request_id=request.request_id,
        new_token_ids=tokens,
        finish_reason=request.finish_reason,
        new_logprobs=logprobs,
        new_timestamps=timestamps,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        queue_seconds=queue,
        new_prompt_logprobs=prompt_logprobs,
    )
