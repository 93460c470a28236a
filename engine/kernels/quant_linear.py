"""Quantized linear layers on the CPU: weights quantized once at load, multiplied by `cpu_quant_linear.cpp`'s kernels
(`torch.ops.ferry_kernels.int8_linear`, `int4_linear`, `int8_group_linear`, `w8a8_linear`, in
engine/kernels/library.py's extension),
or where that cannot be built by torch ops of the same arithmetic (slower: Ferry never refuses to run for lack of a
kernel).

Four schemes, each a `NamedTuple` of the tensors its layout needs, a quantizer (or a packer of codes quantized
elsewhere) and a dequantizer that gives back the float32 `[out, in]` weights the kernel multiplies by:

- **int8** (`quantize_int8` / `pack_int8`, `int8_linear`): weight-only, symmetric per output row, `scale =
  max |w| / 127`, codes in [-127, 127]; y = scale * (x @ codes.T). Where the kernels have int8 dot products
  (AVX512-VNNI, AVX-VNNI) x goes in as 31-bit fixed point below its row's largest |x| and the sums are exact,
  rounded once (x exact to 2^-31 of that largest); elsewhere float32 multiply-adds of x as it is. Any `in`.
- **int4** (`quantize_int4`, `int4_linear`): weight-only, asymmetric in groups of 32, 64 or 128 along `in`:
  `w = min + scale * q`, q in 0..15, a bfloat16 scale and min per (output row, group) (scale rounded up and min
  down to bfloat16, so the group's range is still covered: |w - dequantized| <= scale / 2); a checkpoint's codes
  (`pack_int4`) may keep float16 ones. `in` must be a multiple of the group.
- **int8 in groups** (`pack_int8_groups`, `int8_group_linear`): weight-only 8-bit codes of a quantized checkpoint
  (GGUF Q8_0, GPTQ 8-bit, compressed-tensors int8 by group): `w = min + scale * q`, q in 0..255, a scale and min per
  (output row, group of a multiple of 4 columns). int4 and these keep scales and minimums in bfloat16 or in
  float16, a checkpoint's own float16 scales (GPTQ's, GGUF's) exactly.
- **W8A8** (`quantize_w8a8` / `pack_w8a8`, `w8a8_linear`): int8 weights as int8's, and the activations quantized
  per row as they come (`quantize_activations`: symmetric int8, scale = max |x| / 127): int8 x int8 products summed
  exactly in int32, rescaled by both scales. Any `in`.

A quantizer raises ValueError for what its scheme does not take; a linear, for x without the weight's `in`.

Layouts: blocks of 16 output rows, as the blocked bfloat16 kernel's (engine/kernels/linear.py), the rows past `out`
zero; the source's header says how each block is laid out and why.

Backend, measured before choosing (scripts/bench_quant_linear.py: each layer's copies streamed out of DRAM as a
model's layers are; Intel Xeon with AVX512-BF16, AVX512-VNNI, AVX-VNNI, AMX-BF16/INT8, 2 cores of a shared VM;
bfloat16 x; milliseconds a call (speed against the blocked bfloat16 kernel); one thread, 2T: two; torch int4:
`aten._weight_int4pack_mm_for_cpu` in groups of 128; oneDNN w8a8: `onednn.qlinear_pointwise` on activations
quantized per row in torch, rescaled after):

    out x in     rows   bf16         int8     int4/128      int4/32         w8a8   torch int8   torch int4  oneDNN w8a8
    4864x896        1  0.952 0.544 (1.75) 0.344 (2.77) 0.384 (2.48) 0.512 (1.86) 0.906 (1.05) 0.406 (2.34) 0.793 (1.20)
    4864x896        8  1.475 0.928 (1.59) 0.718 (2.05) 0.803 (1.84) 0.779 (1.89) 2.144 (0.69) 1.153 (1.28) 0.883 (1.67)
    4864x896      256  27.53 18.90 (1.46) 22.16 (1.24) 22.45 (1.23) 8.161 (3.37) 35.08 (0.78) 30.08 (0.92) 4.148 (6.64)
    2048x2048       1  0.864 0.547 (1.58) 0.331 (2.61) 0.352 (2.45) 0.475 (1.82) 0.725 (1.19) 0.348 (2.48) 0.692 (1.25)
    8192x2048       1  2.920 1.640 (1.78) 1.103 (2.65) 1.205 (2.42) 1.541 (1.89) 2.567 (1.14) 1.432 (2.04) 1.860 (1.57)
    8192x2048       8  4.276 3.040 (1.41) 2.508 (1.70) 2.810 (1.52) 2.435 (1.76) 7.192 (0.59) 3.771 (1.13) 2.007 (2.13)
    8192x2048      32  13.70 9.044 (1.52) 9.486 (1.44) 10.08 (1.36) 4.731 (2.90) 18.89 (0.73) 14.36 (0.95) 3.318 (4.13)
    8192x2048     256  105.7 68.47 (1.54) 74.00 (1.43) 77.40 (1.37) 30.17 (3.50) 119.4 (0.89) 115.8 (0.91) 11.61 (9.10)
    8192x2048 2T    1  1.690 0.949 (1.78) 0.668 (2.53) 0.693 (2.44) 0.826 (2.05) 1.588 (1.06) 0.747 (2.26) 1.126 (1.50)
    8192x2048 2T  256  52.96 32.51 (1.63) 40.22 (1.32) 42.88 (1.23) 14.96 (3.54) 63.80 (0.83) 56.33 (0.94) 5.695 (9.30)

Ferry's kernels for every scheme: torch's own int8 op was slower at every size, its int4 op as fast at one row of
the smaller layers (896x896: 77 us against 81, 2048x2048: 348 against 331) and slower from 8 rows; oneDNN's int8
linear (AMX) beats the W8A8 kernel from about 8 rows, at the price of a second copy of the weight in its own layout
(it takes no other: a plain int8 weight crashes it). int8 in float32 multiply-adds (the layout of CPUs without dot
products) took 2150 us instead of 1640 for one row of 8192x2048, 94 ms instead of 68 for 256. One row of an int4
layer costs its widening (3 instructions per 16 weights: 600 us for 8192x2048 out of cache, against bfloat16's
1200) as much as its reading. Two threads' timings on this shared machine wait on whatever else runs on the other
core: the one-thread rows are the steadier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.kernels.build import int8_dot_products
from engine.kernels.library import cpu_kernels_take
from engine.kernels.linear import BLOCK

INT4_GROUP_SIZES = (32, 64, 128)
_QUANTIZE_ELEMENTS = 1 << 19
"""About how many weights are quantized at a time (whole blocks of rows): the float32 temporaries of one step, 2 MiB
each, stay a small part of a layer's weight (a model loads layer by layer, and its peak memory is the quantized
layers plus one layer's weight in flight)."""


