"""Linear layers with weights packed once for oneDNN: the CPU's matrix multiplies.

On CPU, `F.linear` goes to MKL's sgemm, which on AMD processors takes a slower code path: 75-100 GFLOP/s on one
core of the AMD EPYC we measure on, against 190-245 GFLOP/s for oneDNN with the weight packed into its blocked
layout once at load time (the LM head of the tiny benchmark model: 5.0 ms instead of 13.9 ms for 64 rows). The
maths is the same; the sums are taken in another order (differences of about 1e-5 relative).

`torch.ops.mkldnn._linear_pointwise` and `_reorder_linear_weight` are the ops torch's own inductor uses for packed
CPU linears; where they (or oneDNN) are missing, layers stay plain `nn.Linear`.

Inside a `torch.compile` graph (engine/execution/compile.py) a packed linear is the opaque op `ferry::packed_linear`:
inductor lowers `_linear_pointwise` itself only for weights it froze into constants, which a graph shared by every
decoder layer cannot have (each layer's weight is an input of the same graph).

bfloat16 on a CPU without bfloat16 arithmetic (AVX2 only: no AVX512-BF16, AMX or AVX-NE-CONVERT) is the other
case: oneDNN cannot pack it, and torch's own bfloat16 matmul there is a loop of dot products whose cost grows with
every row (64 rows of a 4864x896 layer: 55 ms, against 9 ms in float32). `WidenedLinear` keeps the bfloat16 weight
and multiplies in float32, widening the weight a slice at a time.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

logger = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_ROWS_HINT = 64
"""oneDNN picks the packed layout for a typical row count; any count runs on it (decode batches are tens)."""


def onednn_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack linears of `dtype` here; bfloat16 needs AVX512 (or AVX-NE-CONVERT) on the CPU."""
    return (
        device.type == "cpu"
        and dtype in _PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def _packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


_LIBRARY = torch.library.Library("ferry", "FRAGMENT")
# A plain library definition, not `torch.library.custom_op`: its dispatch costs a third as much per call.
_LIBRARY.define("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor")
_LIBRARY.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("ferry::packed_linear", lib=_LIBRARY)
def _(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed_weight.shape[0]))  # the packed weight keeps `[out, in]` sizes


class PackedLinear(nn.Module):
    """Inference-only `x @ weight.T + bias`; the packed weight is an opaque oneDNN tensor."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """`weight`: `[out_features, in_features]`, as `nn.Linear` holds it."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _ROWS_HINT)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.ferry.packed_linear(x, self.packed_weight, self.bias)
        return _packed_linear(x, self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


_WIDEN_SLICE = 1 << 20
"""Weight elements widened to float32 at a time (4 MiB): a slice stays in cache for its GEMM, and the float32 copy
never approaches the size of the layer (an LM head of 150k x 896 would be 545 MB at once)."""
_WIDEN_MIN_ROWS = 3
"""Below this many rows torch's bfloat16 matmul is faster than widening (one row: 0.9 against 1.3 ms, 4864x896)."""


def bf16_matmul_native(device: torch.device) -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (what oneDNN needs to pack bfloat16 linears)."""
    return device.type != "cpu" or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class WidenedLinear(nn.Module):
    """bfloat16 weights, float32 products: a bfloat16 linear for CPUs without bfloat16 arithmetic.

    The products are exact in float32 and summed in float32 (torch's bfloat16 matmul also accumulates in float32),
    and the result is rounded to bfloat16 once, so outputs match `nn.Linear` in bfloat16 within its rounding.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """`weight`: `[out_features, in_features]` in bfloat16, the layer's own parameter where it is stored that way
        (a tied LM head keeps sharing the embedding's)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = None if bias is None else bias.detach()
        self._slice_rows = max(1, _WIDEN_SLICE // self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [N, in]
        if rows.shape[0] < _WIDEN_MIN_ROWS:
            return F.linear(x, self.weight, self.bias)
        wide = rows.float()
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype, device=x.device)  # [N, out]
        for start in range(0, self.out_features, self._slice_rows):
            end = min(start + self._slice_rows, self.out_features)
            out[:, start:end] = torch.mm(wide, self.weight[start:end].float().t())
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _weight_and_bias(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The `[out, in]` weight and bias of a layer this module can pack, else None."""
    if type(layer) is nn.Linear:
        return layer.weight, layer.bias
    if type(layer) is Conv1D:  # GPT-2's linear layers, weight stored `[in, out]`
        return layer.weight.t(), layer.bias
    return None


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` (and GPT-2 `Conv1D`) inside `model` with a `PackedLinear`; returns how many.

    A oneDNN build that cannot pack (another CPU family, an unusual shape) leaves the model as it was, with a
    warning: packing is a speed-up, never a condition for running.
    """
    swaps = [
        (parent, name, parts)
        for parent in model.modules()
        for name, child in parent.named_children()
        if (parts := _weight_and_bias(child)) is not None
    ]
    try:
        packed = [PackedLinear(*parts) for _, _, parts in swaps]
    except RuntimeError as exc:
        logger.warning("oneDNN could not pack the linear layers (%s); using torch's default matmul", exc)
        return 0
    for (parent, name, _), layer in zip(swaps, packed, strict=True):
        setattr(parent, name, layer)
    return len(swaps)


def widen_linears(model: nn.Module) -> int:
    """Replace every bfloat16 `nn.Linear` (and GPT-2 `Conv1D`) inside `model` with a `WidenedLinear`; returns how
    many. For CPUs where `bf16_matmul_native` is False."""
    swaps = [
        (parent, name, parts)
        for parent in model.modules()
        for name, child in parent.named_children()
        if (parts := _weight_and_bias(child)) is not None and parts[0].dtype == torch.bfloat16
    ]
    for parent, name, (weight, bias) in swaps:
        # Conv1D's weight arrives transposed: made contiguous once so each slice is a plain block of rows.
        setattr(parent, name, WidenedLinear(weight.contiguous(), bias))
    return len(swaps)
