"""The CPU paged attention backends (torch, and the C++ kernel where it builds) against attention written out
naively in float64, one sequence at a time.

One packed step holds every kind of sequence: fresh prompts, chunks over cached history, and decodes of many
lengths (so they fall into several length groups), over shuffled pages, with and without a sliding window
(pages the window released are marked -1, as the page pool does), plain, with soft-capped scores and with ALiBi
biases.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import PretrainedConfig

from engine.attention import AttentionBackend, CpuPagedBackend, TorchPagedBackend
from engine.attention.cpu_kernel import KernelUnavailable, load_kernel
from engine.attention.spec import FullAttentionSpec
from engine.config import EngineConfig
from engine.core.kv_cache import GroupLayout
from engine.core.request import SamplingParams
from engine.core.step import NewRequest, SchedulerOutput
from engine.execution.runner import ModelRunner
from engine.models.loader import LoadedModel
from engine.pooling.config import PoolingConfig
from engine.pooling.pooler import Pooler

HEADS, KV_HEADS, DIM = 4, 2, 8
SOFTCAP = 2.0
ALIBI_SLOPES = torch.tensor([2.0**-3, 2.0**-5, 2.0**-7, 2.0**-9])
ONE_GROUP = [GroupLayout(None, (0,), 1)]
CPU = torch.device("cpu")


class _Shapes(torch.nn.Module):
    """The K/V heads of the one attention layer whose attention a test drives."""

    num_layers, num_kv_heads, head_dim = 1, KV_HEADS, DIM


class _CacheOnly(torch.nn.Module):
    """A model that is only its layer's cache spec: what ModelRunner sizes and allocates its cache from."""

    def __init__(self, shapes: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_layers = shapes.num_layers
        self._specs = [FullAttentionSpec(shapes.num_kv_heads, shapes.head_dim, dtype)] * shapes.num_layers

    def cache_specs(self) -> list[FullAttentionSpec]:
        return self._specs


def attention_runner(
    shapes: torch.nn.Module,
    num_pages: int,
    page_size: int,
    *,
    device: torch.device = CPU,
    dtype: torch.dtype = torch.float32,
    max_model_len: int = 512,
    window: int | None = None,
    bidirectional: bool = False,
) -> ModelRunner:
    """A runner around a model that has only the shapes the KV cache is sized from (its attention is tested): one
    KV-cache group of `window`; `bidirectional`, an encoder's (its spans see their keys within the window either
    way, engine/attention/base.py)."""
    model = _CacheOnly(shapes, dtype)
    pooler = (
        Pooler(PoolingConfig("embed", "cls", False, 16, bidirectional=True), model, device, dtype)
        if bidirectional
        else None
    )
    loaded = LoadedModel(
        model,
        PretrainedConfig(vocab_size=16),
        frozenset(),
        max_model_len,
        device,
        dtype,
        True,
        TorchPagedBackend(),
        pooler=pooler,
    )
    config = EngineConfig.of(model="unused", page_size=page_size, max_batch_tokens=4096, max_num_seqs=64)
    return ModelRunner(loaded, [GroupLayout(window, (0,), 1)], [num_pages], config)


def fresh_plan(shapes: list[tuple[int, int]], tables: list[list[int]]) -> SchedulerOutput:
    """A step of fresh sequences: sequence i has `computed` tokens cached and computes `new` more."""
    ids = tuple(str(i) for i in range(len(shapes)))
    return SchedulerOutput(
        request_ids=ids,
        num_computed_tokens=tuple(c for c, _ in shapes),
        num_new_tokens=tuple(n for _, n in shapes),
        token_ids=tuple(list(range(c, c + n)) for c, n in shapes),
        samples=(True,) * len(shapes),
        new_requests=tuple(
            NewRequest(rid, tuple(range(c + n)), (), SamplingParams(), frozenset(), 0, (tuple(table),))
            for rid, (c, n), table in zip(ids, shapes, tables, strict=True)
        ),
    )


def _reference(q, cache, table, computed, new, page_size, window, feature=None):
    """Queries of one sequence over all of its keys, written out with an explicit mask."""
    total = computed + new
    slots = torch.tensor([table[p // page_size] * page_size + p % page_size for p in range(total)])
    keys = cache[0].reshape(-1, KV_HEADS, DIM)[slots].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    values = cache[1].reshape(-1, KV_HEADS, DIM)[slots].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * DIM**-0.5
    query_pos = torch.arange(computed, total)[:, None]
    key_pos = torch.arange(total)[None, :]
    if feature == "softcap":
        scores = SOFTCAP * torch.tanh(scores / SOFTCAP)
    if feature == "alibi":
        scores = scores + ALIBI_SLOPES.double()[:, None, None] * (key_pos - query_pos)
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)


def backend_named(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchPagedBackend()
    try:
        return CpuPagedBackend(load_kernel())
    except KernelUnavailable as error:
        pytest.skip(f"the CPU attention kernel does not build here: {error}")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("feature", [None, "softcap", "alibi"])
def test_packed_step_equals_each_sequence_alone(
    backend: str, page_size: int, window: int | None, feature: str | None
) -> None:
    rng = random.Random(page_size)
    decodes = [(rng.randint(1, 300), 1) for _ in range(40)]
    shapes = [(0, 37), (0, 5), (90, 30), (17, 64), *decodes, (200, 1), (0, 1)]
    rng.shuffle(shapes)
    tables_needed = [-(-(c + n) // page_size) for c, n in shapes]
    num_pages = sum(tables_needed) + 3
    runner = attention_runner(_Shapes(), num_pages, page_size)
    free = list(range(num_pages))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(pages)] for pages in tables_needed]
    host_tables = [list(t) for t in tables]
    if window is not None:
        for table, (computed, _new) in zip(host_tables, shapes, strict=True):
            first_key = max(0, computed - window + 1)
            for page in range(first_key // page_size):
                table[page] = -1  # released by the window: never read
    inputs = runner.prepare(fresh_plan(shapes, host_tables))
    generator = torch.Generator().manual_seed(0)
    total = sum(n for _, n in shapes)
    q, k, v = (torch.randn(total, h, DIM, generator=generator) for h in (HEADS, KV_HEADS, KV_HEADS))
    cache = tuple(torch.randn(c.shape, generator=generator) for c in runner.kv_caches[0])

    softcap = SOFTCAP if feature == "softcap" else None
    slopes = ALIBI_SLOPES if feature == "alibi" else None
    out = backend_named(backend).forward(
        q, k, v, cache, inputs.meta, DIM**-0.5, window, softcap=softcap, alibi_slopes=slopes
    )

    start = 0
    for (computed, new), table in zip(shapes, tables, strict=True):
        want = _reference(q[start : start + new], cache, table, computed, new, page_size, window, feature)
        torch.testing.assert_close(out[start : start + new].double(), want, atol=1e-5, rtol=1e-5)
        start += new


def test_decodes_of_similar_length_share_one_group() -> None:
    """Grouping is what makes decode cheap: 20 decodes of near-equal length (7-8 pages) are one attention call."""
    runner = attention_runner(_Shapes(), 200, 16)
    lengths = [100 + i for i in range(20)] + [400]
    tables = []
    next_page = 0
    for length in lengths:
        pages = -(-length // 16)
        tables.append(list(range(next_page, next_page + pages)))
        next_page += pages
    inputs = runner.prepare(fresh_plan([(length - 1, 1) for length in lengths], tables))
    plan = TorchPagedBackend._build_plan(inputs.meta, None, torch.float32)
    assert [len(g.rows) for g in plan.groups] == [20, 1]
    assert plan.chunks == []


def test_alibi_masks_are_built_once_per_step_not_per_layer() -> None:
    """Layers sharing the model's slopes tensor share one plan: its biased masks are built on the first layer."""
    runner = attention_runner(_Shapes(), 16, 4)
    inputs = runner.prepare(fresh_plan([(0, 6), (9, 1), (5, 3)], [[0, 1], [2, 3, 4], [5, 6]]))
    q, k, v = torch.randn(10, HEADS, DIM), torch.randn(10, KV_HEADS, DIM), torch.randn(10, KV_HEADS, DIM)
    cache = tuple(torch.zeros(c.shape) for c in runner.kv_caches[0])
    backend = TorchPagedBackend()
    for _layer in range(3):
        backend.forward(q, k, v, cache, inputs.meta, DIM**-0.5, None, alibi_slopes=ALIBI_SLOPES)
    backend.forward(q, k, v, cache, inputs.meta, DIM**-0.5, None)
    assert set(inputs.meta.backend_state) == {(None, id(ALIBI_SLOPES)), (None, None)}
