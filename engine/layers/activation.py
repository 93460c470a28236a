"""Activations the CPU kernels compute in one pass where torch's expression takes several."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.library import cpu_kernels_take


class QuickGELU(nn.Module):
    """`x * sigmoid(1.702 * x)`, transformers' `QuickGELUActivation` (CLIP's and Qwen2-VL's vision MLPs): on CPU one
    kernel pass with the expression's roundings (engine/kernels/cpu_pointwise.cpp), where torch runs three over a
    tensor as wide as the MLP (8,192 x 5,120 bfloat16 for 8 Qwen2-VL images, two cores: 104 ms against 55)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels_take(x):
            return torch.ops.ferry_kernels.quick_gelu(x)
        return x * torch.sigmoid(1.702 * x)
