"""Non-causal spans, attention sinks and a KV cache of another dtype, in every backend that declares them,
against attention written out densely in float64 over the K/V gathered from the pages (dequantized).

One packed step holds fresh prompts, chunks over cached history and decodes, over shuffled pages, with spans
that a fresh prompt holds whole, that a chunk enters from its history, that lie wholly in a chunk's history (no
effect), that cover a whole encoder input, and that reach back past a sliding window. The metadata comes from
the runner, from each request's `noncausal_spans` (`NewRequest`), as the engine builds it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attention import AttentionBackend, TorchPagedBackend, UnsupportedAttention, select_backend
from engine.attention.base import AttentionFeature, AttentionNeeds, SplitSpan, span_intervals, step_spans, write_kv
from engine.core.request import SamplingParams, Spans
from engine.core.step import NewRequest, SchedulerOutput
from tests.test_attention import ALIBI_SLOPES, DIM, HEADS, KV_HEADS, SOFTCAP, _Shapes, attention_runner, backend_named

SINKS = torch.tensor([0.5, -1.0, 2.0, 4.0])
"""One per query head: from a sink that takes little of the softmax to one that takes most of it."""
FP8_SCALES = (0.02, 0.03)
"""k_scale, v_scale: unit-normal K/V divided by these fill most of float8 e4m3's range (448) without saturating."""

# (tokens cached, tokens computed now, spans) per sequence.
SpannedStep = list[tuple[int, int, Spans]]
SPANNED: SpannedStep = [
    (0, 37, ((5, 20),)),  # a fresh prompt holding an image whole
    (0, 30, ((0, 30),)),  # an encoder's whole input
    (90, 30, ((10, 40), (85, 95), (100, 115))),  # one span in its history, one entered from it, one inside
    (50, 1, ((20, 51),)),  # a decode ending a long span: it sees the span's start even past a window
    (70, 1, ((3, 9),)),  # a decode after an image: causal
    (0, 12, ()),
    (33, 9, ()),
]


def _step(rng: random.Random) -> SpannedStep:
    step = SPANNED + [(rng.randint(1, 200), 1, ()) for _ in range(12)] + [(17, 20, ()), (0, 1, ())]
    rng.shuffle(step)
    return step


def _plan(step: SpannedStep, tables: list[list[int]]) -> SchedulerOutput:
    ids = tuple(str(i) for i in range(len(step)))
    return SchedulerOutput(
        request_ids=ids,
        num_computed_tokens=tuple(c for c, _, _ in step),
        num_new_tokens=tuple(n for _, n, _ in step),
        token_ids=tuple(list(range(c, c + n)) for c, n, _ in step),
        samples=(True,) * len(step),
        new_requests=tuple(
            NewRequest(rid, tuple(range(c + n)), (), SamplingParams(), frozenset(), 0, (tuple(table),), spans)
            for rid, (c, n, spans), table in zip(ids, step, tables, strict=True)
        ),
    )


