"""The quantized linear kernels (engine/kernels/cpu_quant_linear.cpp, engine/kernels/quant_linear.py) against the
weights they dequantize to, their torch fallback against the same, the quantizers' round trips, what each accepts,
and the memory a quantizer holds.

The oracle: `int8_linear` / `int4_linear` compute F.linear(x.float(), dequantized) (+ bias) up to float32 rounding
of the sums, at most 1e-5 of sum |x| |w| (the kernels sum in another order, int4's as 16 scale (1 + q / 16) +
(min - 16 scale), int8's with dot products exactly on x's 31 bits below its row's largest), then rounded to x's
dtype (bfloat16: half a step more). `w8a8_linear` computes F.linear(q.float() * s, dequantized) for (q, s) =
quantize_activations(x) to the same tolerance, and its int32 sums exactly: float(q_x @ q_w.T) * s_x * s_w (+ bias)
within 1e-6 (the final rescale's roundings only). int8 is checked in both its layouts: in groups of 4 k where the
kernels have int8 dot products, and the blocked one of CPUs without.

.ci/run runs this file again with FERRY_CPU_ISA=avx2, the kernels built for AVX2 (`vpmaddubsw` for W8A8, int8 in
float32 multiply-adds)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels import build
from engine.kernels import quant_linear as ql
from engine.kernels.build import KernelUnavailable
from engine.kernels.library import load_cpu_kernels
from engine.quantization.gguf import quantize_q4_0, quantize_q8_0

try:
    load_cpu_kernels()
    UNAVAILABLE = ""
except KernelUnavailable as error:
    UNAVAILABLE = str(error)
needs_kernel = pytest.mark.skipif(bool(UNAVAILABLE), reason=f"the CPU kernels do not build here: {UNAVAILABLE}")

ROWS = (1, 3, 17, 70)
"""One row (decode), a short tile, more than two tiles, more than a chunk of 48 rows."""
SCHEMES = ("int8", "int8-blocked", "int4", "w8a8", "int4-f16", "int8-groups", "int8-groups-bf16")
"""int8-blocked: int8 in the layout of CPUs without int8 dot products, whatever this one has; int4-f16, int8-groups:
a GGUF file's Q4_0 and Q8_0 blocks (float16 scales), int8-groups-bf16 the latter with bfloat16 scales."""
SHAPES = {
    "int8": [(37, 19), (100, 256), (16, 3)],
    "int8-blocked": [(37, 19), (100, 256), (16, 3)],
    "w8a8": [(37, 19), (100, 256), (16, 3)],
    "int4": [(37, 64), (100, 256), (21, 128)],
    "int4-f16": [(37, 64), (100, 256), (21, 128)],
    "int8-groups": [(37, 64), (100, 256), (21, 128)],
    "int8-groups-bf16": [(37, 64), (100, 256), (21, 128)],
}
"""(out, in) of each scheme: out not a multiple of 16 (a short last block), odd in where the scheme takes it."""
GROUPS = {64: 32, 256: 128, 128: 64}
"""int4's group size for each width above."""


def _quantize(scheme: str, weight: torch.Tensor) -> tuple:
    if scheme == "int8":
        return ql.quantize_int8(weight), ql.int8_linear, ql.dequantize_int8
    if scheme == "int8-blocked":
        return ql.quantize_int8(weight, dot_products=False), ql.int8_linear, ql.dequantize_int8
    if scheme == "int4":
        return ql.quantize_int4(weight, GROUPS[weight.shape[1]]), ql.int4_linear, ql.dequantize_int4
    if scheme == "int4-f16":
        return ql.pack_int4(*quantize_q4_0(weight), torch.float16), ql.int4_linear, ql.dequantize_int4
    if scheme.startswith("int8-groups"):
        dtype = torch.bfloat16 if scheme.endswith("bf16") else torch.float16
        return ql.pack_int8_groups(*quantize_q8_0(weight), dtype), ql.int8_group_linear, ql.dequantize_int8_groups
    return ql.quantize_w8a8(weight), ql.w8a8_linear, ql.dequantize_w8a8