class Int8Weights(NamedTuple):
    codes: torch.Tensor
    """int8, where the kernels have int8 dot products (engine.kernels.build.int8_dot_products) W8A8's layout,
    [ceil(out / 16), ceil(in / 4), 16, 4]; elsewhere [ceil(out / 16), in, 16]: block b's k-th 16 codes are rows
    16b .. 16b + 15 at column k."""
    scales: torch.Tensor
    """[out] float32: each output row's scale."""
    code_sums: torch.Tensor
    """[out] int32: each output row's sum of codes (the dot products' unsigned activations need it)."""


class Int4Weights(NamedTuple):
    codes: torch.Tensor
    """[ceil(out / 16), in / 8, 16, 4] uint8: for columns 8o .. 8o + 7 of row 16b + j, 4 bytes: byte c holds the
    code of column 8o + c in its low 4 bits, that of column 8o + 4 + c in its high 4."""
    scales: torch.Tensor
    """[ceil(out / 16), in / group, 16] bfloat16 (float16: a checkpoint's, `pack_int4`): block b's g-th 16 are rows
    16b .. 16b + 15's scales of group g."""
    mins: torch.Tensor
    """[ceil(out / 16), in / group, 16], `scales`' dtype: the groups' minimums (the value of code 0), laid out as
    `scales`."""


