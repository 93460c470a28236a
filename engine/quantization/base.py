"""What the quantized linear methods share.

Two ways to quantize as a model loads, never holding it whole in full precision:

- From whole checkpoint tensors (`CheckpointQuantizedMethod`: int8, int8-dynamic, fp8, a scale per output
  channel): the method registers the parameters its codes and scales load into (`parameter_specs`), quantizes each
  checkpoint weight as it arrives, whole (`quantize`), and leaves the slicing to the
  layer, which keeps its rank's rows (and columns) of each. A row-parallel layer's ranks so share the scales of
  whole rows: every rank holds a slice of what one rank would hold, and TP=2 computes the one-rank model.
- From the layer's own weight once its last shard is in (int4 in groups along the input, the int8 LM head's rows):
  where no scale spans two ranks' slices (a group never straddles a row-parallel split, which `refuses` checks; a
  row is never split), quantizing a rank's slice gives the same codes as quantizing the whole. One layer's weight
  exists in full precision at a time, as when the CPU methods pack theirs.

Either way the method then packs the codes into its kernel's layout (engine/kernels/quant_linear.py). A checkpoint
quantized by its publisher is described by a `CheckpointQuantization` (its format's module makes one:
engine/quantization/checkpoints.py), whose methods take the checkpoint's codes as stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.linear_method import LinearMethod


class QuantizedLinearMethod(LinearMethod):
    """A linear method that keeps its weight quantized and multiplies by it quantized."""

    plain_layout = False
    embeds_rows = False
    scheme: str
    """The `--quantization` value this method implements."""

    def refuses(self, input_size: int, output_size: int) -> str | None:
        """Why a layer of this rank's `[output_size, input_size]` cannot take the method, or None."""
        return None

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The float32 `[out, in]` matrix the layer multiplies by: the oracle's weights, and any method's that
        must see the weight itself."""
        raise NotImplementedError

    def init_dummy(self, layer: nn.Module) -> bool:
        """Random weights of a trained model's scale in the layer's parameters, where they hold codes rather than a
        float weight quantized once loaded (`--load-format dummy`); whether it did."""
        return False


class CheckpointQuantizedMethod(QuantizedLinearMethod):
    """A quantized method whose codes and scales are taken from whole checkpoint tensors as they load (see the
    module's docstring): what a scale per output channel needs, for a row-parallel layer's ranks to share it."""

    def parameter_specs(self, input_size: int, output_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The parameters a layer of `[output_size, input_size]` keeps its weight in: name -> (shape, dtype)."""
        raise NotImplementedError

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """A whole checkpoint weight `[out, in]` -> its parameters, by `parameter_specs`' names."""
        raise NotImplementedError

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, bias: bool, dtype: torch.dtype
    ) -> None:
        for name, (shape, param_dtype) in self.parameter_specs(input_size, output_size).items():
            setattr(layer, name, nn.Parameter(torch.empty(shape, dtype=param_dtype), requires_grad=False))
        layer.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False) if bias else None

    def checkpoint_tensors(self, name: str, loaded: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name == "weight":
            yield from self.quantize(loaded).items()
        else:
            yield name, loaded

    @torch.no_grad()
    def init_dummy(self, layer: nn.Module) -> bool:
        """Random weights of a trained model's scale, quantized into the layer's parameters; the layer's shape is
        already this rank's."""
        device = next(layer.parameters()).device  # on a GPU, a 4B model's dummy weights quantize in seconds
        weight = torch.randn(layer.output_size, layer.input_size, device=device) * 0.02
        for name, tensor in self.quantize(weight).items():
            getattr(layer, name).copy_(tensor)
        return True


def drop_parameters(layer: nn.Module, names: list[str]) -> None:
    """Free the loading parameters once their codes are packed: the packed form is all the layer keeps."""
    for name in names:
        delattr(layer, name)


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a quantized checkpoint is stored and what runs it."""

    format: str
    """`quant_method` (compressed-tensors, gptq, awq), or gguf."""
    description: str
    """Its weights (and activations), in words: the model card's and the start-up log's."""
    runs_as: str
    """The `--quantization` scheme whose kernels run it."""
    method: Callable[[], QuantizedLinearMethod]
    """A new linear method for the decoder's linears."""
    head: Callable[[], QuantizedLinearMethod] | None = None
    """A new method for the LM head, where the checkpoint's head is quantized (a GGUF file's: its Q8_0 codes, or int8
    by row); None: the model's dtype."""