def _check_against_dequantized(scheme: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(len(scheme))
    for out_features, in_features in SHAPES[scheme]:
        weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
        bias = torch.randn(out_features, generator=generator).to(dtype)
        w, linear, dequantize = _quantize(scheme, weight)
        dequantized = dequantize(w, out_features, in_features)  # [out, in] float32
        inputs = [torch.randn(rows, in_features, generator=generator).to(dtype) for rows in ROWS]
        for x in [*inputs, torch.randn(2, 5, in_features, generator=generator).to(dtype)]:
            for b in (None, bias):
                got = linear(x, w, out_features, b)
                assert got.shape == (*x.shape[:-1], out_features) and got.dtype == dtype
                if scheme == "w8a8":
                    q, scale = ql.quantize_activations(x)
                    x_wide = q.float() * scale
                else:
                    x_wide = x.float()
                want = F.linear(x_wide, dequantized, None if b is None else b.float())
                bound = 1e-5 * (x_wide.abs() @ dequantized.abs().T + (0 if b is None else b.float().abs()))
                if dtype == torch.bfloat16:
                    bound = bound + want.abs() * 2**-8  # the one rounding to bfloat16
                assert ((got.float() - want).abs() <= bound + 1e-6).all(), (scheme, tuple(x.shape), b is None)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_kernels_multiply_by_the_dequantized_weights(scheme: str, dtype: torch.dtype) -> None:
    _check_against_dequantized(scheme, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_without_the_kernels_torch_computes_the_same(
    scheme: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ql, "cpu_kernels_take", lambda x: False)
    _check_against_dequantized(scheme, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_sums_the_integer_products_exactly(dtype: torch.dtype) -> None:
    """x quantized bit for bit as quantize_activations says, the int8 products summed exactly: only the rescale by
    both scales (and the bias) rounds. Sums beyond 2^24 included (in = 2000, codes near 127)."""
    generator = torch.Generator().manual_seed(11)
    for out_features, in_features in [(37, 19), (40, 2000)]:
        weight = torch.randn(out_features, in_features, generator=generator).sign().to(dtype)
        bias = torch.randn(out_features, generator=generator).to(dtype)
        w = ql.quantize_w8a8(weight)
        codes = ql.dequantize_w8a8(w, out_features, in_features) / w.scales[:, None]  # [out, in], exact integers
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=generator).to(dtype)
            x[0, :] = x[0, :].sign()  # a row whose codes are all +-127
            q, scale = ql.quantize_activations(x)
            exact = q.double() @ codes.double().T  # [rows, out]: the integer sums
            want = exact * scale.double() * w.scales.double() + bias.double()
            got = ql.w8a8_linear(x, w, out_features, bias)
            if dtype == torch.float32:
                torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
            else:
                torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=2**-8, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_row_with_a_nan_gives_nans_and_no_other_row_does(scheme: str) -> None:
    w, linear, _ = _quantize(scheme, torch.randn(20, 64))
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    y = linear(x, w, 20, None)
    assert y[1].isnan().all() and y[[0, 2]].isfinite().all()


@needs_kernel
@pytest.mark.skipif(not ql.int8_dot_products(), reason="the kernels have no int8 dot products here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_dot_products_sum_exactly_what_a_row_holds(dtype: torch.dtype) -> None:
    """x in fixed point, 31 bits below its row's largest: a row of values far apart (2^-20 .. 2^12) is summed as
    float64 sums it, but for at most 2^-30 of the largest per term, rounded once."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 300, generator=generator)
    w = ql.quantize_int8(weight)
    dequantized = ql.dequantize_int8(w, 40, 300).double()
    x = torch.randn(4, 300, generator=generator) * 2.0 ** torch.randint(-20, 12, (4, 300), generator=generator)
    x = x.to(dtype)
    want = x.double() @ dequantized.T  # [4, 40]
    largest = x.double().abs().amax(1, keepdim=True)
    bound = 2.0**-30 * largest * dequantized.abs().sum(1) + want.abs() * (2**-24 if dtype == torch.float32 else 2**-8)
    assert ((ql.int8_linear(x, w, 40, None).double() - want).abs() <= bound).all()


@needs_kernel
def test_the_ops_have_shapes_for_torch_compile() -> None:
    """Schemas, fake (meta) shapes and dynamic-shape tracing of the four ops (torch.library.opcheck)."""
    weight = torch.randn(20, 64)
    x = torch.randn(3, 64)
    w8, w4, wa = ql.quantize_int8(weight), ql.quantize_int4(weight, 32), ql.quantize_w8a8(weight)
    wg = ql.pack_int8_groups(*quantize_q8_0(weight), torch.float16)
    ops = torch.ops.ferry_kernels
    for op, args in [
        (ops.int8_linear.default, (x, w8.codes, w8.scales, w8.code_sums, 20, None)),
        (ops.int4_linear.default, (x, w4.codes, w4.scales, w4.mins, 20, torch.randn(20))),
        (ops.int8_group_linear.default, (x, wg.codes, wg.scales, wg.mins, 20, torch.randn(20))),
        (ops.w8a8_linear.default, (x.view(1, 3, 64), wa.codes, wa.scales, wa.code_sums, 20, None)),
    ]:
        torch.library.opcheck(op, args)


def test_what_each_scheme_refuses() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        ql.quantize_int4(torch.randn(4, 48), 32)
    with pytest.raises(ValueError, match="groups are"):
        ql.quantize_int4(torch.randn(4, 64), 16)
    for quantize in (ql.quantize_int8, ql.quantize_w8a8, lambda w: ql.quantize_int4(w, 32)):
        with pytest.raises(ValueError, match="matrix"):
            quantize(torch.randn(64))
        with pytest.raises(ValueError, match="matrix"):
            quantize(torch.randint(0, 3, (4, 64)))
    weight = torch.randn(20, 64)
    for w, linear in [
        (ql.quantize_int8(weight), ql.int8_linear),
        (ql.quantize_int4(weight, 32), ql.int4_linear),
        (ql.quantize_w8a8(weight), ql.w8a8_linear),
    ]:
        with pytest.raises(ValueError, match="input features"):
            linear(torch.randn(2, 60), w, 20, None)


def _weights(draw: Callable, in_multiple: int) -> torch.Tensor:
    """A weight of any scale, with rows of zeros and constant groups among random ones."""
    out_features = draw(st.integers(1, 40))
    in_features = in_multiple * draw(st.integers(1, 4)) + (draw(st.integers(0, 5)) if in_multiple == 1 else 0)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    weight = torch.randn(out_features, in_features, generator=generator) * 2.0 ** draw(st.integers(-20, 20))
    weight += draw(st.sampled_from([0.0, 1.0, -3.0])) * weight.abs().max()  # groups far from zero
    if draw(st.booleans()):
        weight[0] = 0
    if draw(st.booleans()):
        weight[-1, :in_multiple] = weight[-1, 0]
    return weight


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from(["int8", "w8a8"]))
def test_symmetric_codes_are_within_half_a_step(data: st.DataObject, scheme: str) -> None:
    weight = _weights(data.draw, 1)
    out_features, in_features = weight.shape
    w = ql.quantize_int8(weight) if scheme == "int8" else ql.quantize_w8a8(weight)
    dequantize = ql.dequantize_int8 if scheme == "int8" else ql.dequantize_w8a8
    dequantized = dequantize(w, out_features, in_features)
    assert torch.equal(w.scales, weight.abs().amax(1) / 127)
    codes = ql._rows(w.codes, out_features).reshape(out_features, -1)[:, :in_features]  # [out, in] int8
    assert codes.abs().max() <= 127
    slack = 2**-22 * weight.abs()  # the float32 product scale * q
    assert ((weight - dequantized).abs() <= w.scales[:, None] / 2 + slack).all()
    if scheme == "w8a8":
        assert torch.equal(w.code_sums, codes.sum(1, dtype=torch.int32))


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from(ql.INT4_GROUP_SIZES))
def test_int4_codes_are_within_half_a_step(data: st.DataObject, group_size: int) -> None:
    weight = _weights(data.draw, group_size)
    out_features, in_features = weight.shape
    w = ql.quantize_int4(weight, group_size)
    dequantized = ql.dequantize_int4(w, out_features, in_features)
    scales = ql._rows(w.scales, out_features).float().repeat_interleave(group_size, dim=1)  # [out, in]
    mins = ql._rows(w.mins, out_features).float().repeat_interleave(group_size, dim=1)
    by_group = weight.view(out_features, -1, group_size)
    assert (mins.view_as(by_group)[..., 0] <= by_group.amin(-1)).all(), "min rounded down to bfloat16"
    slack = 2**-21 * (weight.abs() + mins.abs())  # the float32 min + scale * q
    assert ((weight - dequantized).abs() <= scales / 2 + slack).all()


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_activations_are_within_half_a_step(data: st.DataObject) -> None:
    x = _weights(data.draw, 1)
    q, scale = ql.quantize_activations(x)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scale.shape == (x.shape[0], 1)
    assert ((x - q.float() * scale).abs() <= scale / 2 + 2**-22 * x.abs()).all()


@pytest.mark.parametrize(
    ("capability", "flags", "forced", "want"),
    [
        ("AVX512", {"avx512_vnni"}, None, ["-mavx512vnni"]),
        ("AVX512", set(), None, []),
        ("AVX2", {"avx_vnni"}, None, ["-mavxvnni"]),
        ("AVX2", {"avx_vnni", "avx512_vnni"}, "avx2", []),
        ("DEFAULT", {"avx_vnni"}, None, []),
    ],
)
def test_int8_dot_products_are_built_only_where_the_cpu_has_them(
    capability: str, flags: set[str], forced: str | None, want: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flags are part of the library's name: a build for one CPU is never loaded on another."""
    monkeypatch.setattr(build, "cpu_capability", lambda: capability)
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(build, "forced_isa", lambda: forced)
    assert build._vnni_flags() == want


_PEAK = """
import torch
from engine.kernels import quant_linear as ql

def peak_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024

torch.set_num_threads(1)  # the peak is the same; a second thread waits on a busy core of a shared machine
schemes = (ql.quantize_int8, ql.quantize_w8a8, lambda w: ql.quantize_int4(w, 128))
for quantize in schemes:  # what a first call allocates once (thread pools, allocator arenas) is not measured
    quantize(torch.randn(256, 4096))
for dtype in (torch.float32, torch.bfloat16):
    weight = torch.randn(2048, 4096).to(dtype)
    for quantize in schemes:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets the peak to the present resident size
        before = peak_mib()
        quantized = quantize(weight)
        grown = peak_mib() - before
        print(round(grown), round(sum(t.numel() * t.element_size() for t in quantized) / 2**20))
        del quantized
"""


def test_quantizing_holds_the_quantized_weight_and_little_else() -> None:
    """A model quantizes layer by layer: beside the weight, its codes (int8 and W8A8: once as rows, as
    `pack_int8` takes them, and once packed) and the float32 temporaries of a few rows at a time (2 MiB each),
    never a float32 copy of the whole weight (32 MiB). float32 and bfloat16 weights."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pytest.skip("no resettable peak resident size here")
    # Large blocks mapped and unmapped as they are allocated and freed: the resident size is what is alive, not
    # what malloc keeps for later.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_PEAK)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    for line, copies in zip(done.stdout.splitlines(), (2, 2, 1) * 2, strict=True):
        grown, quantized = map(int, line.split())
        assert grown <= copies * quantized + 12, done.stdout
