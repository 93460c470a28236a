"""Scheduler: budget, chunking, admission, preemption, policies, aborts; a simulated engine drives it."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings, target
from hypothesis import strategies as st

from engine.config import SchedulerConfig
from engine.core.kv_cache import GroupLayout, KVCacheManager
from engine.core.page_pool import PagePool
from engine.core.request import FinishReason, Request, RequestStatus, SamplingParams
from engine.core.scheduler import PriorityRequestQueue, RequestQueue, Scheduler
from engine.core.step import PLACEHOLDER, ModelRunnerOutput, SchedulerOutput

_fresh_bases = itertools.count(1)

MAX_MODEL_LEN = 1 << 20
"""Far beyond any test sequence: requests end by max_new_tokens (LENGTH), never by the model's context length."""


def make_request(request_id: str, prompt: list[int] | int, max_new_tokens: int = 4) -> Request:
    """`prompt` is the token list, or a length (tokens no other request has: no accidental prefix hits)."""
    if isinstance(prompt, int):
        base = next(_fresh_bases) * 100_000
        prompt = list(range(base, base + prompt))
    return Request(
        request_id=request_id,
        prompt_ids=list(prompt),
        params=SamplingParams(max_new_tokens=max_new_tokens),
        eos_token_ids=frozenset({2}),
    )


class LookupCountingKVCache(KVCacheManager):
    """A KV-cache manager that keeps the ids of the requests whose prefix it was asked to match."""

    def __init__(self, layouts: list[GroupLayout], pools: list[PagePool]) -> None:
        super().__init__(layouts, pools)
        self.lookups: list[str] = []

    def match_prefix(self, request: Request) -> int:
        self.lookups.append(request.request_id)
        return super().match_prefix(request)


def make_scheduler(
    num_pages: int = 64,
    page_size: int = 4,
    *,
    caching: bool = True,
    window: int | None = None,
    max_model_len: int = MAX_MODEL_LEN,
    **config: object,
) -> Scheduler:
    pool = PagePool(num_pages, page_size, enable_prefix_caching=caching, sliding_window=window, debug_checks=True)
    kv_cache = LookupCountingKVCache([GroupLayout(window, (0,), 1)], [pool])
    return Scheduler(SchedulerConfig(**config), kv_cache, max_model_len)  # type: ignore[arg-type]


def next_token(request: Request) -> int:
    """Deterministic in the sequence so far: equal prompts generate equal outputs (and share output pages).

    Always 3..9: never the EOS id (2), so requests stop only at max_new_tokens."""
    tokens = request.all_token_ids
    return 3 + (tokens[-1] * 31 + len(tokens)) % 7


def result(*tokens: int) -> ModelRunnerOutput:
    return ModelRunnerOutput([[token] for token in tokens], [None] * len(tokens))


def sample(scheduler: Scheduler, plan: SchedulerOutput) -> ModelRunnerOutput:
    """The model's part of a step: a token for every request that computes its last token, in plan order.

    Computed before update() appends it, from the sequence so far."""
    tokens = []
    for request_id, samples in zip(plan.request_ids, plan.samples, strict=True):
        if samples:
            request = scheduler.running.get(request_id)
            # Aborted since the plan: update() drops its token, any will do.
            tokens.append(3 if request is None else next_token(request))
    return result(*tokens)


def step(scheduler: Scheduler) -> SchedulerOutput:
    plan = scheduler.schedule()
    scheduler.update(plan, sample(scheduler, plan))
    return plan


def planned(plan: SchedulerOutput) -> list[tuple[str, int]]:
    return list(zip(plan.request_ids, plan.num_new_tokens, strict=True))


def table(scheduler: Scheduler, request_id: str) -> list[int]:
    """The request's page table in the scheduler's single pool."""
    (pages,) = scheduler.kv_cache.page_tables(request_id)
    return list(pages)


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> int:
    for steps in range(max_steps):
        if not scheduler.has_unfinished:
            return steps
        step(scheduler)
    raise AssertionError(f"still unfinished after {max_steps} steps")


# -- RequestQueue ---------------------------------------------------------------------------------------------


def test_request_queue_order_and_removal() -> None:
    q = RequestQueue()
    a, b, c = (make_request(x, 2) for x in "abc")
    q.append(a)
    q.append(b)
    q.appendleft(c)
    assert [r.request_id for r in q] == ["c", "a", "b"]
    assert (q.first(), q.last(), len(q)) == (c, b, 3)
    assert "a" in q and a in q and make_request("a", 2) not in q
    assert q.remove("a") is a
    assert q.remove("a") is None
    assert q.popleft() is c
    assert [r.request_id for r in q] == ["b"]


# -- budget and chunking ----------------------------------------------------------------------------------------


def test_long_prompt_is_chunked_across_steps() -> None:
    s = make_scheduler(max_batch_tokens=32)
    r = make_request("r", 100, max_new_tokens=2)
    s.add(r)
    chunks = [planned(step(s)) for _ in range(4)]
    assert chunks == [[("r", 32)], [("r", 32)], [("r", 32)], [("r", 4)]]
    assert r.output_ids and r.num_computed_tokens == 100  # sampled only after the last chunk
    assert planned(step(s)) == [("r", 1)]
    assert r.finished and not s.has_unfinished


def test_budget_is_shared_decodes_first() -> None:
    s = make_scheduler(max_batch_tokens=10)
    a = make_request("a", 3, max_new_tokens=5)
    s.add(a)
    assert planned(step(s)) == [("a", 3)]
    s.add(make_request("b", 20))
    assert planned(step(s)) == [("a", 1), ("b", 9)]
    assert planned(step(s)) == [("a", 1), ("b", 9)]
    assert planned(step(s)) == [("a", 1), ("b", 2)]


def test_max_num_seqs_is_respected() -> None:
    s = make_scheduler(max_num_seqs=2)
    for i in range(5):
        s.add(make_request(f"r{i}", 3, max_new_tokens=3))
    plan = step(s)
    assert planned(plan) == [("r0", 3), ("r1", 3)]
    assert len(s.running) == 2 and len(s.waiting) == 3
    while s.has_unfinished:
        plan = step(s)
        assert len(plan.request_ids) <= 2
        assert len(s.running) <= 2