def _reference(q, keys, values, computed, spans, window, *, softcap=None, alibi=False, sinks=None, bidirectional=False):
    """One sequence's queries over its keys ([total, Hkv, D], float64): a dense mask, then softmax."""
    new, total = q.shape[0], keys.shape[0]
    keys = keys.repeat_interleave(HEADS // KV_HEADS, dim=1)
    values = values.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * DIM**-0.5
    query_pos = torch.arange(computed, total)[:, None]
    key_pos = torch.arange(total)[None, :]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi:
        scores = scores + ALIBI_SLOPES.double()[:, None, None] * (key_pos - query_pos)
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    for start, end in spans:
        query_in, key_in = (query_pos >= start) & (query_pos < end), (key_pos >= start) & (key_pos < end)
        if bidirectional:
            # An encoder's span query sees the span's keys within the window on either side, nothing else.
            near = key_in if window is None else key_in & ((key_pos - query_pos).abs() < window)
            allowed = torch.where(query_in, near, allowed)
        else:
            allowed |= query_in & key_in
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink_column = sinks.double()[:, None, None].expand(HEADS, new, 1)
        probs = torch.cat([scores, sink_column], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


def check_against_dense_attention(
    backend: AttentionBackend,
    page_size: int,
    window: int | None,
    *,
    step: SpannedStep,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    scales: tuple[float, float] = (1.0, 1.0),
    softcap: float | None = None,
    alibi: bool = False,
    sinks: torch.Tensor | None = None,
    tolerance: float = 1e-5,
    bidirectional: bool = False,
) -> None:
    """`backend` over the step against `_reference`, sequence by sequence (used by the Triton tests too); the layer's
    window is its KV-cache group's, and `bidirectional` makes it an encoder's."""
    rng = random.Random(page_size)
    pages_of = [-(-(c + n) // page_size) for c, n, _ in step]
    num_pages = sum(pages_of) + 3
    runner = attention_runner(_Shapes(), num_pages, page_size, window=window, bidirectional=bidirectional)
    free = list(range(num_pages))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(pages)] for pages in pages_of]
    host_tables = [list(t) for t in tables]
    if window is not None:
        for table, (computed, _, spans) in zip(host_tables, step, strict=True):
            first_key = min([max(0, computed - window + 1), *(s for s, e in spans if e > computed)])
            for page in range(first_key // page_size):
                table[page] = -1  # released by the window: never read
    meta = runner.prepare(_plan(step, host_tables)).meta
    generator = torch.Generator().manual_seed(page_size)
    total = sum(n for _, n, _ in step)
    q, k, v = (torch.randn(total, h, DIM, generator=generator).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    cache_dtype = cache_dtype or dtype
    cache = tuple(torch.empty(c.shape, dtype=cache_dtype) for c in runner.kv_caches[0])
    slots = torch.arange(cache[0].shape[0] * page_size)
    history = [torch.randn(len(slots), KV_HEADS, DIM, generator=generator) for _ in range(2)]
    write_kv(history[0], history[1], cache, slots, *scales)

    out = backend.forward(
        q,
        k,
        v,
        cache,
        meta,
        DIM**-0.5,
        window,
        softcap=softcap,
        alibi_slopes=ALIBI_SLOPES if alibi else None,
        sinks=sinks,
        k_scale=scales[0],
        v_scale=scales[1],
    )

    assert out.dtype == dtype
    flat = [c.reshape(-1, KV_HEADS, DIM).double() * s for c, s in zip(cache, scales, strict=True)]
    start = 0
    for (computed, new, spans), table in zip(step, tables, strict=True):
        seq_slots = torch.tensor([table[p // page_size] * page_size + p % page_size for p in range(computed + new)])
        want = _reference(
            q[start : start + new],
            flat[0][seq_slots],
            flat[1][seq_slots],
            computed,
            spans,
            window,
            softcap=softcap,
            alibi=alibi,
            sinks=sinks,
            bidirectional=bidirectional,
        )
        torch.testing.assert_close(out[start : start + new].double(), want, atol=tolerance, rtol=tolerance)
        start += new


def _backend(name: str, needs: AttentionNeeds, dtype: torch.dtype = torch.float32) -> AttentionBackend:
    backend = backend_named(name)
    assert not backend.missing(needs, dtype), f"{name} declares it lacks {backend.missing(needs, dtype)}"
    return backend


SPANS = AttentionNeeds(frozenset({AttentionFeature.NONCAUSAL_SPANS}))
SINK = AttentionNeeds(frozenset({AttentionFeature.SINKS}))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("feature", [None, "softcap", "alibi"])
def test_noncausal_spans(backend: str, page_size: int, window: int | None, feature: str | None) -> None:
    check_against_dense_attention(
        _backend(backend, SPANS),
        page_size,
        window,
        step=_step(random.Random(page_size)),
        softcap=SOFTCAP if feature == "softcap" else None,
        alibi=feature == "alibi",
    )


ENCODER_STEP: SpannedStep = [(0, n, ((0, n),)) for n in (1, 7, 30, 64, 90)]
"""An encoder's step: whole inputs, each one span."""


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [None, 5, 24])
def test_an_encoders_spans_see_the_window_on_either_side(backend: str, page_size: int, window: int | None) -> None:
    """ModernBERT's local layers: each key within `window - 1` positions of the query, before or after it."""
    check_against_dense_attention(
        _backend(backend, SPANS), page_size, window, step=ENCODER_STEP, bidirectional=True, sinks=SINKS
    )


def test_span_intervals_take_the_layers_window() -> None:
    bounds = np.array([[0, 0], [2, 9], [2, 9], [2, 9]], dtype=np.int32)
    positions = np.array([1, 2, 5, 8])
    assert span_intervals(bounds, positions, None, False).tolist() == [[0, 0], [0, 9], [0, 9], [0, 9]]
    assert span_intervals(bounds, positions, 2, False).tolist() == [[0, 0], [1, 9], [2, 9], [2, 9]]
    assert span_intervals(bounds, positions, None, True).tolist() == [[0, 0], [2, 9], [2, 9], [2, 9]]
    assert span_intervals(bounds, positions, 2, True).tolist() == [[0, 0], [2, 4], [4, 7], [7, 9]]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("spans", [False, True])
def test_sinks(backend: str, page_size: int, window: int | None, spans: bool) -> None:
    step = _step(random.Random(page_size))
    if not spans:
        step = [(c, n, ()) for c, n, _ in step]
    check_against_dense_attention(_backend(backend, SINK), page_size, window, step=step, sinks=SINKS)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "scales", "tolerance"),
    [
        (torch.float32, torch.bfloat16, (1.0, 1.0), 1e-5),
        (torch.float32, torch.float8_e4m3fn, FP8_SCALES, 1e-5),
        (torch.bfloat16, torch.float8_e4m3fn, FP8_SCALES, 2e-2),
    ],
)
def test_a_cache_of_another_dtype_is_read_back_as_written(
    backend: str, page_size: int, dtype: torch.dtype, cache_dtype: torch.dtype, scales, tolerance: float
) -> None:
    """The reference reads the pages as they hold K/V (rounded to the cache's dtype), so what is compared is the
    conversion on the way in and out, and a fresh prompt seeing its own K/V as later steps will."""
    backend_ = _backend(backend, AttentionNeeds(kv_cache_dtype=cache_dtype), dtype)
    step = [(c, n, ()) for c, n, _ in _step(random.Random(page_size))]
    check_against_dense_attention(
        backend_,
        page_size,
        24,
        step=step,
        dtype=dtype,
        cache_dtype=cache_dtype,
        scales=scales,
        sinks=SINKS,
        tolerance=tolerance,
    )


def test_float8_writes_saturate_instead_of_overflowing() -> None:
    cache = (torch.zeros(1, 2, 1, 2, dtype=torch.float8_e4m3fn), torch.zeros(1, 2, 1, 2, dtype=torch.float8_e4m3fn))
    big = torch.tensor([[[1e6, -1e6]], [[1.0, 2.0]]])
    write_kv(big, big, cache, torch.tensor([0, 1]), 0.5, 1.0)
    assert cache[0].float().flatten().tolist() == [448.0, -448.0, 2.0, 4.0]
    assert cache[1].float().flatten().tolist() == [448.0, -448.0, 1.0, 2.0]


def test_step_spans_cover_the_queries_inside_them_and_refuse_a_cut() -> None:
    spans, bounds = step_spans([((2, 6),), (), ((0, 3), (8, 12))], np.array([0, 4, 9]), np.array([8, 5, 12]))
    assert spans == [((2, 6),), (), ((8, 12),)]
    assert bounds.tolist() == [[0, 0]] * 2 + [[2, 6]] * 4 + [[0, 0]] * 3 + [[8, 12]] * 3
    assert step_spans([((0, 3),)], np.array([5]), np.array([6])) is None  # in the history only
    with pytest.raises(SplitSpan, match=r"inside the non-causal span \[2, 6\)"):
        step_spans([((2, 6),)], np.array([0]), np.array([4]))


def test_every_backend_declares_what_it_computes() -> None:
    torch_backend = TorchPagedBackend()
    assert torch_backend.missing(AttentionNeeds(frozenset(AttentionFeature), torch.float8_e4m3fn), torch.bfloat16) == []
    assert torch_backend.missing(AttentionNeeds(kv_cache_dtype=torch.int8), torch.float32) == [
        "a torch.int8 KV cache for a torch.float32 model"
    ]


def test_an_explicit_backend_lacking_a_need_is_refused_by_name_and_auto_passes_over_it() -> None:
    cache = AttentionNeeds(kv_cache_dtype=torch.float16)
    backend_named("cpu")  # skips where the kernel does not build
    with pytest.raises(UnsupportedAttention, match=r"'cpu' cannot compute a torch.float16 KV cache for a torch"):
        select_backend("cpu", "cpu", 16, torch.float32, cache)
    assert isinstance(select_backend("auto", "cpu", 16, torch.float32, cache), TorchPagedBackend)
    assert select_backend("auto", "cpu", 16, torch.float32, SINK).name in ("cpu", "torch")
    with pytest.raises(UnsupportedAttention, match=r"'torch' cannot compute a torch.int8 KV cache"):
        select_backend("torch", "cpu", 16, torch.float32, AttentionNeeds(kv_cache_dtype=torch.int8))


def test_flash_declares_no_sinks_spans_latents_or_other_cache_and_auto_on_cuda_takes_triton(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("triton")
    from engine.attention.flash import FlashBackend

    needs = AttentionNeeds(frozenset(AttentionFeature), torch.float8_e4m3fn)
    assert FlashBackend.missing(needs, torch.bfloat16) == [
        "attention sinks",
        "non-causal spans",
        AttentionFeature.LATENT.value,  # flash-attn's heads stop at 256; a latent's is 576
        "a torch.float8_e4m3fn KV cache for a torch.bfloat16 model",
    ]
    monkeypatch.setattr("engine.attention.flash.flash_available", lambda: True)
    for need in (SINK, SPANS, AttentionNeeds(kv_cache_dtype=torch.float16)):
        assert select_backend("auto", "cuda", 256, torch.bfloat16, need).name == "triton"
    # float8 caches too (below compute capability 8.9 the torch backend: tests/test_kv_cache_fp8.py).
    assert (
        select_backend("auto", "cuda", 256, torch.bfloat16, AttentionNeeds(kv_cache_dtype=torch.float8_e4m3fn)).name
        == "triton"
    )
    # A latent (MLA) head: neither flash-attn nor, until it has run on a GPU, the Triton kernel.
    latent = AttentionNeeds(frozenset({AttentionFeature.LATENT}))
    assert select_backend("auto", "cuda", 256, torch.bfloat16, latent).name == "torch"


def test_the_runner_refuses_a_plan_that_cuts_a_span() -> None:
    runner = attention_runner(_Shapes(), 8, 4)
    with pytest.raises(SplitSpan, match=r"up to 6, inside the non-causal span \[3, 9\)"):
        runner.prepare(_plan([(0, 6, ((3, 9),))], [[0, 1, 2]]))


@st.composite
def _spanned_steps(draw: st.DrawFn) -> SpannedStep:
    """Sequences of up to 40 tokens, each with up to two spans that its step enters whole or not at all."""
    step = []
    for _ in range(draw(st.integers(1, 6))):
        computed, new = draw(st.integers(0, 30)), draw(st.integers(1, 10))
        total = computed + new
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=0, max_size=4, unique=True)))
        spans = tuple((s, e) for s, e in zip(cuts[::2], cuts[1::2], strict=False) if e > s)
        step.append((computed, new, spans))
    return step


@given(step=_spanned_steps(), page_size=st.sampled_from([1, 4, 16]), window=st.sampled_from([None, 5]))
@settings(max_examples=40, deadline=None)
def test_random_spans_match_dense_attention(step: SpannedStep, page_size: int, window: int | None) -> None:
    for name in ("torch", "cpu"):
        check_against_dense_attention(_backend(name, SPANS), page_size, window, step=step, sinks=SINKS)
