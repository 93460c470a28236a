"""Batch requests (the Batch API's lines) wait behind every interactive request and are preempted first, under
both scheduling policies; without batch requests the scheduler's order is exactly what it was. Asserted by what
is scheduled in which step, never by timing. Only the batch runner (through the ASGI scope) marks a call as batch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi import Request as HTTPRequest
from hypothesis import given, settings, target
from hypothesis import strategies as st

from engine import EngineConfig, EngineCore, SamplingParams
from engine.core.request import Request, StepOutput
from engine.core.scheduler import InteractiveFirstQueue, PriorityRequestQueue, RequestQueue, Scheduler
from engine.core.step import SchedulerOutput
from server.openai.generation import BATCH_SCOPE_KEY, is_batch
from tests.test_scheduler import make_request, make_scheduler, planned, sample, step


def _request(
    request_id: str, prompt: int | list[int], *, batch: bool = False, priority: int = 0, max_new: int = 4
) -> Request:
    request = make_request(request_id, prompt, max_new_tokens=max_new)
    request.batch = batch
    request.priority = priority
    return request


def _first_admissions(s: Scheduler, max_steps: int = 1_000) -> list[str]:
    """Step until every request finished; the ids in the order they were first scheduled."""
    order: list[str] = []
    for _ in range(max_steps):
        if not s.has_unfinished:
            return order
        order += [r.request_id for r in step(s).new_requests if r.request_id not in order]
    raise AssertionError(f"still unfinished after {max_steps} steps")


# -- waiting queue: interactive requests are taken first ----------------------------------------------------------


def test_fcfs_admits_a_later_interactive_request_before_waiting_batch_ones() -> None:
    s = make_scheduler(max_num_seqs=1)
    for i in range(3):
        s.add(_request(f"b{i}", 4, batch=True))
    assert planned(step(s)) == [("b0", 4)]
    s.add(_request("i", 4))
    assert [r.request_id for r in s.waiting] == ["i", "b1", "b2"]
    assert _first_admissions(s) == ["i", "b1", "b2"]


def test_fcfs_admits_interactive_before_batch_within_one_step() -> None:
    s = make_scheduler(max_batch_tokens=8)  # room for two 4-token prompts a step
    s.add(_request("b0", 4, batch=True))
    s.add(_request("b1", 4, batch=True))
    s.add(_request("i0", 4))
    s.add(_request("i1", 4))
    assert planned(s.schedule()) == [("i0", 4), ("i1", 4)]


def test_priority_admits_interactive_before_batch_whatever_their_priorities() -> None:
    s = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
    for request_id, priority in (("bA", -5), ("bB", 0), ("bC", -1)):
        s.add(_request(request_id, 4, batch=True, priority=priority))
    assert planned(step(s)) == [("bA", 4)]
    s.add(_request("i-low", 4, priority=3))
    s.add(_request("i-high", 4, priority=1))
    # Interactive ones by priority, then batch ones by priority: a batch priority never outranks the class.
    assert [r.request_id for r in s.waiting] == ["i-high", "i-low", "bC", "bB"]
    assert _first_admissions(s) == ["i-high", "i-low", "bC", "bB"]


# -- preemption: a batch request goes first ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_batch_request_is_preempted_before_a_newer_less_important_interactive_one(policy: str) -> None:
    # 6 pages of 4 tokens. a and b (batch, the most important by number) run first, c is admitted later; then a
    # needs a page with none free. Plain fcfs would preempt c (the newest), plain priority c (the least important).
    s = make_scheduler(num_pages=6, page_size=4, scheduling_policy=policy)
    s.add(_request("a", 7, priority=0, max_new=50))
    s.add(_request("b", 7, batch=True, priority=-9, max_new=50))
    assert planned(step(s)) == [("a", 7), ("b", 7)]
    s.add(_request("c", 8, priority=9, max_new=50))
    assert planned(step(s)) == [("a", 1), ("b", 1), ("c", 8)]  # all 6 pages in use
    s.add(_request("w", 4))
    plan = s.schedule()
    assert plan.preempted_ids == ("b",)
    assert planned(plan) == [("a", 1), ("c", 1)]
    # Back in the queue behind the interactive request already waiting.
    assert [r.request_id for r in s.waiting] == ["w", "b"]


def test_fcfs_a_batch_request_needing_a_page_preempts_itself_not_a_newer_interactive_one() -> None:
    s = make_scheduler(num_pages=4, page_size=4)
    s.add(_request("b", 7, batch=True, max_new=50))  # 2 pages: its 9th token needs a third
    assert planned(step(s)) == [("b", 7)]
    s.add(_request("a", 5, max_new=50))  # 2 pages, room for 3 more tokens in the second
    s.add(_request("w", 4))
    assert planned(step(s)) == [("b", 1), ("a", 5)]  # all 4 pages in use: w waits
    plan = step(s)
    # b needs a page and none is free: plain fcfs would preempt a (the newest); the batch request gives way.
    assert plan.preempted_ids == ("b",)
    assert planned(plan) == [("a", 1)]
    assert [r.request_id for r in s.waiting] == ["w", "b"]


def test_fcfs_batch_victims_go_newest_first_and_return_in_admission_order() -> None:
    s = make_scheduler(num_pages=8, page_size=4)
    s.add(_request("b0", 7, batch=True, max_new=50))
    s.add(_request("b1", 7, batch=True, max_new=50))
    assert planned(step(s)) == [("b0", 7), ("b1", 7)]
    s.add(_request("i0", 7, max_new=50))
    s.add(_request("i1", 7, max_new=50))
    assert planned(step(s)) == [("b0", 1), ("b1", 1), ("i0", 7), ("i1", 7)]  # all 8 pages in use
    # b0 needs a page: b1 goes (the newest batch request; plain fcfs would take i1's).
    plan = step(s)
    assert plan.preempted_ids == ("b1",)
    assert planned(plan) == [("b0", 1), ("i0", 1), ("i1", 1)]
    # i0 takes the last free page; i1 needs one: b0 goes, the last batch request running.
    plan = step(s)
    assert plan.preempted_ids == ("b0",)
    assert planned(plan) == [("i0", 1), ("i1", 1)]
    assert [r.request_id for r in s.waiting] == ["b0", "b1"]


# -- without batch requests nothing changes -----------------------------------------------------------------------


queue_ops = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["append", "appendleft"]), st.integers(0, 1)),  # 1: a batch request
        st.tuples(st.just("popleft"), st.just(0)),
        st.tuples(st.just("remove"), st.integers(0, 30)),  # some index among the requests made so far
    ),
    max_size=60,
)


def _check_queue_ops(ops: list[tuple[str, int]], with_batch: bool) -> None:
    """Apply `ops` to an InteractiveFirstQueue and to one RequestQueue of every request: the first must hold the
    second's interactive requests, then its batch ones, each in the second's order (all of it without batch)."""
    queue, reference = InteractiveFirstQueue(), RequestQueue()
    made: list[Request] = []
    expected: list[Request] = []
    for op, arg in ops:
        if op in ("append", "appendleft"):
            request = _request(f"r{len(made)}", 1, batch=with_batch and arg == 1)
            made.append(request)
            getattr(queue, op)(request)
            getattr(reference, op)(request)
        elif op == "popleft":
            if not expected:
                continue
            popped = queue.popleft()
            assert popped is expected[0]
            assert reference.remove(popped.request_id) is popped
        elif made:
            request_id = made[arg % len(made)].request_id
            assert queue.remove(request_id) is reference.remove(request_id)
        expected = [r for r in reference if not r.batch] + [r for r in reference if r.batch]
        if not with_batch:
            assert expected == list(reference)
        assert list(queue) == expected
        assert len(queue) == len(expected) and bool(queue) == bool(expected)
        if expected:
            assert queue.first() is expected[0] and queue.last() is expected[-1]
        for request in made:
            assert (request in queue) == (request in reference)
            assert (request.request_id in queue) == (request.request_id in reference)
            assert queue.get(request.request_id) is reference.get(request.request_id)


@settings(max_examples=200, deadline=None)
@given(ops=queue_ops)
def test_interactive_first_queue_is_request_queue_without_batch_requests(ops: list[tuple[str, int]]) -> None:
    _check_queue_ops(ops, with_batch=False)


@settings(max_examples=200, deadline=None)
@given(ops=queue_ops)
def test_interactive_first_queue_puts_each_class_in_request_queue_order(ops: list[tuple[str, int]]) -> None:
    _check_queue_ops(ops, with_batch=True)


@settings(max_examples=100, deadline=None)
@given(keys=st.lists(st.tuples(st.integers(-2, 2), st.integers(0, 5)), min_size=1, max_size=20))
def test_priority_queue_order_without_batch_requests_is_priority_then_arrival(keys: list[tuple[int, int]]) -> None:
    q = PriorityRequestQueue()
    requests = []
    for i, (priority, arrival) in enumerate(keys):
        request = _request(f"r{i:02d}", 1, priority=priority)
        request.arrival_time = float(arrival)
        requests.append(request)
        q.append(request)
    by_old_key = sorted(requests, key=lambda r: (r.priority, r.arrival_time, r.request_id))
    assert list(q) == by_old_key


new_request = st.tuples(st.just("add"), st.integers(1, 16), st.integers(1, 24))  # prompt length, max_new_tokens
operation = st.one_of(
    new_request,
    st.tuples(st.just("repeat"), st.integers(0, 30), st.integers(1, 24)),  # an earlier prompt: prefix hits
    st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 30), st.just(0)),
)


@settings(max_examples=100, deadline=None)
@given(
    # A burst up front, so that nearly every example has several requests in flight and memory pressure.
    burst=st.lists(new_request, min_size=3, max_size=8),
    operations=st.lists(operation, max_size=40),
    num_pages=st.integers(6, 16),
    max_batch_tokens=st.integers(2, 24),
    max_num_seqs=st.integers(1, 4),
)
def test_fcfs_plans_without_batch_requests_equal_those_of_a_plain_request_queue(
    burst: list[tuple[str, int, int]],
    operations: list[tuple[str, int, int]],
    num_pages: int,
    max_batch_tokens: int,
    max_num_seqs: int,
) -> None:
    """The scheduler as it was (its waiting queue a RequestQueue) and as it is plan the same steps, preemptions
    included, for a random interactive workload."""
    new, old = (
        make_scheduler(num_pages, 4, max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs) for _ in range(2)
    )
    old.waiting = RequestQueue()  # type: ignore[assignment]
    prompts: list[list[int]] = []

    def both_step() -> None:
        plans: list[SchedulerOutput] = []
        for s in (new, old):
            plan = s.schedule()
            s.update(plan, sample(s, plan))
            plans.append(plan)
        assert plans[0] == plans[1]
        assert [r.request_id for r in new.waiting] == [r.request_id for r in old.waiting]

    for op, a, b in [*burst, *operations]:
        if op in ("add", "repeat"):
            if op == "add":
                prompt = list(range(1000 * len(prompts) + 10, 1000 * len(prompts) + 10 + a))
            elif prompts:
                prompt = prompts[a % len(prompts)]
            else:
                continue
            if not new.kv_cache.fits(len(prompt) + b):
                continue
            for s in (new, old):
                s.add(_request(f"r{len(prompts)}", prompt, max_new=b))
            prompts.append(prompt)
        elif op == "step":
            for _ in range(a):
                both_step()
        elif prompts:
            request_id = f"r{a % len(prompts)}"
            assert new.abort(request_id) == old.abort(request_id)
    for _ in range(2_000):
        if not new.has_unfinished:
            break
        both_step()
    assert not new.has_unfinished and not old.has_unfinished
    target(float(new.num_preemptions), label="preemptions")


# -- the engine: batch requests wait, and compute the same tokens -------------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_engine_schedules_a_later_interactive_request_ahead_of_waiting_batch_ones(
    model_dir: Callable[[str], Path], policy: str
) -> None:
    prompts = {f"b{i}": [5 + i, 17, 23, 9 + i, 40] for i in range(3)} | {"i": [7, 31, 12, 60]}

    def run(batch: bool) -> tuple[list[str], dict[str, list[int]]]:
        config = EngineConfig.of(model=str(model_dir("llama")), num_pages=64, max_num_seqs=1, scheduling_policy=policy)
        engine = EngineCore(config)
        params = SamplingParams(max_new_tokens=6, ignore_eos=True)
        first: list[str] = []
        tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}

        def take(outputs: list[StepOutput]) -> None:
            for output in outputs:
                if output.request_id not in first:
                    first.append(output.request_id)
                tokens[output.request_id] += output.new_token_ids

        for request_id in ("b0", "b1", "b2"):
            engine.add_request(request_id, prompts[request_id], params, batch=batch)
        take(engine.step())  # b0 runs; b1 and b2 wait
        engine.add_request("i", prompts["i"], params)
        while engine.has_unfinished():
            take(engine.step())
        assert engine.is_idle_and_clean()
        return first, tokens

    first, tokens = run(batch=True)
    assert first == ["b0", "i", "b1", "b2"]
    plain_first, plain_tokens = run(batch=False)
    assert plain_first == ["b0", "b1", "b2", "i"]
    assert tokens == plain_tokens
    assert all(len(t) == 6 for t in tokens.values())


# -- the server: only the batch runner marks a call ---------------------------------------------------------------


def test_only_the_asgi_scope_marks_a_call_as_batch() -> None:
    def call(**scope: object) -> HTTPRequest:
        # A client's header of the key's name is no scope key: it cannot claim the batch class.
        return HTTPRequest({"type": "http", "headers": [(BATCH_SCOPE_KEY.encode(), b"true")], **scope})

    assert is_batch(call(**{BATCH_SCOPE_KEY: True}))
    assert not is_batch(call())
    assert not is_batch(call(**{BATCH_SCOPE_KEY: "true"}))