def test_first_scheduled_time_is_set_once() -> None:
    s = make_scheduler()
    r = make_request("r", 3, max_new_tokens=3)
    s.add(r)
    assert r.first_scheduled_time is None
    step(s)
    first = r.first_scheduled_time
    assert first is not None and first >= r.arrival_time
    step(s)
    assert r.first_scheduled_time == first


# -- admission ----------------------------------------------------------------------------------------------------


def test_finished_slot_is_reused_in_the_next_schedule() -> None:
    s = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 3, max_new_tokens=1), make_request("b", 3)
    s.add(a)
    s.add(b)
    assert planned(step(s)) == [("a", 3)]  # a samples its only token and finishes
    assert a.finish_reason is FinishReason.LENGTH
    assert planned(s.schedule()) == [("b", 3)]


def test_finished_pages_admit_the_next_request_immediately() -> None:
    s = make_scheduler(num_pages=4, page_size=4)
    a, b = make_request("a", 12, max_new_tokens=2), make_request("b", 12)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert planned(plan) == [("a", 12)]  # b needs 3 pages, 1 left
    s.update(plan, result(2))  # a samples EOS: STOP, and its pages are free before the next plan
    assert a.finish_reason is FinishReason.STOP
    assert s.kv_cache.num_free_pages == 4
    assert planned(s.schedule()) == [("b", 12)]


def test_no_skipping_ahead_of_a_request_that_does_not_fit() -> None:
    s = make_scheduler(num_pages=4, page_size=4)
    s.add(make_request("a", 8, max_new_tokens=2))
    s.add(make_request("big", 12))
    s.add(make_request("small", 2))
    assert planned(s.schedule()) == [("a", 8)]  # "small" would fit, but not before "big"
    assert [r.request_id for r in s.waiting] == ["big", "small"]


def test_safety_margin_blocks_admission() -> None:
    s = make_scheduler(num_pages=10, page_size=4, safety_margin=0.5)
    s.add(make_request("a", 7, max_new_tokens=8))
    assert planned(step(s)) == [("a", 7)]  # 2 pages; nothing was running, so the margin did not apply
    s.add(make_request("b", 12))  # 3 pages: 8 - 3 = 5 left, exactly the margin
    s.add(make_request("c", 4))  # 1 more page would leave 4 < 5
    assert planned(step(s)) == [("a", 1), ("b", 12)]  # a's 8th token still fits its second page
    assert [r.request_id for r in s.waiting] == ["c"]
    assert s.kv_cache.num_free_pages == 5


def test_safety_margin_blocks_a_prompt_that_would_cross_it() -> None:
    s = make_scheduler(num_pages=10, page_size=4, safety_margin=0.5)
    s.add(make_request("a", 7, max_new_tokens=8))
    step(s)
    s.add(make_request("big", 16))  # 4 pages would leave 8 - 4 = 4 < 5
    s.add(make_request("small", 4))  # would fit, but may not overtake
    assert planned(step(s)) == [("a", 1)]
    assert [r.request_id for r in s.waiting] == ["big", "small"]
    assert table(s, "big") == []


def test_safety_margin_is_whole_pages_without_float_noise() -> None:
    s = make_scheduler(num_pages=100, page_size=1, safety_margin=0.07)  # 0.07 * 100 == 7.000000000000001
    s.add(make_request("a", 1, max_new_tokens=8))
    step(s)
    s.add(make_request("b", 91))  # leaves exactly 7 pages after a's second token
    assert planned(step(s)) == [("a", 1), ("b", 91)]


def test_margin_does_not_block_an_idle_engine() -> None:
    s = make_scheduler(num_pages=10, page_size=4, safety_margin=0.9)
    s.add(make_request("a", 20, max_new_tokens=1))
    assert planned(s.schedule()) == [("a", 20)]


def test_prefix_hit_at_admission() -> None:
    s = make_scheduler(num_pages=16, page_size=4)
    system = list(range(500, 512))  # three pages
    a = make_request("a", [*system, 1, 2], max_new_tokens=1)
    s.add(a)
    run_to_completion(s)
    b = make_request("b", [*system, 3])
    s.add(b)
    assert planned(s.schedule()) == [("b", 1)]
    assert b.num_cached_tokens == 12 and b.num_computed_tokens == 12
    kv = s.kv_cache
    assert (kv.prefix_queries, kv.prefix_hits) == (14 + 13, 12)


def test_concurrent_requests_share_a_prefix_being_computed() -> None:
    """n choices of one prompt (or one system prompt under load): computed once, then shared."""
    s = make_scheduler(num_pages=32, page_size=4)
    prompt = list(range(700, 718))  # four full pages before the last token's page
    choices = [make_request(f"c{i}", prompt) for i in range(3)]
    for request in choices:
        s.add(request)
    other = make_request("other", 5)
    s.add(other)
    # Only the first computes the prompt; the copies (and, no skipping ahead, the queue behind them) wait.
    assert planned(step(s)) == [("c0", 18)]
    # Its pages are committed: the copies take them and compute only the last, partial page.
    assert planned(step(s)) == [("c0", 1), ("c1", 2), ("c2", 2), ("other", 5)]
    assert choices[1].num_cached_tokens == choices[2].num_cached_tokens == 16
    kv = s.kv_cache
    shared = table(s, "c0")[:4]
    assert table(s, "c1")[:4] == shared == table(s, "c2")[:4]
    run_to_completion(s)
    assert kv.num_free_pages == kv.num_pages


def test_a_preempted_owner_no_longer_holds_back_its_copies() -> None:
    s = make_scheduler(num_pages=32, page_size=4)
    prompt = list(range(800, 818))
    owner, copy = make_request("owner", prompt), make_request("copy", prompt)
    s.add(owner)
    s.schedule()  # admitted: its prompt pages are in flight
    s.add(copy)
    assert s.kv_cache.prefix_in_flight(copy)
    s.abort("owner")
    assert not s.kv_cache.prefix_in_flight(copy)
    assert planned(s.schedule()) == [("copy", 18)]