class Int8GroupWeights(NamedTuple):
    codes: torch.Tensor
    """[ceil(out / 16), in / 4, 16, 4] uint8: for columns 4o .. 4o + 3 of row 16b + j, 4 bytes, byte c the code of
    column 4o + c."""
    scales: torch.Tensor
    """[ceil(out / 16), in / group, 16] bfloat16 or float16, laid out as `Int4Weights.scales`."""
    mins: torch.Tensor
    """[ceil(out / 16), in / group, 16], `scales`' dtype: the value of code 0."""


class W8A8Weights(NamedTuple):
    codes: torch.Tensor
    """[ceil(out / 16), ceil(in / 4), 16, 4] int8: block b's p-th 64 are rows 16b + j's codes of columns 4p + t at
    (j, t), zeros past `in`."""
    scales: torch.Tensor
    """[out] float32: each output row's scale."""
    code_sums: torch.Tensor
    """[out] int32: each output row's sum of codes (the kernel's unsigned-activation products need it)."""


def quantize_int8(weight: torch.Tensor, *, dot_products: bool | None = None) -> Int8Weights:
    """`[out, in]` float weight -> int8 codes per output row, symmetric: scale = max |w| / 127, q = round(w / scale).
    `dot_products`: as `pack_int8`'s."""
    _check_weight(weight)
    return pack_int8(*symmetric_int8(weight), dot_products=dot_products)


def pack_int8(codes: torch.Tensor, scales: torch.Tensor, *, dot_products: bool | None = None) -> Int8Weights:
    """int8 codes `[out, in]` with their float32 scales `[out]` (`symmetric_int8`'s, of a whole checkpoint tensor
    before tensor parallelism slices it: engine/quantization/int8.py), in `int8_linear`'s layout: the same values.
    `dot_products`: the layout, in groups of 4 k for int8 dot products or blocked for float32 multiply-adds; by
    default the one the kernels built here take (the other is for tests and benchmarks: where the kernels have no
    dot products they refuse codes in groups of 4)."""
    if int8_dot_products() if dot_products is None else dot_products:
        return Int8Weights(*_pack_quads(codes, scales))
    out_features, in_features = codes.shape
    blocked = torch.empty(_blocks(out_features), in_features, BLOCK, dtype=torch.int8)
    code_sums = torch.empty(out_features, dtype=torch.int32)
    for start, rows in _row_chunks(codes):  # float32 holds the small integer codes exactly
        code_sums[start : start + len(rows)] = rows.sum(1, dtype=torch.float64)
        _put_rows(blocked, start, rows.to(torch.int8))
    return Int8Weights(blocked, scales.float().contiguous(), code_sums)


