"""Any transformers causal LM, driven through a registered paged attention function: the breadth path.

The model runs on the packed `[1, T]` row with per-token `position_ids`; its attention layers call
`paged_attention`, which hands their Q/K/V to the step's paged backend. The step's metadata reaches those calls
through `_active`, set around each forward, because transformers offers no per-call channel down to every
architecture's attention. A custom implementation name also stops transformers from building masks per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel

from engine.attention import AttentionBackend, StepMetadata
from engine.models.llama import sliding_window_of_layer

ATTN_IMPLEMENTATION = "ferry_paged"


@dataclass
class _StepContext:
    layer_metas: list[StepMetadata]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    backend: AttentionBackend


_active: _StepContext | None = None


def paged_attention(
    module: nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if _active is None:
        raise RuntimeError("ferry_paged attention called outside an engine step")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    out = _active.backend.forward(
        q, k, v, _active.kv_caches[module.layer_idx], _active.layer_metas[module.layer_idx], scale, window
    )
    return out.unsqueeze(0), None  # [1, T, H, D], as transformers' attention functions return


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


class TransformersCausalLM(nn.Module):
    """Wraps a transformers model in the runner's interface (packed ids in, hidden states out)."""

    def __init__(self, hf_model: PreTrainedModel, backend: AttentionBackend) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.backend = backend
        config = hf_model.config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.sliding_windows = [sliding_window_of_layer(config, i) for i in range(self.num_layers)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layer_metas: list[StepMetadata],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        global _active
        _active = _StepContext(layer_metas, kv_caches, self.backend)
        try:
            out = self.hf_model.base_model(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False, return_dict=True
            )
        finally:
            _active = None
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Looked up each call: loading may swap the head for a packed CPU linear after this wrapper is built.
        return self.hf_model.get_output_embeddings()(hidden).float()