def test_prompt_fully_cached_still_computes_its_last_token() -> None:
    s = make_scheduler(num_pages=16, page_size=4)
    prompt = list(range(600, 608))
    s.add(make_request("a", prompt, max_new_tokens=1))
    run_to_completion(s)
    b = make_request("b", prompt)
    s.add(b)
    assert planned(s.schedule()) == [("b", 4)]
    assert b.num_cached_tokens == 4


def test_failed_admission_keeps_no_pages_and_counts_once() -> None:
    s = make_scheduler(num_pages=4, page_size=4)
    system = list(range(700, 708))
    s.add(make_request("warm", [*system, 1], max_new_tokens=1))
    run_to_completion(s)  # leaves the system prompt's two pages cached-free
    hog = make_request("hog", 5, max_new_tokens=50)
    s.add(hog)
    step(s)  # hog takes the two free pages; its next 3 tokens fit in them
    kv = s.kv_cache
    counters = (kv.prefix_queries, kv.prefix_hits)
    b = make_request("b", [*system, 1, 2, 3])  # 2 cached pages + 1 new one, and none is left after the hit
    s.add(b)
    for _ in range(3):
        plan = step(s)
        assert planned(plan) == [("hog", 1)]
        assert table(s, "b") == [] and b.num_computed_tokens == 0
    assert (kv.prefix_queries, kv.prefix_hits) == counters
    s.abort("hog")
    assert planned(s.schedule()) == [("b", 3)]
    assert (kv.prefix_queries - counters[0], kv.prefix_hits - counters[1]) == (11, 8)
    assert b.num_cached_tokens == 8


# -- policies ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("fifo", [("a", 1), ("b", 5)]), ("prefill_first", [("b", 5), ("a", 1)])],
)
def test_policy_orders_the_batch(policy: str, expected: list[tuple[str, int]]) -> None:
    s = make_scheduler(scheduler_policy=policy)
    s.add(make_request("a", 3, max_new_tokens=5))
    step(s)
    s.add(make_request("b", 5))
    assert planned(s.schedule()) == expected


def test_prefill_first_gives_the_budget_to_new_prompts() -> None:
    s = make_scheduler(max_batch_tokens=8, scheduler_policy="prefill_first")
    s.add(make_request("a", 3, max_new_tokens=5))
    step(s)
    s.add(make_request("b", 20))
    assert planned(step(s)) == [("b", 8)]  # the running decode waits
    # b is running now: its next chunk and a's decode go in admission order.
    assert planned(step(s)) == [("a", 1), ("b", 7)]


def test_fifo_admits_waiting_in_arrival_order() -> None:
    s = make_scheduler(max_batch_tokens=100)
    for name in ("x", "y", "z"):
        s.add(make_request(name, 4))
    assert list(s.schedule().request_ids) == ["x", "y", "z"]


# -- preemption ---------------------------------------------------------------------------------------------------


def test_preempts_the_newest_and_requeues_it_at_the_front() -> None:
    s = make_scheduler(num_pages=6, page_size=4)
    a, b, c = (make_request(name, 8, max_new_tokens=50) for name in "abc")
    for r in (a, b, c):
        s.add(r)
    step(s)  # 2 pages each: the cache is full
    waiting = make_request("w", 4)
    s.add(waiting)
    outputs_c = list(c.output_ids)
    # Each now decodes its 9th token, which needs a third page: a preempts c, b gets c's second page.
    plan = s.schedule()
    assert plan.preempted_ids == ("c",)
    assert planned(plan) == [("a", 1), ("b", 1)]
    assert c.status is RequestStatus.WAITING
    assert c.num_computed_tokens == 0 and c.output_ids == outputs_c
    assert c.num_preemptions == 1 and s.num_preemptions == 1
    assert table(s, "c") == []
    assert [r.request_id for r in s.waiting] == ["c", "w"]  # ahead of the request already waiting


def test_several_preemptions_keep_admission_order_at_the_front() -> None:
    s = make_scheduler(num_pages=6, page_size=4, max_batch_tokens=12)
    a = make_request("a", 16, max_new_tokens=50)
    b, c = make_request("b", 4, max_new_tokens=50), make_request("c", 4, max_new_tokens=50)
    for r in (a, b, c):
        s.add(r)
    assert planned(step(s)) == [("a", 12)]
    assert planned(step(s)) == [("a", 4), ("b", 4), ("c", 4)]  # all 6 pages in use
    plan = s.schedule()
    # a's 17th token needs a page: c (newest) goes. b then needs a page and is itself the newest.
    assert plan.preempted_ids == ("c", "b")
    assert planned(plan) == [("a", 1)]
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    s.update(plan, sample(s, plan))


def test_self_preemption_when_the_newest_needs_a_page() -> None:
    s = make_scheduler(num_pages=4, page_size=4)
    a = make_request("a", 7, max_new_tokens=50)  # 2 pages, room for one more token in the second
    b = make_request("b", 8, max_new_tokens=50)  # 2 pages, full
    s.add(a)
    s.add(b)
    step(s)
    plan = s.schedule()  # a fits in place; b (the newest) needs a page and can only preempt itself
    assert planned(plan) == [("a", 1)]
    assert plan.preempted_ids == ("b",)
    assert s.waiting.first() is b


def test_no_admission_attempt_in_a_step_that_preempted() -> None:
    s = make_scheduler(num_pages=4, page_size=4)
    a = make_request("a", 8, max_new_tokens=50)
    b = make_request("b", 8, max_new_tokens=50)
    s.add(a)
    s.add(b)
    step(s)
    assert isinstance(s.kv_cache, LookupCountingKVCache)
    s.kv_cache.lookups.clear()
    plan = s.schedule()
    # a took b's pages: b cannot fit again this step, and trying would only re-hash its tokens.
    assert plan.preempted_ids == ("b",)
    assert planned(plan) == [("a", 1)]
    assert s.kv_cache.lookups == []
    assert s.waiting.first() is b


