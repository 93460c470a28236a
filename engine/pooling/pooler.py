"""From a pooling request's hidden states to the vector it returns: what `PoolingConfig` (engine/pooling/config.py)
describes, computed the way sentence-transformers computes it (the oracle, tests/test_pooling.py).

A request's prompt may be computed over several steps (chunked prefill): `accumulate` keeps what its pooling needs
of each chunk (the running sum and count for `mean`, the first token's state for `cls`), and the step that
computes its last prompt token pools it. `finish` then takes the step's pooled states together, `[B, hidden]`:
through the classifier head (`classify`), or the Dense modules and the normalization (`embed`). The yes/no
reranker reads two logits at the last token, which the runner computes with the step's other logits.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

from engine.pooling.config import Activation, DenseModule, PoolingConfig

_ACTIVATIONS: dict[Activation, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": F.relu,
    "gelu": F.gelu,
}


@dataclass(slots=True)
class PoolState:
    """What a pooling sequence keeps of the chunks computed so far (float32)."""

    total: torch.Tensor | None = None
    """`mean`: the sum of its tokens' hidden states so far."""
    count: int = 0
    first: torch.Tensor | None = None
    """`cls`: the first token's hidden state."""
    pooled: torch.Tensor | None = None
    """Once the prompt is computed: its pooled hidden state `[hidden]`."""


class Pooler:
    """The model's pooling: per-chunk accumulation and the step's final vectors."""

    def __init__(self, config: PoolingConfig, model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.model = model
        self.dense = [_load_dense(module, device, dtype) for module in config.dense]
        self.yes_no_ids: tuple[int, int] | None = None
        """`yes_no`: the two tokens' ids (set by the loader, which has the tokenizer)."""

    @property
    def reads_logits(self) -> bool:
        """Whether a pooled vector comes from the logits at the last token (yes/no) rather than hidden states."""
        return self.config.kind == "yes_no"

    def accumulate(self, state: PoolState, rows: torch.Tensor, start: int, ends_prompt: bool) -> None:
        """Take one chunk's hidden states `[n, hidden]` (positions `start ...`); at the prompt's end, pool them."""
        kind = self.config.pooling
        if kind == "mean":
            chunk = rows.float().sum(0)
            state.total = chunk if state.total is None else state.total + chunk
            state.count += rows.shape[0]
        elif kind == "cls" and start == 0:
            state.first = rows[0]
        if not ends_prompt:
            return
        if kind == "last":
            state.pooled = rows[-1]
        elif kind == "mean":
            assert state.total is not None
            state.pooled = (state.total / state.count).to(rows.dtype)
        else:
            assert state.first is not None
            state.pooled = state.first

    @torch.inference_mode()
    def finish(self, pooled: torch.Tensor) -> torch.Tensor:
        """The vectors `[B, dimensions]` (float32) of pooled states `[B, hidden]`."""
        config = self.config
        if config.kind == "classify":
            logits = self.model.classify(pooled).float()  # an encoder's head (engine/models/encoder.py)
            return _ACTIVATIONS[config.activation](logits)
        x = pooled
        for linear, activation in self.dense:
            x = _ACTIVATIONS[activation](linear(x.to(linear.weight.dtype)))
        x = x.float()
        return F.normalize(x, p=2, dim=-1) if config.normalize else x

    def yes_no(self, logits: torch.Tensor) -> torch.Tensor:
        """`[B, 1]`: P(yes) over the two tokens, from the last tokens' logits `[B, vocab]`."""
        assert self.yes_no_ids is not None
        pair = logits[:, list(self.yes_no_ids)].float()
        return torch.softmax(pair, dim=-1)[:, :1]


def _load_dense(module: DenseModule, device: torch.device, dtype: torch.dtype) -> tuple[nn.Linear, Activation]:
    """A Dense module's linear layer, its weights read from the module's folder (safetensors, or the torch file
    older sentence-transformers releases wrote)."""
    linear = nn.Linear(module.in_features, module.out_features, bias=module.bias, device=device, dtype=dtype)
    safetensors = os.path.join(module.path, "model.safetensors")
    if os.path.isfile(safetensors):
        weights = load_file(safetensors)
    else:
        weights = torch.load(os.path.join(module.path, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    state = {name.removeprefix("linear."): tensor for name, tensor in weights.items()}
    linear.load_state_dict(state)
    return linear.requires_grad_(False), module.activation