def int8_linear(x: torch.Tensor, w: Int8Weights, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x `[..., in]` @ the int8 weight's `[out, in]`.T (+ bias): `[..., out]` in x's dtype."""
    _check_input(x, w.codes)
    if cpu_kernels_take(x):
        return torch.ops.ferry_kernels.int8_linear(x, w.codes, w.scales, w.code_sums, out_features, bias)
    codes = _codes(w.codes, out_features, x.shape[-1])  # [out, in]
    return _finish(F.linear(x.float(), codes.float()) * w.scales, bias, x.dtype)


def dequantize_int8(w: Int8Weights, out_features: int, in_features: int) -> torch.Tensor:
    """The float32 `[out, in]` weight `int8_linear` multiplies by: scale * q."""
    return _codes(w.codes, out_features, in_features).float() * w.scales[:, None]


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weights:
    """`[out, in]` float weight -> 4-bit codes in groups of `group_size` columns (32, 64 or 128; `in` a multiple of
    it): per (row, group) min = the group's minimum rounded down to bfloat16, scale = (max - min) / 15 rounded up to
    bfloat16, q = round((w - min) / scale) in 0..15."""
    out_features, in_features = _check_weight(weight)
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 groups are {INT4_GROUP_SIZES} columns, not {group_size}")
    if in_features % group_size:
        raise ValueError(
            f"int4 in groups of {group_size} needs a multiple of {group_size} input features, not {in_features}"
        )
    groups = in_features // group_size
    codes = torch.empty(_blocks(out_features), in_features // 8, BLOCK, 4, dtype=torch.uint8)
    scales = torch.empty(_blocks(out_features), groups, BLOCK, dtype=torch.bfloat16)
    mins = torch.empty_like(scales)
    for start, rows in _row_chunks(weight):
        by_group = rows.view(len(rows), groups, group_size)
        low = by_group.amin(-1)  # [r, groups]
        low = torch.where(low < 0, _bf16_away_from_zero(low), _bf16_toward_zero(low))
        scale = _bf16_away_from_zero((by_group.amax(-1) - low) / 15)
        q = (by_group - low[..., None]).div_(torch.where(scale == 0, 1, scale)[..., None]).round_().clamp_(0, 15)
        q = q.to(torch.uint8).view(len(rows), in_features // 8, 2, 4)  # [r, in / 8, low / high, bytes]
        _put_rows(codes, start, q[:, :, 0] | q[:, :, 1] << 4)
        _put_rows(scales, start, scale.to(torch.bfloat16))
        _put_rows(mins, start, low.to(torch.bfloat16))
    return Int4Weights(codes, scales, mins)


def pack_int4(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> Int4Weights:
    """int4 codes `[out, in]` (uint8, 0..15) with each (row, group)'s scale and minimum `[out, groups]`, quantized
    elsewhere (a checkpoint's, a GGUF file's blocks), in `int4_linear`'s layout; scales and minimums are stored in
    `dtype`, bfloat16 or float16 (a checkpoint's float16 scales exactly)."""
    out_features, in_features = codes.shape
    groups = scales.shape[1]
    if in_features % 8 or in_features // groups not in INT4_GROUP_SIZES or scales.shape != mins.shape:
        raise ValueError(f"int4 codes {tuple(codes.shape)} with {groups} groups a row")
    q = codes.view(out_features, in_features // 8, 2, 4)  # [out, in / 8, low / high, bytes]
    return Int4Weights(_blocked_codes(q[:, :, 0] | q[:, :, 1] << 4), *_blocked_scales(scales, mins, dtype))


def pack_int8_groups(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> Int8GroupWeights:
    """8-bit codes `[out, in]` (uint8, 0..255) with each (row, group)'s scale and minimum `[out, groups]` (groups of
    a multiple of 4 columns), in `int8_group_linear`'s layout; scales and minimums stored in `dtype`."""
    out_features, in_features = codes.shape
    groups = scales.shape[1]
    if in_features % groups or (in_features // groups) % 4 or scales.shape != mins.shape:
        raise ValueError(f"8-bit codes {tuple(codes.shape)} with {groups} groups a row")
    return Int8GroupWeights(_blocked_codes(codes.view(out_features, in_features // 4, 4)), *_blocked_scales(
        scales, mins, dtype
    ))  # fmt: skip


def _blocked_codes(words: torch.Tensor) -> torch.Tensor:
    """`[out, words, 4]` uint8 -> `[ceil(out / 16), words, 16, 4]`, rows past `out` zero."""
    out_features, count, _ = words.shape
    blocked = torch.empty(_blocks(out_features), count, BLOCK, 4, dtype=torch.uint8)
    _put_rows(blocked, 0, words)
    return blocked


def _blocked_scales(scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"scales are kept in bfloat16 or float16, not {dtype}")
    out_features, groups = scales.shape
    blocked_scales = torch.empty(_blocks(out_features), groups, BLOCK, dtype=dtype)
    blocked_mins = torch.empty_like(blocked_scales)
    _put_rows(blocked_scales, 0, scales.to(dtype))
    _put_rows(blocked_mins, 0, mins.to(dtype))
    return blocked_scales, blocked_mins


def int8_group_rows(w: Int8GroupWeights, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows `ids` of the float32 `[out, in]` weight `int8_group_linear` multiplies by, `[N, in]` for `ids` `[N]`: a
    tied embedding's lookup in a grouped int8 LM head."""
    codes = w.codes[ids // BLOCK, :, ids % BLOCK].reshape(len(ids), in_features).float()  # [N, in]
    group_size = in_features // w.scales.shape[1]
    scales = w.scales[ids // BLOCK, :, ids % BLOCK].float().repeat_interleave(group_size, dim=1)
    mins = w.mins[ids // BLOCK, :, ids % BLOCK].float().repeat_interleave(group_size, dim=1)
    return mins + scales * codes


def int8_group_linear(
    x: torch.Tensor, w: Int8GroupWeights, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """x `[..., in]` @ the grouped int8 weight's `[out, in]`.T (+ bias): `[..., out]` in x's dtype."""
    in_features = w.codes.shape[1] * 4
    _check_input(x, w.codes, codes_a_word=4)
    if cpu_kernels_take(x):
        return torch.ops.ferry_kernels.int8_group_linear(x, w.codes, w.scales, w.mins, out_features, bias)
    return _finish(F.linear(x.float(), dequantize_int8_groups(w, out_features, in_features)), bias, x.dtype)


def dequantize_int8_groups(w: Int8GroupWeights, out_features: int, in_features: int) -> torch.Tensor:
    """The float32 `[out, in]` weight `int8_group_linear` multiplies by: min + scale * q of each (row, group)."""
    q = _rows(w.codes, out_features).reshape(out_features, in_features)
    group_size = in_features // w.scales.shape[1]
    scales = _rows(w.scales, out_features).float().repeat_interleave(group_size, dim=1)
    mins = _rows(w.mins, out_features).float().repeat_interleave(group_size, dim=1)
    return mins + scales * q.float()


def int8_rows(w: Int8Weights, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows `ids` of the float32 `[out, in]` weight `int8_linear` multiplies by, `[N, in]` for `ids` `[N]`: a tied
    embedding's lookup in an int8 LM head, in either layout."""
    codes = w.codes[ids // BLOCK, :, ids % BLOCK]  # [N, in] or [N, in / 4, 4]
    return codes.reshape(len(ids), -1)[:, :in_features].float() * w.scales[ids, None]


def int4_linear(x: torch.Tensor, w: Int4Weights, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x `[..., in]` @ the int4 weight's `[out, in]`.T (+ bias): `[..., out]` in x's dtype."""
    in_features = w.codes.shape[1] * 8
    _check_input(x, w.codes)
    if cpu_kernels_take(x):
        return torch.ops.ferry_kernels.int4_linear(x, w.codes, w.scales, w.mins, out_features, bias)
    return _finish(F.linear(x.float(), dequantize_int4(w, out_features, in_features)), bias, x.dtype)


def dequantize_int4(w: Int4Weights, out_features: int, in_features: int) -> torch.Tensor:
    """The float32 `[out, in]` weight `int4_linear` multiplies by: min + scale * q of each (row, group). (The
    kernel sums it as 16 scale * (1 + q / 16) + (min - 16 scale), equal but for float32 rounding.)"""
    packed = _rows(w.codes, out_features)  # [out, in / 8, 4]
    q = torch.stack([packed & 15, packed >> 4], dim=2).view(out_features, in_features)
    group_size = in_features // w.scales.shape[1]
    scales = _rows(w.scales, out_features).float().repeat_interleave(group_size, dim=1)
    mins = _rows(w.mins, out_features).float().repeat_interleave(group_size, dim=1)
    return mins + scales * q.float()


def quantize_w8a8(weight: torch.Tensor) -> W8A8Weights:
    """`[out, in]` float weight -> int8 codes per output row as `quantize_int8`'s, in groups of 4 columns."""
    _check_weight(weight)
    return pack_w8a8(*symmetric_int8(weight))


def pack_w8a8(codes: torch.Tensor, scales: torch.Tensor) -> W8A8Weights:
    """int8 codes `[out, in]` with their float32 scales `[out]`, quantized elsewhere, in `w8a8_linear`'s layout."""
    return W8A8Weights(*_pack_quads(codes, scales))


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., in]` -> (int8 `[..., in]`, float32 scales `[..., 1]`), per row symmetric: s = max |x| / 127 (1 for
    a row of zeros), q = round(x / s) (half to even). Bit for bit what `w8a8_linear`'s kernel does to x."""
    wide = x.float()
    scale = wide.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale == 0, 1, scale)
    return (wide / scale).round_().clamp_(-127, 127).to(torch.int8), scale


def w8a8_linear(x: torch.Tensor, w: W8A8Weights, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x `[..., in]` @ the W8A8 weight's `[out, in]`.T (+ bias), x quantized per row: float(q_x @ q_w.T) * s_x *
    s_w, `[..., out]` in x's dtype."""
    _check_input(x, w.codes)
    if cpu_kernels_take(x):
        return torch.ops.ferry_kernels.w8a8_linear(x, w.codes, w.scales, w.code_sums, out_features, bias)
    q, scale = quantize_activations(x)
    codes = _codes(w.codes, out_features, x.shape[-1])  # [out, in]
    # float64 sums of integer products are exact (below 2^53), as the kernel's int32 ones.
    exact = F.linear(q.double(), codes.double()).float()
    return _finish(exact * scale * w.scales, bias, x.dtype)


def dequantize_w8a8(w: W8A8Weights, out_features: int, in_features: int) -> torch.Tensor:
    """The float32 `[out, in]` weight `w8a8_linear` multiplies (quantized) x by: scale * q."""
    return _codes(w.codes, out_features, in_features).float() * w.scales[:, None]


def symmetric_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[out, in]` float weight -> (int8 codes `[out, in]`, float32 scales `[out]`), a chunk of rows at a time: the
    one int8 quantizer, of the packers here and of engine/quantization's whole checkpoint tensors."""
    codes = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(weight.shape[0])
    for start, rows in _row_chunks(weight):
        scale, q = _symmetric(rows)  # [r], [r, in]
        scales[start : start + len(rows)] = scale
        codes[start : start + len(rows)] = q
    return codes, scales


def _pack_quads(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 codes `[out, in]` in groups of 4 columns (W8A8's layout), their scales and each row's sum of codes."""
    out_features, in_features = codes.shape
    quads = -(-in_features // 4)
    blocked = torch.empty(_blocks(out_features), quads, BLOCK, 4, dtype=torch.int8)
    code_sums = torch.empty(out_features, dtype=torch.int32)
    for start, rows in _row_chunks(codes):  # float32 holds the small integer codes exactly
        code_sums[start : start + len(rows)] = rows.sum(1, dtype=torch.float64)
        padded = F.pad(rows.to(torch.int8), (0, 4 * quads - in_features))
        _put_rows(blocked, start, padded.view(len(rows), quads, 4))
    return blocked, scales.float().contiguous(), code_sums


def _codes(codes: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """int8 codes in either blocked layout back as rows `[out, in]`."""
    return _rows(codes, out_features).reshape(out_features, -1)[:, :in_features]


def _check_weight(weight: torch.Tensor) -> tuple[int, int]:
    if weight.dim() != 2 or not weight.dtype.is_floating_point or 0 in weight.shape:
        raise ValueError(
            f"a weight to quantize is a non-empty [out, in] float matrix, not {tuple(weight.shape)} {weight.dtype}"
        )
    return weight.shape[0], weight.shape[1]


def _check_input(x: torch.Tensor, codes: torch.Tensor, codes_a_word: int = 8) -> None:
    """x's last dimension against the input features `codes` hold: in / 8 (int4), in / 4 (int8 in groups: uint8
    codes, `codes_a_word` 4), ceil(in / 4) (in groups of 4) or in (int8's blocked layout)."""
    width = x.shape[-1] if x.dim() else 0
    if codes.dtype == torch.uint8:
        fits = width == codes_a_word * codes.shape[1]
    else:
        fits = -(-width // 4) == codes.shape[1] if codes.dim() == 4 else width == codes.shape[1]
    if not fits or width == 0:
        raise ValueError(f"x {tuple(x.shape)} does not have the weight's input features")


def _blocks(out_features: int) -> int:
    return -(-out_features // BLOCK)


def _row_chunks(weight: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, float32 rows) of `weight`, whole blocks of about _QUANTIZE_ELEMENTS weights at a time."""
    step = max(1, _QUANTIZE_ELEMENTS // (weight.shape[1] * BLOCK)) * BLOCK
    for start in range(0, weight.shape[0], step):
        yield start, weight[start : start + step].float().contiguous()


def _symmetric(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 rows [r, in] -> (scales [r] = max |w| / 127, int8 codes [r, in] = round(w / scale))."""
    scale = rows.abs().amax(1) / 127
    q = (rows / torch.where(scale == 0, 1, scale)[:, None]).round_().clamp_(-127, 127)
    return scale, q.to(torch.int8)


def _put_rows(dest: torch.Tensor, start: int, rows: torch.Tensor) -> None:
    """Rows `start ..` of a blocked `dest` [blocks, X, 16, *rest] from `rows` [r, X, *rest] (start a multiple of
    16), zeros past the last row."""
    count = rows.shape[0]
    blocks = _blocks(count)
    padded = rows.new_zeros(blocks * BLOCK, *rows.shape[1:])
    padded[:count] = rows
    dest[start // BLOCK : start // BLOCK + blocks] = padded.view(blocks, BLOCK, *rows.shape[1:]).transpose(1, 2)


def _rows(blocked: torch.Tensor, out_features: int) -> torch.Tensor:
    """A blocked [blocks, X, 16, *rest] back as rows [out, X, *rest]."""
    rows = blocked.transpose(1, 2).reshape(blocked.shape[0] * BLOCK, blocked.shape[1], *blocked.shape[3:])
    return rows[:out_features]


def _bf16_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the bfloat16 value next to it toward zero (as float32)."""
    return (x.contiguous().view(torch.int32) & -65536).view(torch.float32)


def _bf16_away_from_zero(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the bfloat16 value next to it away from zero (as float32; x itself where it is one)."""
    bits = x.contiguous().view(torch.int32)
    cut = bits & -65536
    return torch.where(cut == bits, cut, cut + 65536).view(torch.float32)


def _finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return (y if bias is None else y + bias.float()).to(dtype)


class GroupedKernel(NamedTuple):
    """A grouped layout's packer of codes quantized elsewhere, its linear and its dequantizer."""

    pack: Callable[..., Int4Weights | Int8GroupWeights]
    linear: Callable[..., torch.Tensor]
    dequantize: Callable[..., torch.Tensor]


GROUPED = {
    4: GroupedKernel(pack_int4, int4_linear, dequantize_int4),
    8: GroupedKernel(pack_int8_groups, int8_group_linear, dequantize_int8_groups),
}
"""The kernels of codes in groups with a scale and minimum each, by the codes' bits (a quantized checkpoint's)."""