def test_resume_rematches_its_own_pages_and_keeps_generated_tokens() -> None:
    s = make_scheduler(num_pages=5, page_size=4)
    a = make_request("a", 8, max_new_tokens=50)
    b = make_request("b", 8, max_new_tokens=6)
    s.add(a)
    s.add(b)
    step(s)
    first_scheduled = b.first_scheduled_time
    plan = s.schedule()  # a takes the free page, b (newest) preempts itself; its full pages stay cached
    assert plan.preempted_ids == ("b",)
    s.update(plan, sample(s, plan))
    kv = s.kv_cache
    counters = (kv.prefix_queries, kv.prefix_hits)
    s.abort("a")
    plan = s.schedule()
    # 8 prompt tokens come back from the cache; only the generated token needs computing.
    assert planned(plan) == [("b", 1)]
    assert b.num_computed_tokens == 8
    assert b.num_cached_tokens == 0  # usage reports the first admission's hit, not the resume's
    assert (kv.prefix_queries, kv.prefix_hits) == counters
    assert b.first_scheduled_time == first_scheduled
    s.update(plan, sample(s, plan))
    run_to_completion(s)
    assert len(b.output_ids) == 6


def test_prefill_first_preempting_a_request_admitted_in_the_same_step() -> None:
    s = make_scheduler(num_pages=5, page_size=2, max_batch_tokens=6, scheduler_policy="prefill_first")
    a, b = make_request("a", 2, max_new_tokens=50), make_request("b", 6, max_new_tokens=50)
    s.add(a)
    s.add(b)
    assert planned(step(s)) == [("a", 2), ("b", 4)]  # 3 pages; b's prompt continues next step
    w = make_request("w", 4)
    s.add(w)
    plan = s.schedule()
    # w is admitted first, into the last 2 pages. a then needs a page and preempts the newest, w: it leaves
    # the plan and its 4 tokens of budget come back, so b's chunk is not cut short.
    assert plan.preempted_ids == ("w",)
    assert planned(plan) == [("a", 1), ("b", 2)]
    assert plan.num_tokens == 3
    assert s.waiting.first() is w and w.status is RequestStatus.WAITING
    assert table(s, "w") == []
    s.update(plan, sample(s, plan))
    s.kv_cache.check_invariants()


def test_prefill_first_does_not_grow_running_beyond_max_num_seqs() -> None:
    s = make_scheduler(max_num_seqs=2, scheduler_policy="prefill_first")
    s.add(make_request("a", 3, max_new_tokens=50))
    s.add(make_request("b", 3, max_new_tokens=50))
    step(s)
    s.add(make_request("c", 3))
    # Admitting c would push a running decode out of the plan, step after step.
    assert planned(s.schedule()) == [("a", 1), ("b", 1)]
    assert [r.request_id for r in s.waiting] == ["c"]


# -- abort and finish ------------------------------------------------------------------------------------------------


def test_abort_is_idempotent_everywhere() -> None:
    s = make_scheduler(max_num_seqs=1)
    running, waiting = make_request("run", 5), make_request("wait", 5)
    s.add(running)
    s.add(waiting)
    step(s)
    assert table(s, "run")
    assert s.abort("run") is True
    assert running.finish_reason is FinishReason.ABORT and running.finished
    assert table(s, "run") == []
    assert s.abort("run") is False
    assert s.abort("wait") is True
    assert waiting.finish_reason is FinishReason.ABORT
    assert s.abort("wait") is False
    assert s.abort("unknown") is False
    assert not s.running and not s.waiting
    assert s.kv_cache.num_free_pages == s.kv_cache.num_pages
    # Nothing left to run; the aborts' final outputs (once each) come with the next update().
    outputs = s.update(s.schedule(), result())
    assert [(o.request_id, o.finish_reason) for o in outputs] == [
        ("run", FinishReason.ABORT),
        ("wait", FinishReason.ABORT),
    ]
    assert not s.has_unfinished


def test_a_finished_request_keeps_its_first_reason() -> None:
    s = make_scheduler()
    r = make_request("r", 3)
    s.add(r)
    step(s)
    s.update(s.schedule(), result(2))  # EOS
    assert r.finish_reason is FinishReason.STOP
    assert s.abort("r") is False
    assert r.finish_reason is FinishReason.STOP
    # The other way round: aborted while its step ran, the step's EOS does not turn it into STOP.
    q = make_request("q", 3)
    s.add(q)
    plan = s.schedule()
    assert s.abort("q") is True
    s.update(plan, result(2))
    assert q.finish_reason is FinishReason.ABORT and q.output_ids == []


def test_abort_between_schedule_and_update() -> None:
    s = make_scheduler()
    r, other = make_request("r", 6), make_request("other", 6)
    s.add(r)
    s.add(other)
    plan = s.schedule()
    s.abort("r")
    s.update(plan, sample(s, plan))
    assert other.num_computed_tokens == 6
    s.kv_cache.check_invariants()


def test_duplicate_id_is_rejected() -> None:
    s = make_scheduler()
    s.add(make_request("r", 3))
    with pytest.raises(ValueError):
        s.add(make_request("r", 3))


def test_a_result_without_the_sampled_token_is_a_loud_error() -> None:
    s = make_scheduler()
    s.add(make_request("r", 3))
    plan = s.schedule()
    assert plan.samples == (True,)
    with pytest.raises(ValueError, match="the plan samples 1 requests"):
        s.update(plan, result())  # the engine "forgets" to sample


def test_running_request_without_work_is_a_loud_error() -> None:
    s = make_scheduler()
    r = make_request("r", 3)
    s.add(r)
    plan = s.schedule()
    # The engine "forgets" to sample, and so does the plan it hands back: the counts agree, no token comes.
    s.update(dataclasses.replace(plan, samples=(False,)), result())
    assert r.num_computed_tokens == r.num_tokens
    with pytest.raises(RuntimeError, match="nothing to compute"):
        s.schedule()


def test_request_larger_than_the_cache_does_not_hang_schedule() -> None:
    s = make_scheduler(num_pages=2, page_size=4, max_batch_tokens=4)
    huge = make_request("huge", 20)
    s.add(huge)
    for _ in range(5):  # each call returns; the core rejects such requests at submission
        plan = step(s)
        assert plan.num_tokens <= 4
    s.kv_cache.check_invariants()


