"""Linear layers with weights packed once for oneDNN: the CPU's matrix multiplies.

On CPU, `F.linear` goes to MKL's sgemm, which on AMD processors takes a slower code path: 75-100 GFLOP/s on one
core of the AMD EPYC we measure on, against 190-245 GFLOP/s for oneDNN with the weight packed into its blocked
layout once at load time (the LM head of the tiny benchmark model: 5.0 ms instead of 13.9 ms for 64 rows). The
maths is the same; the sums are taken in another order (differences of about 1e-5 relative).

`torch.ops.mkldnn._linear_pointwise` and `_reorder_linear_weight` are the ops torch's own inductor uses for packed
CPU linears; where they (or oneDNN) are missing, layers stay plain `nn.Linear`.
"""

from __future__ import annotations

import logging

import torch
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
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

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
