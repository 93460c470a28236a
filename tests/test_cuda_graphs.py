"""Captured decode steps (engine/execution/cuda_graphs.py), everything a CPU can check: the sizes and padding, which
steps replay, why an engine runs eagerly, the static buffers a padded step fills (and reuses), the scratch page, the
memory arithmetic, and the padded forward itself.

Nothing is captured on CPU: the tests hand `ModelRunner.use_decode_graphs` a capture strategy that returns the
padded forward as it is (and counts its calls), so each padded step runs the very function a CUDA graph records,
over the same static buffers, through the C++ CPU backend (a capturable one). The capture and replay themselves are
tests/test_gpu.py's.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoConfig, PretrainedConfig

from engine import EngineConfig, EngineCore, SamplingParams, generate_batch
from engine.attention import CpuPagedBackend, TorchPagedBackend
from engine.attention.cpu_kernel import load_kernel
from engine.core.observer import StepRecord
from engine.core.page_pool import PagePool
from engine.core.request import Request
from engine.core.step import NewRequest, SchedulerOutput
from engine.execution.cuda_graphs import (
    StepFn,
    decode_graph_size,
    eager_reason,
    graph_sizes,
    max_graph_size,
    padded_size,
    start_decode_graphs,
)
from engine.execution.kv_caches import kv_cache_groups
from engine.execution.memory import decode_graphs_estimate, gpu_kv_budget_bytes
from engine.execution.runner import ModelRunner
from engine.models.loader import LoadedModel, load_model
from engine.models.state_space import MambaForCausalLM
from tests.capturable_backend import DensePagedBackend
from tests.test_attention import attention_runner, fresh_plan
from tests.test_cpu_attention import needs_kernel


class _Shapes(torch.nn.Module):
    """Just the attributes ModelRunner sizes its cache from."""

    num_layers, num_kv_heads, head_dim = 1, 2, 8


def _as_is(forward: StepFn) -> StepFn:
    """The capture strategy of a CPU test: each step runs the padded forward itself."""
    return forward


class _Counting:
    """A capture strategy that runs the padded forward as it is and counts the steps of each padded size."""

    def __init__(self) -> None:
        self.steps: Counter[int] = Counter()

    def __call__(self, forward: StepFn) -> StepFn:
        def step() -> torch.Tensor:
            hidden = forward()
            self.steps[hidden.shape[0]] += 1
            return hidden

        return step


# -- sizes and eligibility -----------------------------------------------------------------------------------


def test_graph_sizes() -> None:
    assert graph_sizes(256) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, *range(80, 257, 16))
    assert len(graph_sizes(256)) == 23
    assert graph_sizes(1) == (1,)
    assert graph_sizes(3) == (1, 2, 3)
    assert graph_sizes(8) == (1, 2, 4, 8)
    assert graph_sizes(100) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100)
    with pytest.raises(ValueError):
        graph_sizes(0)


@given(st.integers(1, 1024), st.data())
def test_padded_size_is_the_smallest_size_that_holds_the_rows(max_size: int, data: st.DataObject) -> None:
    sizes = graph_sizes(max_size)
    assert list(sizes) == sorted(set(sizes)) and sizes[-1] == max_size
    n = data.draw(st.integers(1, max_size))
    padded = padded_size(sizes, n)
    assert padded in sizes and padded >= n
    assert all(s < n for s in sizes if s < padded), "minimal"
    # Padding never reaches a fifth of a step above 64 rows, nor 8 rows below.
    assert padded - n < (8 if padded <= 64 else 16)


def test_padded_size_refuses_what_no_graph_holds() -> None:
    with pytest.raises(ValueError):
        padded_size((1, 2, 4), 5)
    with pytest.raises(ValueError):
        padded_size((1, 2, 4), 0)


@pytest.mark.parametrize(
    ("num_seqs", "max_query_len", "expected"),
    [(1, 1, 1), (3, 1, 4), (8, 1, 8), (9, 1, None), (3, 2, None), (1, 17, None)],
    ids=["one-decode", "padded", "largest", "too-many", "a-chunk", "a-prompt"],
)
def test_which_steps_replay_a_graph(num_seqs: int, max_query_len: int, expected: int | None) -> None:
    assert decode_graph_size((1, 2, 4, 8), num_seqs, max_query_len) == expected
    assert decode_graph_size((), num_seqs, max_query_len) is None, "no graphs: every step is eager"


def test_the_largest_graph_fits_every_step_limit() -> None:
    assert max_graph_size(EngineConfig.of(model="m")) == 256
    assert max_graph_size(EngineConfig.of(model="m", max_num_seqs=48)) == 48
    assert max_graph_size(EngineConfig.of(model="m", max_batch_tokens=32)) == 32
    assert max_graph_size(EngineConfig.of(model="m", cuda_graph_max_seqs=16)) == 16
    with pytest.raises(ValueError, match="cuda_graph_max_seqs"):
        EngineConfig.of(model="m", cuda_graph_max_seqs=0)


# -- when graphs run, and why not -----------------------------------------------------------------------------


def _mamba() -> MambaForCausalLM:
    config = AutoConfig.for_model("mamba", hidden_size=16, num_hidden_layers=1, vocab_size=16, state_size=4)
    return MambaForCausalLM.empty(config, 64, torch.device("meta"), torch.float32)


def _loaded(device: str, *, native: bool = True, capturable: bool = True, recurrent: bool = False) -> LoadedModel:
    backend = CpuPagedBackend(load_kernel) if capturable else TorchPagedBackend()
    return LoadedModel(
        _mamba() if recurrent else _Shapes(),
        PretrainedConfig(vocab_size=16),
        frozenset(),
        64,
        torch.device(device),
        torch.float32,
        native,
        backend,
    )


@pytest.mark.parametrize(
    ("config", "loaded", "reason"),
    [
        (EngineConfig.of(model="m", enforce_eager=True), _loaded("cuda"), "--enforce-eager"),
        (EngineConfig.of(model="m"), _loaded("cpu"), "need a CUDA device"),
        (EngineConfig.of(model="m", tensor_parallel_size=2), _loaded("cuda"), "--tensor-parallel-size 2"),
        (EngineConfig.of(model="m"), _loaded("cuda", native=False), "transformers adapter"),
        (EngineConfig.of(model="m"), _loaded("cuda", capturable=False), "the torch attention backend plans"),
        (EngineConfig.of(model="m"), _loaded("cuda", recurrent=True), "its state-space layers read"),
        (EngineConfig.of(model="m"), _loaded("cuda"), None),
    ],
    ids=["enforce-eager", "cpu", "tensor-parallel", "transformers-adapter", "torch-backend", "state-space", "graphs"],
)
def test_why_an_engine_runs_eagerly(
    config: EngineConfig, loaded: LoadedModel, reason: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    found = eager_reason(config, loaded)
    assert found is None if reason is None else reason in found
    if reason is not None:
        runner = attention_runner(_Shapes(), 4, 4)
        with caplog.at_level(logging.INFO, logger="engine.execution.cuda_graphs"):
            assert start_decode_graphs(runner, config, loaded) is None
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == 1 and reason in messages[0] and "runs eagerly" in messages[0]
        assert runner.graph_sizes == ()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_a_cpu_engine_logs_once_why_it_runs_eagerly(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture, enforce_eager: bool
) -> None:
    config = EngineConfig.of(model=str(tiny_llama), num_pages=16, enforce_eager=enforce_eager)
    with caplog.at_level(logging.INFO, logger="engine.execution.cuda_graphs"):
        engine = EngineCore(config)
    messages = [r.getMessage() for r in caplog.records if r.name == "engine.execution.cuda_graphs"]
    assert messages == [
        "CUDA graphs off, every step runs eagerly: "
        + ("--enforce-eager" if enforce_eager else "CUDA graphs need a CUDA device, and the engine runs on cpu")
    ]
    assert engine.cuda_graphs is None and engine.runner.graph_sizes == ()


# -- the scratch page, the static buffers ---------------------------------------------------------------------


def test_the_scratch_page_is_never_handed_out() -> None:
    pool = PagePool(6, 4, enable_prefix_caching=False)
    handed = []
    for i in range(10):
        request = Request(f"r{i}", list(range(5)), SamplingParams(), frozenset())
        if pool.allocate(request, 5) is None:
            break
        handed += pool.page_table(request.request_id)
    assert sorted(handed) == list(range(6)), "every page, then no more"
    runner = attention_runner(_Shapes(), 6, 4)
    assert runner.scratch_pages == [6] and runner.pool_pages == [6]
    assert runner.kv_caches[0][0].shape[0] == 7, "the cache holds the pool's pages and the scratch page"


def test_a_padded_step_fills_the_static_buffers() -> None:
    page = 4
    eager = attention_runner(_Shapes(), 12, page)
    padded = attention_runner(_Shapes(), 12, page)
    padded.use_decode_graphs((1, 2, 4, 8), _as_is)
    shapes = [(5, 1), (9, 1), (2, 1)]
    tables = [[3, 7], [0, 1, 11], [5]]
    expected = eager.prepare(fresh_plan(shapes, tables))
    inputs = padded.prepare(fresh_plan(shapes, tables))
    assert expected.graph_size is None and inputs.graph_size == 4
    for runner, prepared in ((eager, expected), (padded, inputs)):
        runner.load_inputs(prepared)  # the static buffers are written here, just before the forward pass
    n, meta, want = 3, inputs.meta, expected.meta
    scratch = padded.scratch_pages[0]
    assert scratch == 12
    # The real rows are the eager step's inputs.
    assert inputs.input_ids[:n].tolist() == expected.input_ids.tolist()
    assert meta.positions[:n].tolist() == want.positions.tolist()
    assert meta.slot_mapping[:n].tolist() == want.slot_mapping.tolist()
    assert meta.seq_lens[:n].tolist() == want.seq_lens.tolist()
    assert meta.query_start_loc[: n + 1].tolist() == want.query_start_loc.tolist()
    assert meta.page_tables[:n, : want.page_tables.shape[1]].tolist() == want.page_tables.tolist()
    assert inputs.logits_rows.tolist() == expected.logits_rows.tolist() == [0, 1, 2]
    # The padding row: token 0 at position 0 of a one-token sequence on the scratch page only.
    assert inputs.input_ids[n:].tolist() == [0]
    assert meta.positions[n:].tolist() == [0]
    assert meta.seq_lens[n:].tolist() == [1]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert set(meta.page_tables[n:].flatten().tolist()) == {scratch}
    assert meta.slot_mapping[n:].tolist() == [scratch * page]
    assert meta.page_tables.shape == (4, padded.batch.tables[0].shape[1]), "whole rows: a static shape"
    # No real row's slot or visible page is the scratch page.
    assert all(s // page != scratch for s in meta.slot_mapping[:n].tolist())
    for row, seq_len in enumerate(meta.seq_lens[:n].tolist()):
        assert scratch not in meta.page_tables[row, : -(-seq_len // page)].tolist()


def test_padded_steps_reuse_one_set_of_buffers() -> None:
    runner = attention_runner(_Shapes(), 32, 4)
    runner.use_decode_graphs((1, 2, 4, 8), _as_is)
    first = runner.prepare(fresh_plan([(3, 1), (6, 1), (1, 1)], [[0], [1, 2], [3]]))
    metas, ids = first.metas, first.input_ids.data_ptr()
    pointers = {name: getattr(first.meta, name).data_ptr() for name in _TENSORS}
    plan = SchedulerOutput(
        request_ids=("0", "1", "2"),
        num_computed_tokens=(4, 7, 2),
        num_new_tokens=(1, 1, 1),
        token_ids=((9,), (8,), (7,)),
        samples=(True,) * 3,
    )
    second = runner.prepare(plan)
    assert second.graph_size == 4 and second.metas is metas, "a size's metadata is built once"
    assert second.input_ids.data_ptr() == ids
    assert {name: getattr(second.meta, name).data_ptr() for name in _TENSORS} == pointers
    # Another size is a view of the same buffers: every graph reads the same addresses.
    third = runner.prepare(SchedulerOutput(finished_ids=("1", "2"), **_one_decode("0", 5)))
    assert third.graph_size == 1
    assert {name: getattr(third.meta, name).data_ptr() for name in _TENSORS} == pointers
    assert third.input_ids.data_ptr() == ids


_TENSORS = ("positions", "slot_mapping", "query_start_loc", "seq_lens", "page_tables")


def _one_decode(request_id: str, computed: int) -> dict:
    return dict(
        request_ids=(request_id,),
        num_computed_tokens=(computed,),
        num_new_tokens=(1,),
        token_ids=((computed,),),
        samples=(True,),
    )


def test_graphs_are_set_up_before_the_first_step_at_sizes_that_fit() -> None:
    runner = attention_runner(_Shapes(), 8, 4)
    with pytest.raises(ValueError, match="ascend"):
        runner.use_decode_graphs((2, 1), _as_is)
    with pytest.raises(ValueError, match="ascend"):
        runner.use_decode_graphs((1, 128), _as_is)  # past max_num_seqs (64)
    runner.prepare(fresh_plan([(1, 1)], [[0]]))
    with pytest.raises(RuntimeError, match="before the first step"):
        runner.use_decode_graphs((1, 2), _as_is)


# -- memory ---------------------------------------------------------------------------------------------------


def test_the_kv_budget_leaves_room_for_activations_graphs_and_scratch_pages() -> None:
    gib, mib = 2**30, 2**20
    assert gpu_kv_budget_bytes(10 * gib, 0.9, 1 * gib, 512 * mib, 2 * mib) == 9 * gib - gib - 512 * mib - 2 * mib
    assert gpu_kv_budget_bytes(10 * gib, 0.5, 0, 0, 0) == 5 * gib
    # The largest graph's pool, plus each smaller graph's output ([size, hidden]) in 512-byte blocks.
    assert decode_graphs_estimate(100 * mib, (1, 2, 4, 8), 64 * 2) == 100 * mib + 3 * 512
    assert decode_graphs_estimate(100 * mib, (1, 16), 4096 * 2) == 100 * mib + 4096 * 2
    assert decode_graphs_estimate(7 * mib, (256,), 4096) == 7 * mib


# -- the padded forward, through the CPU kernel ---------------------------------------------------------------


def _prefill(prompts: list[list[int]], tables: list[list[int]], num_groups: int) -> SchedulerOutput:
    ids = tuple(str(i) for i in range(len(prompts)))
    return SchedulerOutput(
        request_ids=ids,
        num_computed_tokens=(0,) * len(prompts),
        num_new_tokens=tuple(len(p) for p in prompts),
        token_ids=tuple(tuple(p) for p in prompts),
        samples=(True,) * len(prompts),
        new_requests=tuple(
            NewRequest(rid, tuple(p), (), SamplingParams(), frozenset(), 0, (tuple(t),) * num_groups)
            for rid, p, t in zip(ids, prompts, tables, strict=True)
        ),
    )


_INTERPRETED_TRITON = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernel runs on CPU under Triton's interpreter (triton is in the test extra)",
)


@pytest.mark.parametrize(
    ("arch", "backend"),
    [
        pytest.param("llama", "cpu", marks=needs_kernel),
        pytest.param("qwen2_hybrid", "cpu", marks=needs_kernel),
        pytest.param("llama", "triton", marks=_INTERPRETED_TRITON),
    ],
)
def test_the_padded_forward_computes_the_eager_steps_logits(
    model_dir: Callable[[str], Path], arch: str, backend: str
) -> None:
    """Real rows through the padded static buffers get the eager step's logits, and the padded rows write the
    scratch page only: every real page of every layer ends as the eager runner's. With the C++ CPU kernel, and with
    the Triton kernel (the GPU's capturable backend) under Triton's interpreter."""
    config = EngineConfig.of(model=str(model_dir(arch)), attention_backend=backend, page_size=4, max_num_seqs=8)
    loaded = load_model(config)
    assert loaded.backend.name == backend and loaded.backend.capturable
    layouts = kv_cache_groups(loaded.model, config.cache.page_size)
    assert (len(layouts) == 2) == (arch == "qwen2_hybrid")
    pages = [16] * len(layouts)
    eager = ModelRunner(loaded, layouts, pages, config)
    padded = ModelRunner(loaded, layouts, pages, config)
    padded.use_decode_graphs((1, 2, 4, 8), _as_is)
    prompts = [[11, 12, 13, 14, 15], [20 + i for i in range(9)], [7, 8, 9]]
    tables = [[0, 1, 2], [3, 4, 5, 6], [7, 8]]
    steps = [
        _prefill(prompts, tables, len(layouts)),
        SchedulerOutput(
            request_ids=("0", "1", "2"),
            num_computed_tokens=(5, 9, 3),
            num_new_tokens=(1, 1, 1),
            token_ids=((40,), (41,), (42,)),
            samples=(True,) * 3,
        ),
        SchedulerOutput(
            request_ids=("1", "2"),
            num_computed_tokens=(10, 4),
            num_new_tokens=(1, 1),
            token_ids=((43,), (44,)),
            samples=(True, True),
        ),
        SchedulerOutput(finished_ids=("1",), **_one_decode("2", 5)),
    ]
    for step, size in zip(steps, (None, 4, 2, 1), strict=True):
        want = eager.forward(eager.prepare(step))
        inputs = padded.prepare(step)
        assert inputs.graph_size == size
        torch.testing.assert_close(padded.forward(inputs), want, rtol=1e-5, atol=1e-5)
        for (k_eager, v_eager), (k, v), layer_pages in zip(
            eager.kv_caches, padded.kv_caches, [pages[g] for g in eager.group_of_layer], strict=True
        ):
            torch.testing.assert_close(k[:layer_pages], k_eager[:layer_pages], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v[:layer_pages], v_eager[:layer_pages], rtol=1e-5, atol=1e-5)
    # The padding row of the 3-sequence step wrote its K/V into the scratch page; the eager runner never did.
    for g, layer in ((g, next(i for i, x in enumerate(eager.group_of_layer) if x == g)) for g in range(len(layouts))):
        scratch = padded.scratch_pages[g]
        assert padded.kv_caches[layer][0][scratch, 0].abs().sum() > 0
        assert eager.kv_caches[layer][0][scratch].abs().sum() == 0
        assert padded.kv_caches[layer][0][scratch, 1:].abs().sum() == 0, "one slot of it only"


@needs_kernel
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_every_decode_step_through_the_padded_path_generates_the_eager_tokens(
    tiny_llama: Path, async_scheduling: bool
) -> None:
    config = EngineConfig.of(
        model=str(tiny_llama),
        attention_backend="cpu",
        page_size=4,
        num_pages=96,
        max_model_len=128,
        max_num_seqs=8,
        max_batch_tokens=40,
        async_scheduling=async_scheduling,
        debug_checks=True,
    )
    prompts = [[10 + (i * 7 + j) % 300 for j in range(3 + 4 * i)] for i in range(7)]
    params = [SamplingParams(max_new_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    with EngineCore(config) as engine:
        expected = generate_batch(prompts, params=params, engine=engine)

    counting = _Counting()
    decode_steps: Counter[int] = Counter()

    class DecodeSteps:
        def on_step(self, record: StepRecord) -> None:
            plan = record.plan
            if plan.request_ids and max(plan.num_new_tokens) == 1:
                decode_steps[padded_size(graph_sizes(8), len(plan.request_ids))] += 1

    with EngineCore(config, observers=[DecodeSteps()]) as engine:
        engine.runner.use_decode_graphs(graph_sizes(max_graph_size(config)), counting)
        results = generate_batch(prompts, params=params, engine=engine)
        assert engine.is_idle_and_clean()
    assert {k: r.generated_ids for k, r in results.items()} == {k: r.generated_ids for k, r in expected.items()}
    assert counting.steps == decode_steps, "every decode step went through the padded path, at its padded size"
    assert sum(n for size, n in counting.steps.items() if size > 1) >= 5
    assert np.all(np.asarray(list(counting.steps)) <= 8)


# -- the GPU tests' capturable backend ------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 6])
def test_the_dense_test_backend_matches_the_torch_backend(window: int | None) -> None:
    """tests/test_gpu.py captures decode steps through it: checked here first, on a mixed step."""
    page = 4
    shapes = [(0, 9), (13, 1), (5, 6), (2, 1), (21, 1)]
    needed = [-(-(c + n) // page) for c, n in shapes]
    order = list(range(sum(needed) + 2))[::-1]
    tables = [[order.pop() for _ in range(k)] for k in needed]
    runner = attention_runner(_Shapes(), len(order) + sum(needed), page)
    inputs = runner.prepare(fresh_plan(shapes, tables))
    generator = torch.Generator().manual_seed(0)
    total = sum(n for _, n in shapes)
    q, k, v = (torch.randn(total, h, 8, generator=generator) for h in (4, 2, 2))
    history = [torch.randn(c.shape, generator=generator) for c in runner.kv_caches[0]]
    outputs = []
    for backend in (TorchPagedBackend(), DensePagedBackend()):
        inputs.meta.backend_state.clear()
        backend.prepare(inputs.meta)
        outputs.append(backend.forward(q, k, v, (history[0].clone(), history[1].clone()), inputs.meta, 0.3, window))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