# -- page sizes and sliding window ------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16, 256])
def test_page_sizes_end_to_end(page_size: int) -> None:
    num_pages = 4096 // page_size + 2
    s = make_scheduler(num_pages, page_size, max_batch_tokens=64, max_num_seqs=8)
    shared = list(range(2000, 2300))
    requests = [make_request(f"r{i}", [*shared, i], max_new_tokens=5 + i) for i in range(12)]
    for r in requests:
        s.add(r)
    run_to_completion(s)
    assert all(len(r.output_ids) == r.params.max_new_tokens for r in requests)
    kv = s.kv_cache
    assert kv.num_free_pages == kv.num_pages
    assert kv.prefix_hits > 0


def test_sliding_window_keeps_memory_bounded() -> None:
    s = make_scheduler(num_pages=6, page_size=4, window=8, max_batch_tokens=8)
    r = make_request("r", 8, max_new_tokens=60)  # 68 tokens would need 17 pages without the window
    s.add(r)
    while s.has_unfinished:
        step(s)
        if not r.finished:
            pages = table(s, "r")
            released = max(0, r.num_computed_tokens - 8) // 4
            assert pages[:released] == [-1] * released
            assert all(p >= 0 for p in pages[released:])
            assert len(pages) - released <= 4
    assert len(r.output_ids) == 60
    assert s.kv_cache.num_free_pages == 6


# -- random property test -----------------------------------------------------------------------------------------


