"""How a linear layer stores its weight and multiplies by it: the linear methods, and the choice of one per model.

A method creates the parameters a layer loads into (`create_weights`), turns them into the layout it computes
from once the layer's last shard is loaded (`process_weights_after_loading`), and computes `x @ weight.T + bias`
(`apply`). The layers (engine/layers/linear.py) own the loading and the tensor-parallel slicing; a method owns only
the layout and the arithmetic: the quantized methods (engine/quantization/) are such classes.

- `UnquantizedLinearMethod`: the plain `[out, in]` weight and `F.linear`.
- `BlockedLinearMethod`: the weight in Ferry's blocked layout and its C++ kernel (engine/kernels/): the CPU default
  for float32, and for bfloat16 except where oneDNN multiplies it faster (AMX). It streams the weights at memory
  bandwidth for a few rows (decode) and keeps pace with oneDNN for many.
- `PackedLinearMethod`: the weight packed once for oneDNN: bfloat16 on a CPU with AMX (or bfloat16 arithmetic the
  kernel has no dot products for), and the fallback where the kernel cannot be built. On CPU, `F.linear` goes to
  MKL's sgemm, which on AMD processors takes a slower code path: 75-100 GFLOP/s on one core of the AMD EPYC we
  measure on, against 190-245 GFLOP/s for oneDNN with the weight in its blocked layout (the LM head of the tiny
  benchmark model: 5.0 ms instead of 13.9 ms for 64 rows). The maths is the same; the sums are taken in another
  order (about 1e-5 relative). `torch.ops.mkldnn._linear_pointwise` and `_reorder_linear_weight` are the ops torch's
  own inductor uses for packed CPU linears. Inside a `torch.compile` graph (engine/execution/compile.py) a packed
  linear is the opaque op `ferry::packed_linear`: inductor lowers `_linear_pointwise` itself only for weights it
  froze into constants, which a graph shared by every decoder layer cannot have (each layer's weight is an input of
  the same graph).
- `WidenedLinearMethod`: bfloat16 on a CPU without bfloat16 arithmetic (AVX2 only: no AVX512-BF16, AMX or
  AVX-NE-CONVERT) where the kernel cannot be built: oneDNN cannot pack it there and torch's own bfloat16 matmul is
  a loop of dot products whose cost grows with every row (64 rows of a 4864x896 layer: 55 ms, against 9 ms in
  float32). It keeps the bfloat16 weight and multiplies in float32, widening the weight a slice at a time.

`plain_layout` says whether a method computes from the `[out, in]` weight as loaded: a matrix another module of a
transformers model reads directly takes a method with a plain layout. `embeds_rows` says whether it can give rows
of its matrix back (`embed_rows`): a tied LM head takes such a method, the embedding looks its rows up through it,
and the matrix is stored once, in the head's layout (`select_linear_method(..., embeds_rows=True)`).
`decoder_weight` gives the weight to the C++ decoder stack (engine/models/llama_fused.py) where it runs on one of
the CPU kernels that decoder calls.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from enum import IntEnum
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu_isa import amx_tiles, bf16_arithmetic, bf16_dot_products

logger = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
ROWS_HINT = 64
"""oneDNN picks the packed layout for a typical row count; any count runs on it (decode batches are tens)."""
WIDEN_SLICE = 1 << 20
"""Weight elements widened to float32 at a time (4 MiB): a slice stays in cache for its GEMM, and the float32 copy
never approaches the size of the layer (an LM head of 150k x 896 would be 545 MB at once)."""
_WIDEN_MIN_ROWS = 3
"""Below this many rows torch's bfloat16 matmul is faster than widening (one row: 0.9 against 1.3 ms, 4864x896)."""


class DecoderScheme(IntEnum):
    """The kernel the C++ decoder stack multiplies a linear's weight with (`Scheme` in engine/kernels/cpu_decoder.cpp,
    value for value)."""

    DENSE = 0
    """The blocked kernel's layout or oneDNN's packed one (a float weight)."""
    INT8 = 1
    INT4 = 2
    INT8_GROUPS = 3
    W8A8 = 4


class DecoderWeight(NamedTuple):
    """A linear's weight as the C++ decoder takes it: the arguments after x of the kernel the method's `apply`
    calls."""

    scheme: DecoderScheme
    weight: torch.Tensor
    """The float layout, or the codes."""
    scales: torch.Tensor | None = None
    third: torch.Tensor | None = None
    """The groups' minimums, or the rows' sums of codes."""


