"""Quantized weights: `--quantization` methods, each a linear method (engine/layers/linear_method.py) that keeps
its layer's weight quantized and multiplies by it through a kernel that reads it quantized.

- `int8` (engine/quantization/int8.py): weight-only, a scale per output channel; the C++ CPU kernels.
- `int8-dynamic` (engine/quantization/int8.py): int8 weights and activations (a scale per token, taken each step),
  integer dot products (VNNI where the CPU has it).
- `int4` (engine/quantization/int4.py): weight-only, groups along the input with a scale and a minimum each.
- `fp8` (engine/quantization/fp8.py): e4m3 weights and activations, scaled matmuls (GPU; the same call on CPU).

What is quantized: the decoder's linears (attention and MLP projections) of the native Llama-family modules, and
under the CPU schemes the LM head, in int8 (`int8.Int8HeadMethod`: on a small model the head is a large part of
what a decode step reads; llama.cpp quantizes its head too). An untied input embedding keeps the model's dtype (a
step reads a few of its rows); a tied one reads its rows from the int8 head. fp8 keeps the head in the model's
dtype, as vLLM does. Weights are quantized as they load (engine/quantization/base.py), so a model too big for memory
in bfloat16 loads in int4. What cannot be served quantized is refused at start-up by name
(`UnsupportedQuantization`).

A checkpoint quantized by its publisher (compressed-tensors, GPTQ, AWQ: engine/quantization/checkpoints.py) runs on
the same kernels from its own codes and scales, with no `--quantization` (its LM head stays in the model's dtype,
as the tools store it).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import EngineStartupError, ModelConfig
from engine.layers.linear import LinearBase
from engine.quantization.base import QuantizedLinearMethod
from engine.quantization.fp8 import Fp8LinearMethod

CPU_ONLY = ("int8", "int8-dynamic", "int4")
"""Schemes whose kernels are Ferry's C++ CPU kernels."""
FP8_MIN_CAPABILITY = (8, 9)
"""fp8 tensor cores: Ada (8.9) and Hopper (9.0) onwards."""


class UnsupportedQuantization(EngineStartupError):
    """`--quantization` cannot serve this model on this device; the message names the scheme and why."""

    def __init__(self, scheme: str, why: str) -> None:
        super().__init__(f"--quantization {scheme}: {why}")
        self.scheme = scheme


def quantized_linear_method(model: ModelConfig, device: torch.device) -> QuantizedLinearMethod | None:
    """The method the decoder's linears take for `model.quantization` on `device` (None for `none`); raises
    `UnsupportedQuantization` where the scheme cannot run there."""
    scheme = model.quantization
    if scheme == "none":
        return None
    check_device(scheme, device)
    if scheme == "fp8":
        return Fp8LinearMethod()
    from engine.quantization.int4 import Int4LinearMethod
    from engine.quantization.int8 import Int8LinearMethod, W8A8LinearMethod

    if scheme == "int8":
        return Int8LinearMethod()
    if scheme == "int8-dynamic":
        return W8A8LinearMethod()
    return Int4LinearMethod(model.quantization_group_size)


def check_device(scheme: str, device: torch.device) -> None:
    """Raise `UnsupportedQuantization` where `scheme`'s kernels cannot run on `device`."""
    if scheme in CPU_ONLY and device.type != "cpu":
        raise UnsupportedQuantization(scheme, f"its kernels run on CPU, not {device.type}; on a GPU use fp8")
    if scheme == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        raise UnsupportedQuantization(
            scheme, f"this GPU ({torch.cuda.get_device_name(device)}) has no fp8 tensor cores (compute capability 8.9+)"
        )


def quantized_head_method(model: ModelConfig) -> QuantizedLinearMethod | None:
    """The LM head's method under `model.quantization` (None: the model's dtype); call after
    `quantized_linear_method`, which refuses what cannot run."""
    if model.quantization not in CPU_ONLY:
        return None
    from engine.quantization.int8 import Int8HeadMethod

    return Int8HeadMethod()


def check_layers(model: nn.Module) -> None:
    """Refuse, naming the first such layer, a model with a quantized linear whose shape (this rank's) the method's
    layout cannot take."""
    for name, layer in model.named_modules():
        if isinstance(layer, LinearBase) and isinstance(layer.method, QuantizedLinearMethod):
            why = layer.method.refuses(layer.input_size, layer.output_size)
            if why is not None:
                raise UnsupportedQuantization(
                    layer.method.scheme, f"layer {name} ({layer.input_size} -> {layer.output_size} here): {why}"
                )


__all__ = [
    "QuantizedLinearMethod",
    "UnsupportedQuantization",
    "check_device",
    "check_layers",
    "quantized_head_method",
    "quantized_linear_method",
]