@dataclass
class KVOracle:
    """What the model would have written to each cache slot: the identity of the whole prefix at that position.

    Reading a slot that holds another prefix means a paging bug: a shared page with different content, a page
    reused while still referenced, a wrong prefix hit.
    """

    page_size: int
    window: int | None
    slots: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)

    def run(self, scheduler: Scheduler, plan: SchedulerOutput, requests: dict[str, Request]) -> None:
        ps = self.page_size
        for i, (request_id, n) in enumerate(zip(plan.request_ids, plan.num_new_tokens, strict=True)):
            request = requests[request_id]
            pages = table(scheduler, request_id)
            start = request.num_computed_tokens
            tokens = request.all_token_ids
            # What the runner computes is what the plan says.
            assert plan.num_computed_tokens[i] == start
            assert list(plan.token_ids[i]) == tokens[start : start + n]
            assert len(pages) * ps >= start + n
            first_read = 0 if self.window is None else max(0, start - self.window)
            for pos in range(first_read, start):
                page = pages[pos // ps]
                assert page >= 0, f"{request.request_id}: position {pos} is still in the window"
                assert self.slots.get((page, pos % ps)) == tuple(tokens[: pos + 1]), (
                    f"{request.request_id}: wrong K/V at position {pos} (page {page})"
                )
            for pos in range(start, start + n):
                self.slots[(pages[pos // ps], pos % ps)] = tuple(tokens[: pos + 1])


def check_step(s: Scheduler, plan: SchedulerOutput, requests: dict[str, Request]) -> None:
    cfg = s.config
    assert plan.num_tokens <= cfg.max_batch_tokens
    assert len(plan.request_ids) <= cfg.max_num_seqs
    assert len(s.running) <= cfg.max_num_seqs
    assert len(set(plan.request_ids)) == len(plan.request_ids)
    for request_id, n in zip(plan.request_ids, plan.num_new_tokens, strict=True):
        request = requests[request_id]
        assert request.status is RequestStatus.RUNNING and request in s.running
        assert 1 <= n <= request.num_tokens - request.num_computed_tokens
    for request in s.running:
        assert request.status is RequestStatus.RUNNING
    for request in s.waiting:
        assert request.status is RequestStatus.WAITING
        assert request.num_computed_tokens == 0
        assert table(s, request.request_id) == []
    s.kv_cache.check_invariants()


# Shared prefixes first: generation favours (and shrinking moves towards) the first entry.
PREFIXES = [list(range(11, 28)), [11, 12, 13, 14, 15, 16, 17, 18], [11, 12, 13, 14, 21, 22], [30] * 9, []]
suffixes = st.lists(st.integers(3, 5), max_size=8)

new_request = st.tuples(st.just("add"), st.sampled_from(range(len(PREFIXES))), suffixes, st.integers(1, 12))
operation = st.one_of(
    new_request,
    # A multi-turn follow-up: an earlier request's prompt and output so far, then more tokens (maybe none).
    st.tuples(st.just("follow_up"), st.integers(0, 40), suffixes, st.integers(1, 8)),
    # The same prompt again: every page but the last token's is a prefix hit.
    st.tuples(st.just("repeat"), st.integers(0, 40), st.just([]), st.integers(1, 8)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
)


def play(
    s: Scheduler,
    operations: list[tuple],
    run_step: Callable[[], None],
    by_id: dict[str, Request],
    *,
    priorities: bool = False,
) -> tuple[list[Request], set[str]]:
    """Apply the generated operations (adds, follow-ups, repeats, steps, aborts), then step until every request
    finished; returns the requests submitted (also put in `by_id`) and the ids aborted."""
    submitted: list[Request] = []
    aborted: set[str] = set()
    for op in operations:
        if op[0] in ("add", "follow_up", "repeat"):
            _, which, suffix, max_new = op
            if op[0] == "add":
                prompt = PREFIXES[which] + suffix
            elif not submitted:
                continue
            elif op[0] == "follow_up":
                prompt = submitted[which % len(submitted)].all_token_ids + suffix
            else:
                prompt = list(submitted[which % len(submitted)].prompt_ids)
            request = make_request(f"r{len(submitted)}", prompt, max_new_tokens=max_new)
            if priorities:
                request.priority = len(submitted) * 7 % 3 - 1  # -1, 1, 0, -1, ...: every order of arrivals
            # What the core rejects at submission: an empty prompt, more pages than the whole cache.
            if not prompt or not s.kv_cache.fits(len(prompt) + max_new):
                continue
            s.add(request)
            submitted.append(request)
            by_id[request.request_id] = request
        elif op[0] == "step":
            for _ in range(op[1]):
                run_step()
        elif submitted:
            victim = submitted[op[1] % len(submitted)]
            if s.abort(victim.request_id):
                aborted.add(victim.request_id)
            assert victim.finished
    for _ in range(5_000):
        if not s.has_unfinished:
            break
        run_step()
    assert not s.has_unfinished, "requests left unfinished: deadlock or starvation"
    return submitted, aborted


@settings(max_examples=200, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    cache_tokens=st.integers(16, 64),
    max_batch_tokens=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
    policy=st.sampled_from(["fifo", "prefill_first"]),
    scheduling=st.sampled_from(["fcfs", "priority"]),
    safety_margin=st.sampled_from([0.0, 0.1, 0.3]),
    caching=st.booleans(),
    window=st.sampled_from([None, 1, 3, 5, 8]),
    # A burst of requests up front, so that nearly every example has several in flight and memory pressure.
    burst=st.lists(new_request, min_size=3, max_size=8),
    operations=st.lists(operation, max_size=40),
)
def test_random_workloads_keep_invariants_and_finish(
    page_size: int,
    cache_tokens: int,
    max_batch_tokens: int,
    max_num_seqs: int,
    policy: str,
    scheduling: str,
    safety_margin: float,
    caching: bool,
    window: int | None,
    burst: list[tuple],
    operations: list[tuple],
) -> None:
    # Sized in tokens, so that every page size sees the same memory pressure (and preemptions).
    num_pages = -(-cache_tokens // page_size)
    s = make_scheduler(
        num_pages,
        page_size,
        caching=caching,
        window=window,
        max_batch_tokens=max_batch_tokens,
        max_num_seqs=max_num_seqs,
        scheduler_policy=policy,
        scheduling_policy=scheduling,
        safety_margin=safety_margin,
    )
    kv = s.kv_cache
    oracle = KVOracle(page_size, window)
    by_id: dict[str, Request] = {}

    def run_step() -> None:
        plan = s.schedule()
        check_step(s, plan, by_id)
        if s.running or s.waiting:
            assert plan.request_ids, "no progress with work pending"
        oracle.run(s, plan, by_id)
        s.update(plan, sample(s, plan))
        check_step(s, SchedulerOutput(), by_id)

    submitted, aborted = play(s, [*burst, *operations], run_step, by_id, priorities=scheduling == "priority")
    # Steer the search towards the interesting cases.
    target(float(s.num_preemptions), label="preemptions")
    target(float(kv.prefix_hits), label="prefix hits")

    for request in submitted:
        assert request.finished
        if request.request_id in aborted:
            assert request.finish_reason is FinishReason.ABORT
        else:
            assert request.finish_reason is FinishReason.LENGTH
            assert len(request.output_ids) == request.params.max_new_tokens
    assert kv.num_free_pages == kv.num_pages
    assert kv.usage == 0.0
    kv.check_invariants()
    admitted = [r for r in submitted if r.first_scheduled_time is not None]
    if caching:
        assert kv.prefix_queries == sum(r.num_prompt_tokens for r in admitted)
        assert kv.prefix_hits == sum(r.num_cached_tokens for r in admitted)
    else:
        assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)
    for request in admitted:
        assert request.num_cached_tokens < request.num_prompt_tokens


# -- stop rules: update() finishes requests -------------------------------------------------------------------


def _decode_with(s: Scheduler, tokens: list[int]) -> list[list]:
    """Feed `tokens` to the single running request, one per step; each step's outputs."""
    steps = []
    for token in tokens:
        plan = s.schedule()
        steps.append(s.update(plan, ModelRunnerOutput([[token]] * plan.num_sampling, [None] * plan.num_sampling)))
    return steps


@pytest.mark.parametrize(
    ("params", "tokens", "reason", "generated"),
    [
        (SamplingParams(max_new_tokens=5), [7, 2], FinishReason.STOP, 2),  # EOS
        (SamplingParams(max_new_tokens=5, ignore_eos=True), [2, 2, 2, 2, 2], FinishReason.LENGTH, 5),
        (SamplingParams(max_new_tokens=5, stop_token_ids=(9,)), [7, 9], FinishReason.STOP, 2),
        # EOS before min_new_tokens does not stop (the sampler bans it; update must not stop on it either).
        (SamplingParams(max_new_tokens=5, min_new_tokens=3), [2, 2, 2], FinishReason.STOP, 3),
        (SamplingParams(max_new_tokens=3), [7, 7, 7], FinishReason.LENGTH, 3),
    ],
)
def test_update_applies_every_stop_rule(
    params: SamplingParams, tokens: list[int], reason: FinishReason, generated: int
) -> None:
    s = make_scheduler()
    request = Request("r", [5, 6, 7], params, frozenset({2}))
    s.add(request)
    steps = _decode_with(s, tokens)
    assert request.finish_reason is reason and len(request.output_ids) == generated
    assert [out.finished for outs in steps for out in outs] == [False] * (generated - 1) + [True]
    assert not s.has_unfinished and s.kv_cache.all_free()


def test_update_stops_at_the_model_length() -> None:
    s = make_scheduler(max_model_len=6)
    request = Request("r", [5, 6, 7, 8], SamplingParams(max_new_tokens=50), frozenset({2}))
    s.add(request)
    _decode_with(s, [7, 7])
    assert request.finish_reason is FinishReason.LENGTH and request.num_tokens == 6


# -- priority scheduling ----------------------------------------------------------------------------------------


def _with_priority(request_id: str, prompt: int, priority: int, max_new_tokens: int = 4) -> Request:
    request = make_request(request_id, prompt, max_new_tokens)
    request.priority = priority
    return request


def test_priority_orders_admission_and_ties_keep_arrival_order() -> None:
    s = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
    for request in (_with_priority("low", 4, 5), _with_priority("high", 4, -1), _with_priority("mid", 4, 0)):
        s.add(request)
    s.add(_with_priority("mid-later", 4, 0))
    assert [r.request_id for r in s.waiting] == ["high", "mid", "mid-later", "low"]
    admitted = []
    while s.has_unfinished:
        plan = step(s)
        admitted += [r.request_id for r in plan.new_requests]
    assert admitted == ["high", "mid", "mid-later", "low"]


def test_fcfs_ignores_priorities_it_was_not_asked_for() -> None:
    s = make_scheduler(max_num_seqs=1)
    s.add(_with_priority("first", 4, 5))
    s.add(_with_priority("second", 4, -1))
    assert [r.request_id for r in s.waiting] == ["first", "second"]


def test_priority_preempts_the_least_important_running_request() -> None:
    # 6 pages of 4 tokens: three 8-token prompts fill 6 pages; the next decode needs a page, someone must go.
    s = make_scheduler(num_pages=6, page_size=4, scheduling_policy="priority")
    requests = [_with_priority("a", 8, 1, 50), _with_priority("b", 8, 9, 50), _with_priority("c", 8, 0, 50)]
    for request in requests:
        s.add(request)
    step(s)
    assert {r.request_id for r in s.running} == {"a", "b", "c"}
    plan = s.schedule()
    # fcfs would preempt the newest (c); priority preempts b, the least important, although it is older than c.
    assert plan.preempted_ids == ("b",)
    assert s.waiting.first() is requests[1]
    assert [rid for rid, _ in planned(plan)] == ["c", "a"], "the running requests are served by priority"


def test_a_preempted_request_returns_ahead_of_later_arrivals_of_its_priority() -> None:
    q = PriorityRequestQueue()
    early, late, urgent = _with_priority("early", 4, 3), _with_priority("late", 4, 3), _with_priority("urgent", 4, 1)
    late.arrival_time, early.arrival_time = early.arrival_time + 1.0, early.arrival_time
    q.append(late)
    q.append(urgent)
    q.append(early)  # preempted: it arrived before `late`
    assert [r.request_id for r in q] == ["urgent", "early", "late"]
    assert q.remove("early") is early and q.remove("early") is None
    assert "late" in q and early not in q and len(q) == 2
    assert q.popleft() is urgent and q.first() is late is q.last()


# -- async scheduling: plans one step ahead of results ------------------------------------------------------------


class LaggingRunner:
    """A simulated runner one step behind the scheduler, as under async scheduling: it keeps each sequence's
    tokens from its own samples, fills PLACEHOLDERs from them, and checks every K/V slot it reads was written for
    the same prefix (a slot holds the whole prefix it was computed for)."""

    def __init__(self, scheduler: Scheduler, requests: dict[str, Request]) -> None:
        self.scheduler = scheduler
        self.requests = requests
        self.seqs: dict[str, list[int]] = {}
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.tables: dict[str, list[int]] = {}

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in (*plan.preempted_ids, *plan.finished_ids):
            self.seqs.pop(request_id, None)
            self.tables.pop(request_id, None)
        for new in plan.new_requests:
            self.seqs[new.request_id] = [*new.prompt_ids, *new.output_ids]
            self.tables[new.request_id] = list(new.page_tables[0])
        for request_id, grant in plan.new_pages:
            self.tables[request_id] += grant[0]
        ps = self.scheduler.kv_cache.pools[0].page_size
        tokens = []
        for i, request_id in enumerate(plan.request_ids):
            seq, pages = self.seqs[request_id], self.tables[request_id]
            start, n = plan.num_computed_tokens[i], plan.num_new_tokens[i]
            planned_ids = [seq[start + k] if t == PLACEHOLDER else t for k, t in enumerate(plan.token_ids[i])]
            assert planned_ids == seq[start : start + n], f"{request_id}: the plan's tokens are not the sequence's"
            for pos in range(start):
                if pages[pos // ps] >= 0:
                    assert self.slots.get((pages[pos // ps], pos % ps)) == tuple(seq[: pos + 1]), (
                        f"{request_id}: wrong K/V at position {pos}"
                    )
            for pos in range(start, start + n):
                self.slots[(pages[pos // ps], pos % ps)] = tuple(seq[: pos + 1])
            if plan.samples[i]:
                token = 3 + (seq[-1] * 31 + len(seq)) % 7  # next_token() of the runner's own sequence
                seq.append(token)
                tokens.append(token)
        return result(*tokens)


def expected_output(prompt: list[int], max_new_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_new_tokens):
        seq.append(3 + (seq[-1] * 31 + len(seq)) % 7)
    return seq[len(prompt) :]


@settings(max_examples=150, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    cache_tokens=st.integers(16, 64),
    max_batch_tokens=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
    policy=st.sampled_from(["fifo", "prefill_first"]),
    caching=st.booleans(),
    burst=st.lists(new_request, min_size=3, max_size=8),
    operations=st.lists(operation, max_size=30),
)
def test_planning_one_step_ahead_keeps_invariants_and_outputs(
    page_size: int,
    cache_tokens: int,
    max_batch_tokens: int,
    max_num_seqs: int,
    policy: str,
    caching: bool,
    burst: list[tuple],
    operations: list[tuple],
) -> None:
    """Each step is planned before the result of the one before it is applied: every request still ends with
    exactly the tokens it gets planned one step at a time, every K/V read was written for the same prefix, and
    every page comes back."""
    s = make_scheduler(
        -(-cache_tokens // page_size),
        page_size,
        caching=caching,
        max_batch_tokens=max_batch_tokens,
        max_num_seqs=max_num_seqs,
        scheduler_policy=policy,
    )
    by_id: dict[str, Request] = {}
    runner = LaggingRunner(s, by_id)
    in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []

    def run_step() -> None:
        plan = s.schedule()
        for request_id, n in zip(plan.request_ids, plan.num_new_tokens, strict=True):
            assert by_id[request_id].status is RequestStatus.RUNNING and n >= 1
        assert plan.num_tokens <= max_batch_tokens
        if in_flight:
            s.update(*in_flight.pop())
        in_flight.append((plan, runner.execute(plan)))
        s.kv_cache.check_invariants()

    submitted, aborted = play(s, [*burst, *operations], run_step, by_id)
    if in_flight:
        s.update(*in_flight.pop())
    target(float(s.num_preemptions), label="preemptions")
    for request in submitted:
        assert request.finished
        assert request.num_in_flight_tokens == 0 and request.num_pending_samples == 0
        if request.request_id not in aborted:
            assert request.finish_reason is FinishReason.LENGTH
            assert request.output_ids == expected_output(request.prompt_ids, request.params.max_new_tokens)
    assert s.kv_cache.num_free_pages == s.kv_cache.num_pages
    s.kv_cache.check_invariants()


def test_a_decode_planned_ahead_is_a_placeholder_and_a_stop_drops_one_token() -> None:
    s = make_scheduler()
    r = make_request("r", 3, max_new_tokens=10)
    s.add(r)
    prefill = s.schedule()
    decode = s.schedule()  # planned while the prefill runs
    assert planned(decode) == [("r", 1)]
    assert decode.num_computed_tokens == (3,) and list(decode.token_ids[0]) == [PLACEHOLDER]
    s.update(prefill, result(2))  # EOS: r stops; the decode planned after it computes a token for nothing
    assert r.finished and r.output_ids == [2]
    assert s.update(decode, result(5)) == []
    assert r.output_ids == [2]
    assert s.schedule().finished_ids == ("r",)


def test_a_request_whose_pending_token_is_its_last_gets_no_step_ahead() -> None:
    s = make_scheduler()
    r = make_request("r", 3, max_new_tokens=1)
    s.add(r)
    prefill = s.schedule()
    assert s.schedule().request_ids == ()
    s.update(prefill, result(7))
    assert r.finish_reason is FinishReason.LENGTH and r.output_ids == [7]


def test_a_request_preempted_while_its_step_runs_keeps_the_token_it_sampled() -> None:
    s = make_scheduler(num_pages=3, page_size=4, max_batch_tokens=64)
    old, new = make_request("old", 4, max_new_tokens=8), make_request("new", 7, max_new_tokens=8)
    s.add(old)
    s.add(new)
    first = s.schedule()  # both prefill: 1 + 2 of the 3 pages
    assert planned(first) == [("old", 4), ("new", 7)]
    second = s.schedule()  # old's decode needs a second page: the newest request gives its pages back
    assert second.preempted_ids == ("new",) and planned(second) == [("old", 1)]
    s.update(first, result(5, 6))
    assert new.status is RequestStatus.WAITING and new.output_ids == [6] and new.num_computed_tokens == 0
    s.update(second, result(4))
    assert old.output_ids == [5, 4]


def _stop_reference(truth: list[int], params: SamplingParams, prompt_len: int, max_model_len: int) -> list[int]:
    """The tokens a request keeps out of its model's stream: each in turn through EOS (2), stop ids,
    `min_new_tokens`, `max_new_tokens` and the model length, up to and including the one that stops it."""
    for n, token in enumerate(truth, 1):
        stops = n >= params.min_new_tokens and (token == 2 or token in params.stop_token_ids)
        if stops or n >= params.max_new_tokens or prompt_len + n >= max_model_len:
            return truth[:n]
    raise AssertionError("the stream is longer than any request")


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    num_requests=st.integers(1, 4),
    ahead=st.booleans(),
    use_drafts=st.booleans(),
    num_pages=st.integers(8, 40),
)
def test_update_appends_several_tokens_by_the_stop_rules(
    data: st.DataObject, num_requests: int, ahead: bool, use_drafts: bool, num_pages: int
) -> None:
    """Results of 1..4 tokens (the model's stream from the sampled position on), drafts accepted in part, plans
    one step ahead or not: every request ends with its stream cut by the stop rules, pages all given back."""
    max_model_len = 40
    s = make_scheduler(num_pages, 4, max_model_len=max_model_len, max_batch_tokens=16)
    truths: dict[str, list[int]] = {}
    prompts: dict[str, int] = {}
    params_of: dict[str, SamplingParams] = {}
    for i in range(num_requests):
        params = SamplingParams(
            max_new_tokens=data.draw(st.integers(1, 12)),
            min_new_tokens=data.draw(st.integers(0, 3)),
            stop_token_ids=tuple(data.draw(st.lists(st.integers(2, 9), max_size=2))),
        )
        request = make_request(f"r{i}", data.draw(st.integers(1, 20)))
        request.params = params
        truths[request.request_id] = data.draw(st.lists(st.integers(2, 9), min_size=60, max_size=60))
        prompts[request.request_id] = request.num_prompt_tokens
        params_of[request.request_id] = params
        s.add(request)
    outputs: dict[str, list[int]] = {rid: [] for rid in truths}
    finish: dict[str, FinishReason] = {}

    def run(plan: SchedulerOutput) -> ModelRunnerOutput:
        tokens = []
        for i, (rid, sampled) in enumerate(zip(plan.request_ids, plan.samples, strict=True)):
            if not sampled:
                continue
            drafts = plan.drafts(i)
            first = plan.num_computed_tokens[i] + plan.num_new_tokens[i] - len(drafts) - prompts[rid]
            stream = truths[rid][first:]
            if drafts:
                accepted = next((k for k, d in enumerate(drafts) if d != stream[k]), len(drafts))
                tokens.append(stream[: accepted + 1])
            else:
                tokens.append(stream[: data.draw(st.integers(1, 4))])
        return ModelRunnerOutput(tokens, [None] * len(tokens))

    def apply(plan: SchedulerOutput) -> None:
        for out in s.update(plan, run(plan)):
            outputs[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason

    def drafts() -> dict[str, list[int]]:
        if not use_drafts:
            return {}
        proposed = {}
        for request in s.running:
            # A draft of the true continuation with maybe one wrong token.
            start = len(request.output_ids)
            guess = list(truths[request.request_id][start : start + data.draw(st.integers(0, 3))])
            if guess and data.draw(st.booleans()):
                guess[data.draw(st.integers(0, len(guess) - 1))] = 1  # never in a stream
            proposed[request.request_id] = guess
        return proposed

    in_flight: SchedulerOutput | None = None
    for _ in range(400):
        if not s.has_unfinished:
            if in_flight is not None:
                apply(in_flight)
            break
        plan = s.schedule(drafts())
        if ahead:
            if in_flight is not None:
                apply(in_flight)
            in_flight = plan
        else:
            apply(plan)
        s.kv_cache.check_invariants()
        for request in s.running:
            assert request.num_computed_tokens <= request.num_tokens
    else:
        raise AssertionError("the requests did not finish")
    for rid, truth in truths.items():
        assert outputs[rid] == _stop_reference(truth, params_of[rid], prompts[rid], max_model_len), rid
        assert finish[rid] in (FinishReason.STOP, FinishReason.LENGTH)
    assert s.kv_cache.all_free()
