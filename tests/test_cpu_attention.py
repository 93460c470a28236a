"""The C++ CPU paged-attention kernel against the torch backend on random ragged steps, and how it is chosen.

Each step mixes decodes, chunks over cached history and fresh prompts over shuffled pages (page sizes 1 and 16,
sliding windows whose released pages the table marks -1, grouped-query heads, the head sizes models use and one
without a vectorised instance). float32 must agree to ~1e-5; bfloat16 and float16 are compared with the float32
result of the same rounded inputs, within their own precision. Skipped where the kernel cannot be built (no
compiler): the engine then serves with the torch backend, which tests/test_attention.py covers.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.attention as attention
from engine.attention import CpuPagedBackend, TorchPagedBackend, select_backend
from engine.attention.cpu_kernel import KernelUnavailable, load_kernel
from tests.test_attention import attention_runner, fresh_plan

try:
    KERNEL, UNAVAILABLE = load_kernel(), ""
except KernelUnavailable as error:
    KERNEL, UNAVAILABLE = None, str(error)
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"the CPU attention kernel does not build here: {UNAVAILABLE}")

Step = list[tuple[int, int]]  # (tokens cached, tokens computed now) per sequence


def _shapes(kv_heads: int, head_dim: int) -> torch.nn.Module:
    """Just the attributes ModelRunner sizes its cache from."""
    shapes = torch.nn.Module()
    shapes.num_layers, shapes.num_kv_heads, shapes.head_dim = 1, kv_heads, head_dim
    return shapes


def _inputs(step: Step, page_size: int, heads: int, kv_heads: int, dim: int, window: int | None, seed: int):
    """The step's metadata (over shuffled pages), Q/K/V and a random cache, all float32."""
    rng = random.Random(seed)
    pages_of = [-(-(c + n) // page_size) for c, n in step]
    num_pages = sum(pages_of) + 2
    runner = attention_runner(_shapes(kv_heads, dim), num_pages, page_size)
    free = list(range(num_pages))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(pages)] for pages in pages_of]
    if window is not None:
        for table, (computed, _new) in zip(tables, step, strict=True):
            for page in range(max(0, computed - window + 1) // page_size):
                table[page] = -1  # released by the window: never read
    meta = runner.prepare(fresh_plan(step, tables)).meta
    generator = torch.Generator().manual_seed(seed)
    total = sum(n for _, n in step)
    q, k, v = (torch.randn(total, h, dim, generator=generator) for h in (heads, kv_heads, kv_heads))
    cache = tuple(torch.randn(c.shape, generator=generator) for c in runner.kv_caches[0])
    return meta, q, k, v, cache


def _attend(backend, meta, q, k, v, cache, window, dtype=torch.float32, **features) -> torch.Tensor:
    """`backend`'s output for the inputs rounded to `dtype`, on a copy of the cache (forward writes K/V)."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    cache = tuple(c.to(dtype) for c in cache)
    return backend.forward(q, k, v, cache, meta, q.shape[-1] ** -0.5, window, **features)


def _ragged_step(rng: random.Random, decodes: int, max_len: int) -> Step:
    step = [(rng.randint(1, max_len), 1) for _ in range(decodes)]
    step += [(0, rng.randint(2, 70)), (0, 1), (rng.randint(1, max_len), rng.randint(2, 50)), (37, 64), (0, 100)]
    rng.shuffle(step)
    return step


@needs_kernel
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    # The last two: DeepSeek's latent head (its own vectorised instance) and a head past the old scalar limit of 512.
    [(8, 2, 32), (4, 4, 64), (4, 1, 16), (16, 2, 128), (6, 3, 24), (16, 1, 576), (4, 1, 600)],
)
def test_float32_matches_the_torch_backend(
    page_size: int, window: int | None, heads: int, kv_heads: int, dim: int
) -> None:
    step = _ragged_step(random.Random(page_size * dim), decodes=30, max_len=300)
    meta, q, k, v, cache = _inputs(step, page_size, heads, kv_heads, dim, window, seed=dim)
    want = _attend(TorchPagedBackend(), meta, q, k, v, cache, window)
    got = _attend(CpuPagedBackend(KERNEL), meta, q, k, v, cache, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("feature", ["softcap", "alibi"])
@pytest.mark.parametrize("window", [None, 40])
def test_softcap_and_alibi_match_the_torch_backend(feature: str, window: int | None) -> None:
    heads, kv_heads, dim = 4, 2, 32
    step = _ragged_step(random.Random(7), decodes=20, max_len=200)
    meta, q, k, v, cache = _inputs(step, 16, heads, kv_heads, dim, window, seed=7)
    features = {"softcap": 2.0} if feature == "softcap" else {"alibi_slopes": 2.0 ** -torch.arange(1.0, heads + 1.0)}
    want = _attend(TorchPagedBackend(), meta, q, k, v, cache, window, **features)
    got = _attend(CpuPagedBackend(KERNEL), meta, q, k, v, cache, window, **features)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("dim", [32, 24])
def test_half_precisions_within_their_rounding(dtype: torch.dtype, tolerance: float, dim: int) -> None:
    step = _ragged_step(random.Random(3), decodes=20, max_len=200)
    meta, q, k, v, cache = _inputs(step, 16, 8, 2, dim, None, seed=3)
    rounded = [t.to(dtype).float() for t in (q, k, v)]
    want = _attend(TorchPagedBackend(), meta, *rounded, tuple(c.to(dtype).float() for c in cache), None)
    got = _attend(CpuPagedBackend(KERNEL), meta, q, k, v, cache, None, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


@needs_kernel
@pytest.mark.parametrize("window", [None, 120, 40])
def test_bfloat16_fresh_prompts_through_dense_attention(window: int | None) -> None:
    """bfloat16 fresh prompts of 32 tokens and more through torch's causal SDPA (`dense_prompts`), the step's other
    rows (decodes, chunks over cached pages, short prompts) through the kernel in the same call: within bfloat16's
    rounding of the float32 reference, and the split made once for the step. A window shorter than a prompt sends
    the whole step to the kernel."""
    step = _ragged_step(random.Random(5), decodes=12, max_len=200)
    meta, q, k, v, cache = _inputs(step, 16, 8, 2, 64, window, seed=5)
    rounded = [t.to(torch.bfloat16).float() for t in (q, k, v)]
    want = _attend(TorchPagedBackend(), meta, *rounded, tuple(c.to(torch.bfloat16).float() for c in cache), window)
    got = _attend(CpuPagedBackend(KERNEL, dense_prompts=True), meta, q, k, v, cache, window, torch.bfloat16)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    split = meta.backend_state["prompt_split"]
    assert [end - first for first, end in split.prompts] == [n for c, n in step if c == 0 and n >= 32]
    assert split.rest_rows is not None and len(split.rest_rows) == sum(n for c, n in step if c or n < 32)
    kernel_only = _attend(CpuPagedBackend(KERNEL, dense_prompts=False), meta, q, k, v, cache, window, torch.bfloat16)
    if window is not None and split.longest > window:
        torch.testing.assert_close(got, kernel_only, atol=0, rtol=0)


@needs_kernel
def test_threads_split_the_work_without_changing_it() -> None:
    """Items are whole (sequence, query block)s: how they are spread over threads cannot change a bit."""
    step = _ragged_step(random.Random(5), decodes=55, max_len=400)
    meta, q, k, v, cache = _inputs(step, 16, 8, 2, 32, None, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _attend(CpuPagedBackend(KERNEL), meta, q, k, v, cache, None)
        torch.set_num_threads(2)
        two = _attend(CpuPagedBackend(KERNEL), meta, q, k, v, cache, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_kernel
def test_a_page_outside_the_cache_is_an_error_not_a_read() -> None:
    meta, q, k, v, cache = _inputs([(20, 1)], 16, 4, 2, 32, None, seed=0)
    meta.page_tables[0, 0] = len(cache[0])
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        _attend(CpuPagedBackend(KERNEL), meta, q, k, v, cache, None)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    page_size=st.sampled_from([1, 3, 16]),
    heads=st.sampled_from([(1, 1), (4, 2), (8, 1), (3, 3)]),
    dim=st.sampled_from([16, 32, 8]),
    window=st.one_of(st.none(), st.integers(1, 30)),
    step=st.lists(st.tuples(st.integers(0, 80), st.integers(1, 40)), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_any_step_matches_the_torch_backend(
    page_size: int, heads: tuple[int, int], dim: int, window: int | None, step: Step, seed: int
) -> None:
    num_heads, kv_heads = heads
    meta, q, k, v, cache = _inputs(step, page_size, num_heads, kv_heads, dim, window, seed)
    want = _attend(TorchPagedBackend(), meta, q, k, v, cache, window)
    got = _attend(CpuPagedBackend(KERNEL), meta, q, k, v, cache, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_auto_takes_the_kernel_on_cpu() -> None:
    assert isinstance(select_backend("auto", "cpu", 16, torch.float32), CpuPagedBackend)
    assert isinstance(select_backend("cpu", "cpu", 16, torch.bfloat16), CpuPagedBackend)
    assert isinstance(select_backend("torch", "cpu", 16, torch.float32), TorchPagedBackend)


def test_without_the_kernel_auto_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def unavailable() -> None:
        raise KernelUnavailable("no compiler")

    monkeypatch.setattr(attention, "load_kernel", unavailable)
    attention._warn_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="engine.attention"):
        for _ in range(3):
            assert isinstance(select_backend("auto", "cpu", 16, torch.float32), TorchPagedBackend)
    assert len([r for r in caplog.records if "no compiler" in r.getMessage()]) == 1
    with pytest.raises(ValueError, match="does not build here: no compiler"):
        select_backend("cpu", "cpu", 16, torch.float32)


def test_the_cpu_backend_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="runs on the CPU"):
        select_backend("cpu", "cuda", 256, torch.bfloat16)
    assert isinstance(select_backend("auto", "cpu", 16, torch.float64), TorchPagedBackend)
