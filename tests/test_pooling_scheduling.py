"""Pooling requests in the scheduler (no model): prefill-only rows that never sample, finished by the step that
pools them; encoder inputs (one non-causal span) computed whole; no prefix hits; preemption and async planning."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.request import FinishReason, PoolingParams, Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.step import ModelRunnerOutput, SchedulerOutput
from tests.test_scheduler import make_request, make_scheduler, next_token


def pooling_request(request_id: str, prompt: list[int] | int, *, encoder: bool = False) -> Request:
    request = make_request(request_id, prompt)
    request.pooling = PoolingParams()
    if encoder:
        request.noncausal_spans = ((0, len(request.prompt_ids)),)
    return request


def run_step(scheduler: Scheduler, plan: SchedulerOutput) -> list:
    """A model's part of a step: a token per sampling request, a vector per pooling request whose prompt ends."""
    tokens, pooled = [], {}
    requests = {r.request_id: r for r in [*scheduler.running, *scheduler.waiting]}
    for request_id, start, num_new, samples in zip(
        plan.request_ids, plan.num_computed_tokens, plan.num_new_tokens, plan.samples, strict=True
    ):
        request = requests[request_id]
        if samples:
            tokens.append([next_token(request)])
        if request.pooling is not None and start + num_new == len(request.prompt_ids):
            pooled[request_id] = [float(len(request.prompt_ids))]
    return scheduler.update(plan, ModelRunnerOutput(tokens, [None] * len(tokens), pooled=pooled))


def test_a_pooling_request_never_samples_and_finishes_with_its_vector() -> None:
    scheduler = make_scheduler(max_batch_tokens=6)
    scheduler.add(pooling_request("pool", 14))
    scheduler.add(make_request("gen", 3, max_new_tokens=2))
    finished = {}
    for _ in range(10):
        plan = scheduler.schedule()
        for request_id, samples in zip(plan.request_ids, plan.samples, strict=True):
            assert not (request_id == "pool" and samples)
        for output in run_step(scheduler, plan):
            if output.finished:
                finished[output.request_id] = output
        if not scheduler.has_unfinished:
            break
    assert finished["pool"].pooled == [14.0] and finished["pool"].finish_reason is FinishReason.STOP
    assert finished["pool"].new_token_ids == []
    assert finished["gen"].pooled is None and finished["gen"].finish_reason is FinishReason.LENGTH
    assert scheduler.kv_cache.all_free()


def test_an_encoder_input_is_computed_in_one_step_or_waits_for_room() -> None:
    scheduler = make_scheduler(max_batch_tokens=10)
    scheduler.add(pooling_request("first", 6, encoder=True))
    scheduler.add(pooling_request("second", 7, encoder=True))  # 6 + 7 > 10: it waits for the next step
    plan = scheduler.schedule()
    assert plan.request_ids == ("first",) and plan.num_new_tokens == (6,)
    run_step(scheduler, plan)
    plan = scheduler.schedule()
    assert plan.request_ids == ("second",) and plan.num_new_tokens == (7,)


def test_a_decoders_pooling_request_is_chunked_and_takes_no_prefix_hit() -> None:
    scheduler = make_scheduler(max_batch_tokens=5)
    prompt = list(range(100, 120))
    scheduler.add(make_request("warm", prompt, max_new_tokens=1))
    while scheduler.has_unfinished:
        run_step(scheduler, scheduler.schedule())
    scheduler.kv_cache.lookups.clear()  # type: ignore[attr-defined]
    scheduler.add(pooling_request("pool", prompt))
    chunks = []
    while scheduler.has_unfinished:
        plan = scheduler.schedule()
        chunks += list(plan.num_new_tokens)
        run_step(scheduler, plan)
    # Mean and cls pooling read every token's hidden state: a cached prefix would leave them out.
    assert chunks == [5, 5, 5, 5] and scheduler.kv_cache.lookups == []  # type: ignore[attr-defined]


def test_a_preempted_pooling_request_starts_over_and_still_finishes() -> None:
    # Four pages of four tokens: the pooling request's chunks and the generating one's growth cannot both fit.
    scheduler = make_scheduler(num_pages=4, page_size=4, max_batch_tokens=4)
    scheduler.add(make_request("gen", 2, max_new_tokens=8))
    scheduler.add(pooling_request("pool", 12))
    outputs = []
    for _ in range(80):
        if not scheduler.has_unfinished:
            break
        outputs += run_step(scheduler, scheduler.schedule())
    final = {o.request_id: o for o in outputs if o.finished}
    assert final["pool"].pooled == [12.0] and final["gen"].finish_reason is FinishReason.LENGTH
    assert scheduler.num_preemptions >= 1
    assert scheduler.kv_cache.all_free()


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    encoder=st.booleans(),
    budget=st.integers(12, 20),
    planned_ahead=st.booleans(),
)
def test_every_pooling_request_finishes_once_with_spans_never_cut(
    lengths: list[int], encoder: bool, budget: int, planned_ahead: bool
) -> None:
    """Random mixes, planned one step ahead or not (async scheduling): each request gets exactly one vector, and
    no step ends inside an encoder's span."""
    scheduler = make_scheduler(num_pages=64, max_batch_tokens=budget)
    for i, n in enumerate(lengths):
        scheduler.add(pooling_request(f"p{i}", n, encoder=encoder))
    vectors: dict[str, list[list[float] | None]] = {}
    in_flight: SchedulerOutput | None = None
    for _ in range(200):
        if not scheduler.has_unfinished and in_flight is None:
            break
        plan = scheduler.schedule()
        if encoder:
            for request_id, start, num_new in zip(
                plan.request_ids, plan.num_computed_tokens, plan.num_new_tokens, strict=True
            ):
                assert start == 0 and num_new == lengths[int(request_id[1:])]
        if planned_ahead:
            outputs = run_step(scheduler, in_flight) if in_flight is not None else []
            in_flight = plan if plan.request_ids else None
        else:
            outputs = run_step(scheduler, plan)
        for output in outputs:
            vectors.setdefault(output.request_id, []).append(output.pooled)
    assert vectors == {f"p{i}": [[float(n)]] for i, n in enumerate(lengths)}
    assert all(r.status is RequestStatus.FINISHED for r in scheduler.running) and scheduler.kv_cache.all_free()
