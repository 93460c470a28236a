"""The in-process manager: streaming, cancellation, pause, stop, callbacks; and seeded sampling."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from engine import ContinuousBatchingManager, EngineConfig, EngineCore, FinishReason, SamplingParams, generate_batch

PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37, 38], [41, 42]]


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> EngineCore:
    return EngineCore(EngineConfig.of(model=str(tiny_llama), page_size=4, num_pages=256, debug_checks=True))


def test_streaming_yields_growing_prefixes_then_final(engine: EngineCore) -> None:
    with ContinuousBatchingManager(engine) as manager:
        rid = manager.add_request(PROMPTS[0], SamplingParams(max_new_tokens=12, ignore_eos=True))
        snapshots = list(manager.request_id_iter(rid))
    lengths = [len(s.generated_ids) for s in snapshots]
    assert lengths == sorted(lengths) and lengths[-1] == 12
    assert all(s.generated_ids == snapshots[-1].generated_ids[: len(s.generated_ids)] for s in snapshots)
    assert snapshots[-1].finish_reason is FinishReason.LENGTH
    assert not any(s.finished for s in snapshots[:-1])
    assert engine.is_idle_and_clean()


def test_manager_matches_generate_batch(engine: EngineCore) -> None:
    params = SamplingParams(max_new_tokens=10)
    expected = generate_batch(PROMPTS, params=params, engine=engine)
    with ContinuousBatchingManager(engine) as manager:
        ids = manager.add_requests(PROMPTS, params)
        got = {rid: manager.get_result(rid, timeout=60) for rid in ids}
    for i, rid in enumerate(ids):
        assert got[rid].generated_ids == expected[f"req_{i}"].generated_ids


def test_iteration_hands_out_every_result(engine: EngineCore) -> None:
    manager = ContinuousBatchingManager(engine)
    manager.start()
    ids = manager.add_requests(PROMPTS, SamplingParams(max_new_tokens=5))
    seen = set()
    for result in manager:
        seen.add(result.request_id)
        if len(seen) == len(ids):
            manager.stop(block=False)
    assert seen == set(ids)


def test_cancel_mid_generation_frees_pages(engine: EngineCore) -> None:
    with ContinuousBatchingManager(engine) as manager:
        rid = manager.add_request(PROMPTS[2], SamplingParams(max_new_tokens=400, ignore_eos=True))
        for snapshot in manager.request_id_iter(rid):
            if len(snapshot.generated_ids) >= 3:
                manager.cancel_request(rid)
                break
        final = manager.get_result(rid, timeout=30)
        manager.cancel_request(rid)  # idempotent, also after the end
        manager.cancel_request("never-existed")
    assert final is not None and final.finish_reason is FinishReason.ABORT
    assert 3 <= len(final.generated_ids) < 400
    assert engine.is_idle_and_clean()


def test_pause_holds_the_loop_and_loses_nothing(engine: EngineCore) -> None:
    with ContinuousBatchingManager(engine) as manager:
        with manager.pause():
            steps = engine.stats().num_steps
            rid = manager.add_request(PROMPTS[1], SamplingParams(max_new_tokens=6, ignore_eos=True))
            threading.Event().wait(0.3)
            assert engine.stats().num_steps == steps
            assert manager.get_result(rid, timeout=0.05) is None
        result = manager.get_result(rid, timeout=30)
    assert result is not None and len(result.generated_ids) == 6


def test_graceful_stop_finishes_in_flight(engine: EngineCore) -> None:
    manager = ContinuousBatchingManager(engine)
    manager.start()
    ids = manager.add_requests(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    manager.stop(block=True, timeout=60)
    assert not manager.is_running()
    for rid in ids:
        result = manager.get_result(rid, timeout=0)
        assert result is not None and result.finish_reason is FinishReason.LENGTH and len(result.generated_ids) == 8
    with pytest.raises(RuntimeError, match="not running"):
        manager.add_request(PROMPTS[0])


def test_hard_stop_fails_pending_with_a_clear_error(engine: EngineCore) -> None:
    manager = ContinuousBatchingManager(engine)
    manager.start()
    ids = manager.add_requests(PROMPTS, SamplingParams(max_new_tokens=400, ignore_eos=True))
    manager.stop(block=True, timeout=60, hard_stop=True)
    for rid in ids:
        result = manager.get_result(rid, timeout=0)
        assert result is not None and result.finish_reason is FinishReason.ABORT
        assert "hard stop" in (result.error or "")
    while engine.has_unfinished():
        engine.step()
    assert engine.is_idle_and_clean()


def test_result_handler_runs_on_the_event_loop(engine: EngineCore) -> None:
    async def scenario() -> list[int]:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        lengths: list[int] = []
        with ContinuousBatchingManager(engine) as manager:
            rid = manager.add_request(PROMPTS[0], SamplingParams(max_new_tokens=7, ignore_eos=True), "cb")

            def on_output(output) -> None:
                assert asyncio.get_running_loop() is loop
                lengths.append(len(output.generated_ids))
                if output.finished:
                    done.set()

            manager.register_result_handler(rid, on_output)
            await asyncio.wait_for(done.wait(), 30)
        return lengths

    lengths = asyncio.run(scenario())
    assert lengths[-1] == 7 and lengths == sorted(lengths)


def test_rejected_request_is_reported_not_lost(engine: EngineCore) -> None:
    with ContinuousBatchingManager(engine) as manager:
        rid = manager.add_request(PROMPTS[0], SamplingParams(max_new_tokens=engine.max_model_len))
        result = manager.get_result(rid, timeout=10)
    assert result is not None and result.finish_reason is FinishReason.ABORT
    assert "maximum context length" in (result.error or "")


def test_seeded_sampling_is_independent_of_the_batch(engine: EngineCore) -> None:
    seeded = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = generate_batch([PROMPTS[2]], params=seeded, engine=engine)["req_0"].generated_ids
    others = [SamplingParams(max_new_tokens=n, temperature=0.8) for n in (3, 9, 15)]
    crowd = generate_batch(PROMPTS, params=[*others[:2], seeded, others[2]], engine=engine)
    assert crowd["req_2"].generated_ids == alone
    other_seed = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert generate_batch([PROMPTS[2]], params=other_seed, engine=engine)["req_0"].generated_ids != alone


def test_impossible_requests_are_rejected_at_submission(engine: EngineCore) -> None:
    from engine import RequestRejected

    with pytest.raises(RequestRejected) as too_long:
        engine.add_request("x", [1] * 10, SamplingParams(max_new_tokens=engine.max_model_len))
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(RequestRejected):
        engine.add_request("y", [], SamplingParams())
    with pytest.raises(RequestRejected):
        engine.add_request("z", [10**9], SamplingParams())
    assert not engine.has_unfinished()
    engine.add_request("dup", [5, 6, 7], SamplingParams(max_new_tokens=2))
    with pytest.raises(RequestRejected) as duplicate:
        engine.add_request("dup", [5, 6, 7], SamplingParams())
    assert duplicate.value.code == "duplicate_request_id"
    while engine.has_unfinished():
        engine.step()
    engine.add_request("dup", [5, 6, 7], SamplingParams(max_new_tokens=2))  # a finished id may be reused
    while engine.has_unfinished():
        engine.step()


def test_results_are_handed_out_once_then_forgotten(engine: EngineCore) -> None:
    with ContinuousBatchingManager(engine) as manager:
        first, second = manager.add_requests(PROMPTS[:2], SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert manager.get_result(first, timeout=30) is not None
        with pytest.raises(KeyError):
            manager.get_result(first, timeout=0)
        # The finished queue skips what was already handed out by id.
        result = manager.get_result(timeout=30)
        assert result is not None and result.request_id == second
        assert manager.get_result(timeout=0.05) is None


def test_priorities_need_the_priority_policy(tiny_llama: Path) -> None:
    from engine import RequestRejected

    fcfs = EngineCore(EngineConfig.of(model=str(tiny_llama), num_pages=64))
    with pytest.raises(RequestRejected) as refused:
        fcfs.add_request("p", [5, 6, 7], SamplingParams(max_new_tokens=2), priority=1)
    assert refused.value.code == "invalid_priority" and "--scheduling-policy priority" in str(refused.value)
    by_priority = EngineCore(EngineConfig.of(model=str(tiny_llama), num_pages=64, scheduling_policy="priority"))
    by_priority.add_request("later", [5, 6, 7], SamplingParams(max_new_tokens=2), priority=2)
    by_priority.add_request("sooner", [5, 6, 8], SamplingParams(max_new_tokens=2), priority=-2)
    assert [r.request_id for r in by_priority.scheduler.waiting] == ["sooner", "later"]
    while by_priority.has_unfinished():
        by_priority.step()
    assert by_priority.is_idle_and_clean()
