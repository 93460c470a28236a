"""The Triton paged-attention kernel, run by Triton's interpreter on CPU tensors, against the torch backend (and
float64 attention written out by hand), and how it is chosen.

Triton decides when a kernel is decorated whether it is interpreted, for its own library functions too (decorated
when triton is first imported), so tests/conftest.py turns the interpreter on (`TRITON_INTERPRET=1`) before
anything imports triton, on machines without a CUDA device; where one is, the kernel runs compiled in
tests/test_gpu.py and the interpreted tests here are skipped. The interpreter runs each program in numpy, slowly:
the steps are tiny, but each still holds every kind of sequence (decodes, fresh prompts, chunks over cached pages)
over shuffled pages. A compile of the kernel for an H100/H200 needs no GPU and runs everywhere, in a process of
its own (this one interprets). Skipped where triton is not installed (it is in the `test` extra; torch's CUDA
wheels bring it too).
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.attention as attention
from engine.attention import StepMetadata, TorchPagedBackend, select_backend
from engine.attention.base import AttentionNeeds
from tests.test_attention import (
    ALIBI_SLOPES,
    DIM,
    HEADS,
    KV_HEADS,
    SOFTCAP,
    _reference,
    _Shapes,
    attention_runner,
    fresh_plan,
)
from tests.test_attention_features import SINKS, check_against_dense_attention
from tests.test_cpu_attention import Step, _attend, _inputs

triton = pytest.importorskip("triton", reason="triton is in the `test` extra: pip install -e '.[test]'")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402 - only once triton is known to be there

from engine.attention import triton_paged  # noqa: E402

INTERPRETED = isinstance(triton_paged._paged_attention_kernel, InterpretedFunction)
interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="a CUDA device is here: the kernel runs compiled (test_gpu.py)"
)
# A small step of every kind: fresh prompts (one of a single token), decodes of several lengths, chunks over
# cached history; (tokens cached, tokens computed now) per sequence.
MIXED: Step = [(0, 9), (0, 1), (21, 1), (5, 1), (40, 1), (13, 6), (30, 12), (2, 17)]
DECODES: Step = [(21, 1), (5, 1), (40, 1), (0, 1), (63, 1), (16, 1)]


def _triton() -> attention.AttentionBackend:
    return triton_paged.TritonPagedBackend()


def _shuffled(step: Step, seed: int) -> Step:
    step = list(step)
    random.Random(seed).shuffle(step)
    return step


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the kernel runs compiled")
def test_without_a_gpu_the_kernel_runs_interpreted_not_skipped() -> None:
    assert INTERPRETED
    assert triton_paged.TritonPagedBackend.capturable


@interpreted
@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("window", [None, 24])
def test_mixed_step_matches_the_torch_backend(page_size: int, window: int | None) -> None:
    step = _shuffled(MIXED, page_size)
    meta, q, k, v, cache = _inputs(step, page_size, 8, 2, 32, window, seed=page_size)
    want = _attend(TorchPagedBackend(), meta, q, k, v, cache, window)
    got = _attend(_triton(), meta, q, k, v, cache, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(4, 4, 32), (4, 1, 16), (6, 2, 24), (2, 1, 128)],
    ids=["mha", "mqa", "group-of-3-dim-24", "dim-128"],
)
def test_head_layouts_match_the_torch_backend(heads: int, kv_heads: int, dim: int) -> None:
    step = _shuffled(MIXED, dim)
    meta, q, k, v, cache = _inputs(step, 16, heads, kv_heads, dim, None, seed=dim)
    want = _attend(TorchPagedBackend(), meta, q, k, v, cache, None)
    got = _attend(_triton(), meta, q, k, v, cache, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("feature", [None, "softcap", "alibi"])
def test_each_sequence_matches_float64_attention(window: int | None, feature: str | None) -> None:
    """tests/test_attention.py's float64 reference (4 query heads over 2 KV heads of size 8), sequence by
    sequence, with soft-capped scores and ALiBi biases as that file's backends get them."""
    step = _shuffled(MIXED, 3)
    page_size = 8
    pages_of = [-(-(c + n) // page_size) for c, n in step]
    runner = attention_runner(_Shapes(), sum(pages_of) + 1, page_size)
    free = list(range(sum(pages_of) + 1))
    random.Random(4).shuffle(free)
    tables = [[free.pop() for _ in range(pages)] for pages in pages_of]
    meta = runner.prepare(fresh_plan(step, tables)).meta
    generator = torch.Generator().manual_seed(5)
    total = sum(n for _, n in step)
    q, k, v = (torch.randn(total, h, DIM, generator=generator) for h in (HEADS, KV_HEADS, KV_HEADS))
    cache = tuple(torch.randn(c.shape, generator=generator) for c in runner.kv_caches[0])
    features = {"softcap": SOFTCAP} if feature == "softcap" else {}
    if feature == "alibi":
        features = {"alibi_slopes": ALIBI_SLOPES}
    out = _triton().forward(q, k, v, cache, meta, DIM**-0.5, window, **features)
    start = 0
    for (computed, new), table in zip(step, tables, strict=True):
        want = _reference(q[start : start + new], cache, table, computed, new, page_size, window, feature)
        torch.testing.assert_close(out[start : start + new].double(), want, atol=1e-5, rtol=1e-5)
        start += new


@interpreted
@pytest.mark.parametrize("feature", ["softcap", "alibi"])
def test_softcap_and_alibi_with_a_window_match_the_torch_backend(feature: str) -> None:
    heads = 4
    meta, q, k, v, cache = _inputs(_shuffled(MIXED, 9), 16, heads, 2, 32, 10, seed=9)
    features = {"softcap": 2.0} if feature == "softcap" else {"alibi_slopes": 2.0 ** -torch.arange(1.0, heads + 1.0)}
    want = _attend(TorchPagedBackend(), meta, q, k, v, cache, 10, **features)
    got = _attend(_triton(), meta, q, k, v, cache, 10, **features)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("window", [None, 7])
def test_decode_only_step_matches_the_torch_backend(window: int | None) -> None:
    """T == B: the decode grid, one program per (sequence, KV head) serving its 4 query heads."""
    meta, q, k, v, cache = _inputs(DECODES, 16, 8, 2, 32, window, seed=11)
    want = _attend(TorchPagedBackend(), meta, q, k, v, cache, window)
    got = _attend(_triton(), meta, q, k, v, cache, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@interpreted
def test_padded_decode_rows_do_not_disturb_the_real_ones() -> None:
    """What a CUDA-graph replay adds to fill its static batch: sequences of seq_len 1, all over one scratch page
    (their K/V all written into its first slot)."""
    page_size, pads = 16, 3
    pages_of = [-(-(c + n) // page_size) for c, n in DECODES]
    scratch = sum(pages_of)
    runner = attention_runner(_Shapes(), scratch + 1, page_size)
    tables = [list(range(sum(pages_of[:i]), sum(pages_of[: i + 1]))) for i in range(len(DECODES))]
    padded = runner.prepare(fresh_plan([*DECODES, *[(0, 1)] * pads], [*tables, *[[scratch]] * pads])).meta
    real = attention_runner(_Shapes(), scratch + 1, page_size).prepare(fresh_plan(DECODES, tables)).meta
    generator = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(len(DECODES) + pads, h, 8, generator=generator) for h in (4, 2, 2))
    cache = tuple(torch.randn(c.shape, generator=generator) for c in runner.kv_caches[0])
    rows = len(DECODES)
    alone = _attend(_triton(), real, q[:rows], k[:rows], v[:rows], cache, None)
    with_pads = _attend(_triton(), padded, q, k, v, cache, None)
    assert torch.equal(with_pads[:rows], alone)
    torch.testing.assert_close(alone, _attend(TorchPagedBackend(), real, q[:rows], k[:rows], v[:rows], cache, None))


def _wider_table_buffer(meta: StepMetadata) -> torch.Tensor:
    """`meta.page_tables` as a column slice of a wider buffer whose other columns point outside the cache."""
    rows, width = meta.page_tables.shape
    buffer = torch.full((rows, width + 5), 10**6, dtype=torch.int32)
    buffer[:, 2 : 2 + width] = meta.page_tables
    return buffer[:, 2 : 2 + width]


@interpreted
def test_page_table_rows_are_read_through_their_stride() -> None:
    meta, q, k, v, cache = _inputs(_shuffled(MIXED, 13), 8, 4, 2, 16, None, seed=13)
    want = _attend(_triton(), meta, q, k, v, cache, None)
    meta.page_tables = _wider_table_buffer(meta)
    assert not meta.page_tables.is_contiguous()
    assert torch.equal(_attend(_triton(), meta, q, k, v, cache, None), want)


@pytest.fixture
def bfloat16_dots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter (3.9) multiplies bfloat16 tiles as the raw bits numpy holds them in (uint16): widen
    them to float32 first, exactly (a bfloat16 is the top half of a float32), as the GPU's products are."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    create_dot = builder.create_dot

    def widened(handle: interpreter.TensorHandle) -> interpreter.TensorHandle:
        if handle.dtype != tl.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    monkeypatch.setattr(builder, "create_dot", lambda a, b, *rest: create_dot(widened(a), widened(b), *rest))


@interpreted
@pytest.mark.usefixtures("bfloat16_dots")
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_half_precisions_within_their_rounding(dtype: torch.dtype, tolerance: float) -> None:
    meta, q, k, v, cache = _inputs(_shuffled(MIXED, 14), 16, 8, 2, 32, None, seed=14)
    rounded = [t.to(dtype).float() for t in (q, k, v)]
    want = _attend(TorchPagedBackend(), meta, *rounded, tuple(c.to(dtype).float() for c in cache), None)
    got = _attend(_triton(), meta, q, k, v, cache, None, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


@interpreted
@settings(max_examples=12, deadline=None)
@given(
    page_size=st.sampled_from([8, 16]),
    heads=st.sampled_from([(2, 1), (4, 2), (3, 3)]),
    window=st.one_of(st.none(), st.integers(1, 20)),
    step=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_any_step_matches_the_torch_backend(
    page_size: int, heads: tuple[int, int], window: int | None, step: Step, seed: int
) -> None:
    num_heads, kv_heads = heads
    meta, q, k, v, cache = _inputs(step, page_size, num_heads, kv_heads, 16, window, seed)
    want = _attend(TorchPagedBackend(), meta, q, k, v, cache, window)
    got = _attend(_triton(), meta, q, k, v, cache, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ compiled for a GPU


_COMPILE_FOR_HOPPER = """
import inspect, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.attention.triton_paged import _paged_attention_kernel as kernel

# (queries, cache): the model's own dtype, and bfloat16 over float8 e4m3 (--kv-cache-dtype fp8).
for dtype, cache in (("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp8e4nv")):
    for decode in (True, False):
        constants = {
            "GROUP": 4, "BLOCK_M": 16 if decode else 64, "BLOCK_Q": 1 if decode else 16, "BLOCK_N": 32,
            "BLOCK_D": 128, "DECODE": decode, "USE_SOFTCAP": True, "USE_ALIBI": True,
            "USE_SINKS": True, "USE_SPANS": True,
            "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
        }
        pointers = {"query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "page_tables_ptr": "*i32",
                    "alibi_slopes_ptr": "*fp32", "sinks_ptr": "*fp32", "token_spans_ptr": "*i32"}
        signature = {}
        for name in inspect.signature(kernel.fn).parameters:
            if name in constants:
                signature[name] = "constexpr"
            elif name in ("key_cache_ptr", "value_cache_ptr"):
                signature[name] = "*" + cache
            elif name.endswith("_ptr"):
                signature[name] = pointers.get(name, "*" + dtype)
            else:
                signature[name] = "fp32" if name in ("scale", "v_scale", "softcap") else "i32"
        compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], (dtype, cache, decode)
        print("compiled", dtype, "over", cache, "decode" if decode else "prefill")
"""


def test_the_kernel_compiles_for_hopper_without_a_gpu() -> None:
    """What the interpreter does not check (types carried through loops and branches, layouts, shared memory):
    Triton's whole compiler, down to ptxas, for sm_90 (H100 / H200), every feature on, bfloat16 and float32 (and
    bfloat16 over a float8 e4m3 cache), decode and prefill grids, at the shapes a GQA model with head size 128
    gets. In a process of its own: this one may interpret, which Triton settles when it is imported."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns while its default is unset
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_COMPILE_FOR_HOPPER)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled") == 6


# ------------------------------------------------------------------------------------------------ selection


def test_triton_is_chosen_explicitly_on_cpu_only_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs on CUDA, not cpu"):
        select_backend("triton", "cpu", 16, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("triton", "cpu", 16, torch.bfloat16).name == "triton"
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        select_backend("triton", "cpu", 16, torch.float64)
    assert select_backend("auto", "cpu", 16, torch.float32).name in ("cpu", "torch")  # never triton on CPU


def test_auto_on_cuda_takes_triton_without_flash_paging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("engine.attention.flash.flash_available", lambda: False)
    for dtype in (torch.float32, torch.bfloat16):
        assert select_backend("auto", "cuda", 16, dtype).name == "triton"
    assert select_backend("auto", "cuda", 16, torch.float64).name == "torch"


def test_without_triton_auto_falls_back_and_triton_is_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(attention, "_triton_installed", lambda: False)
    monkeypatch.setattr("engine.attention.flash.flash_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="engine.attention"):
        assert isinstance(select_backend("auto", "cuda", 16, torch.bfloat16), TorchPagedBackend)
    assert "the triton package" in caplog.text
    with pytest.raises(ValueError, match="needs the triton package"):
        select_backend("triton", "cuda", 16, torch.bfloat16)


# ------------------------------------------------------------------------------------- spans, sinks, cache dtypes

# MIXED's kinds of sequence, with spans: a fresh prompt holding one, a decode ending a long one (past a window of
# 8), a chunk entering one from its history, a chunk ending with one.
SPANNED = [
    (0, 9, ((2, 7),)),
    (21, 1, ((9, 22),)),
    (5, 1, ()),
    (13, 6, ((10, 16),)),
    (30, 12, ((1, 4), (35, 42))),
    (2, 17, ()),
]


@interpreted
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("feature", [None, "alibi", "sinks"])
def test_noncausal_spans_and_sinks_match_float64_attention(window: int | None, feature: str | None) -> None:
    check_against_dense_attention(
        _triton(), 8, window, step=SPANNED, alibi=feature == "alibi", sinks=SINKS if feature == "sinks" else None
    )


@interpreted
@pytest.mark.parametrize("window", [None, 5])
def test_an_encoders_spans_see_the_window_on_either_side(window: int | None) -> None:
    step = [(0, n, ((0, n),)) for n in (1, 9, 20)]
    check_against_dense_attention(_triton(), 8, window, step=step, bidirectional=True)


@interpreted
def test_sinks_in_a_decode_only_step() -> None:
    check_against_dense_attention(_triton(), 4, None, step=[(c, n, ()) for c, n in DECODES], sinks=SINKS)


@interpreted
@pytest.mark.usefixtures("bfloat16_dots")
@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "tolerance"),
    [
        (torch.float32, torch.bfloat16, 1e-5),
        (torch.bfloat16, torch.float16, 2e-2),
        (torch.float16, torch.float32, 3e-3),
    ],
)
def test_a_cache_of_another_dtype_is_read_back_as_written(
    dtype: torch.dtype, cache_dtype: torch.dtype, tolerance: float
) -> None:
    backend = _triton()
    assert not backend.missing(AttentionNeeds(kv_cache_dtype=cache_dtype), dtype)
    step = [(c, n, ()) for c, n, _ in SPANNED]
    check_against_dense_attention(
        backend, 8, 8, step=step, dtype=dtype, cache_dtype=cache_dtype, scales=(0.5, 2.0), tolerance=tolerance
    )