class LinearMethod:
    """The weight layout and arithmetic of a linear layer (see the module's docstring)."""

    plain_layout: bool = True
    """Whether `apply` reads the `[out, in]` `weight` parameter as loaded (so another module may share it)."""
    input_parameters: frozenset[str] = frozenset()
    """Parameters laid along the input rather than the output (a GPTQ checkpoint's `g_idx`): loaded whole, the
    same for every part of a fused layer."""
    embeds_rows: bool = True
    """Whether `embed_rows` reads rows of the matrix from the layout the method keeps (a tied LM head's method must:
    the embedding then looks its rows up there, and the matrix is stored once)."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, bias: bool, dtype: torch.dtype
    ) -> None:
        """Register on `layer` the parameters its checkpoint tensors load into: `weight` `[output_size,
        input_size]` and `bias` `[output_size]` (None without a bias), this rank's sizes."""
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False) if bias else None

    def checkpoint_names(self, bias: bool) -> tuple[frozenset[str], frozenset[str]]:
        """The checkpoint tensors (names after the layer's, as `weight` in `q_proj.weight`) a layer loads: those it
        needs, and those it takes when the checkpoint has them. A quantized checkpoint's layer has its format's
        (engine/quantization/checkpoints.py)."""
        return frozenset(("weight", "bias") if bias else ("weight",)), frozenset()

    def checkpoint_tensors(self, name: str, loaded: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters (name, tensor) checkpoint tensor `name` (one of `checkpoint_names`) loads into, whole,
        before the layer takes its rank's slice of each: the tensor itself, under its own name, unless the method
        quantizes it or reads a quantized checkpoint's layout (engine/quantization/). A parameter of one element
        a part is a per-tensor scale: the layer spreads it over the part's rows."""
        yield name, loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once, when every shard of `layer`'s weights is loaded: the place to repack them."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def embed_rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the layer's `[out, in]` matrix, `[*ids.shape, in]`: an embedding lookup."""
        return F.embedding(ids, layer.weight)

    def decoder_weight(self, layer: nn.Module) -> DecoderWeight | None:
        """The weight for the C++ decoder stack, where `apply` is one of its kernels' ops called on x as it comes
        (nothing computed around it); None where the decoder cannot compute what `apply` does."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    """The plain weight and torch's matmul: CUDA, float16, and whatever oneDNN cannot pack."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


def _packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


_LIBRARY = torch.library.Library("ferry", "FRAGMENT")
# A plain library definition, not `torch.library.custom_op`: its dispatch costs a third as much per call.
_LIBRARY.define("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor")
_LIBRARY.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("ferry::packed_linear", lib=_LIBRARY)
def _(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed_weight.shape[0]))  # the packed weight keeps `[out, in]` sizes


class PackedLinearMethod(LinearMethod):
    """The weight packed into oneDNN's blocked layout as soon as it is loaded; the plain copy is then freed.

    A layer oneDNN cannot pack (another CPU family, an unusual shape) keeps its plain weight and runs on
    `UnquantizedLinearMethod`, with a warning: packing is a speed-up, never a condition for running.
    """

    plain_layout = False
    embeds_rows = False  # oneDNN's blocked layout is opaque: reading rows would mean unpacking the whole matrix

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        try:
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach().contiguous(), ROWS_HINT)
        except RuntimeError as exc:
            logger.warning("oneDNN could not pack a %s linear (%s); it uses torch's matmul", layer.weight.shape, exc)
            layer.method = UnquantizedLinearMethod()
            return
        del layer.weight  # the parameter: freed here, layer by layer, so the plain and packed model never coexist
        layer.packed_weight = packed

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.ferry.packed_linear(x, layer.packed_weight, bias)
        return _packed_linear(x, layer.packed_weight, bias)

    def decoder_weight(self, layer: nn.Module) -> DecoderWeight | None:
        return DecoderWeight(DecoderScheme.DENSE, layer.packed_weight)


class BlockedLinearMethod(LinearMethod):
    """The weight in Ferry's blocked layout (engine/kernels/linear.py) and the C++ kernel that streams it: 16 output
    rows interleaved per block, so decode reads each weight once at memory bandwidth, float32 or bfloat16 alike.

    Measured on one core of the AMD EPYC (AVX2) against the methods it replaces (`python scripts/bench_linear.py`):
    float32 as fast as oneDNN's packed layout for 64 rows, faster for few (8 rows of 1024 -> 3072: 1.0 against
    1.4 ms), 4% slower for 512; bfloat16, which this CPU cannot multiply, 2.1x torch's matmul for one row and 3.1x
    the widened method for 8. It reads rows back out of its layout (`embed_rows`), so a tied LM head takes it too.
    """

    plain_layout = False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from engine.kernels.library import load_cpu_kernels
        from engine.kernels.linear import pack

        load_cpu_kernels()  # built once per process; raises KernelUnavailable where it cannot be
        with torch.no_grad():
            blocked = pack(layer.weight.detach())
        del layer.weight  # freed here, layer by layer: the plain and blocked model never coexist
        layer.blocked_weight = blocked

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.ferry_kernels.linear(x, layer.blocked_weight, layer.output_size, bias)

    def decoder_weight(self, layer: nn.Module) -> DecoderWeight | None:
        return DecoderWeight(DecoderScheme.DENSE, layer.blocked_weight)

    def embed_rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        from engine.kernels.linear import embed_rows

        return embed_rows(layer.blocked_weight, ids)


class WidenedLinearMethod(LinearMethod):
    """bfloat16 weights, float32 products: a bfloat16 linear for CPUs without bfloat16 arithmetic.

    The products are exact in float32 and summed in float32 (torch's bfloat16 matmul also accumulates in float32),
    and the result is rounded to bfloat16 once, so outputs match `F.linear` in bfloat16 within its rounding.
    """

    def __init__(self, slice_elements: int = WIDEN_SLICE) -> None:
        self.slice_elements = slice_elements

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = layer.weight
        out_features, in_features = weight.shape
        rows = x.reshape(-1, in_features)  # [N, in]
        if rows.shape[0] < _WIDEN_MIN_ROWS:
            return F.linear(x, weight, bias)
        wide = rows.float()
        out = torch.empty(rows.shape[0], out_features, dtype=x.dtype, device=x.device)  # [N, out]
        step = max(1, self.slice_elements // in_features)
        for start in range(0, out_features, step):
            end = min(start + step, out_features)
            out[:, start:end] = torch.mm(wide, weight[start:end].float().t())
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], out_features)


def onednn_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack linears of `dtype` here; bfloat16 needs bfloat16 arithmetic on the CPU."""
    return (
        device.type == "cpu"
        and dtype in _PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (dtype != torch.bfloat16 or bf16_arithmetic())
    )


def bf16_matmul_native(device: torch.device) -> bool:
    """Whether bfloat16 is multiplied in hardware on `device` (always on GPUs; on CPUs see engine/cpu_isa.py)."""
    return device.type != "cpu" or bf16_arithmetic()


def blocked_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the blocked C++ kernel runs `dtype` here (building it on the first ask of the process)."""
    from engine.kernels.build import KernelUnavailable
    from engine.kernels.library import CPU_KERNEL_DTYPES, load_cpu_kernels

    if device.type != "cpu" or dtype not in CPU_KERNEL_DTYPES:
        return False

    try:
        load_cpu_kernels()
    except KernelUnavailable as error:
        _warn_no_kernel(str(error))
        return False
    return True


@functools.cache
def _warn_no_kernel(reason: str) -> None:
    logger.warning("the CPU kernels are unavailable (%s): linears use oneDNN or torch's matmul", reason)


def select_linear_method(device: torch.device, dtype: torch.dtype, *, embeds_rows: bool = False) -> LinearMethod:
    """The method a model's linears of `dtype` on `device` use. On a CPU: the blocked kernel, except bfloat16 where
    oneDNN multiplies it faster: with AMX tiles, or with bfloat16 arithmetic the kernel has no dot products for
    (it would widen to float32); then oneDNN-packed, widened bfloat16, torch's matmul, in that order, where one
    cannot be had. With `embeds_rows`, one that can give rows of the matrix back (a tied LM head's).

    Without AMX, AVX512-BF16's dot products in the blocked kernel's paired layout stream a decode step's weights
    1.3-1.6x as fast as oneDNN's packed layout and keep within 10% of it for a prompt's rows (a 280M Llama's 96
    linears out of cache on a Zen 4 EPYC, two threads, BENCHMARKS.md "Several blocks in flight": one row 19.7
    against 26.3 ms, 32 rows 53.1 against 49.9, 136 rows 205 against 186; a 136-token prefill in process 239.6
    against 240.0 ms)."""
    native_bf16 = dtype == torch.bfloat16 and bf16_matmul_native(device)
    onednn_faster = native_bf16 and (amx_tiles() or not bf16_dot_products())
    if (embeds_rows or not onednn_faster) and blocked_linear_available(device, dtype):
        return BlockedLinearMethod()
    if not embeds_rows and onednn_linear_available(device, dtype):
        return PackedLinearMethod()
    if dtype == torch.bfloat16 and not bf16_matmul_native(device):
        return WidenedLinearMethod()
    return UnquantizedLinearMethod()
