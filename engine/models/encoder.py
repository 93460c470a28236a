"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa, ModernBERT) and their sequence classifiers, on the packed row.

transformers' own modules compute them, as the transformers adapter runs causal LMs (engine/models/hf_adapter.py):
packed ids `[1, T]` with per-token position and token type ids, their attention through transformers' attention
interface to the step's paged backend (`ferry_paged`, engine/models/hf_attention.py). Each input is one non-causal
span (engine/attention/base.py; the engine gives every pooling request of an encoder the span of its whole prompt),
so its tokens attend to each other in both directions and never to another input's, and a step computes it whole.
ModernBERT's local layers see the positions within their window on either side: their KV-cache group has that
window, and the runner gives an encoder's span queries the keys within it (engine/attention/base.py). Its K/V pass
through the cache pages the request holds for that step, freed when it finishes.

Only pooling runs here (engine/pooling/): an encoder has no LM head, so it never samples.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from engine.attention.base import AttentionFeature, AttentionNeeds
from engine.attention.spec import CacheSpec, attention_specs


class TransformersEncoder(nn.Module):
    """A transformers encoder (`BertModel`, `XLMRobertaModel`, ...) or classifier (`*ForSequenceClassification`)
    in the runner's interface: packed ids in, the last layer's hidden states out; `classify` is the head."""

    def __init__(self, hf_model: PreTrainedModel) -> None:
        super().__init__()
        self.hf_model = hf_model
        config = hf_model.config
        self.model_type = config.model_type
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        head_dim = config.hidden_size // config.num_attention_heads
        self._specs = attention_specs(
            config.num_attention_heads, head_dim, hf_model.dtype, [_window(config, i) for i in range(self.num_layers)]
        )
        # RoBERTa's embeddings number positions from padding_idx + 1 (position ids it would make from the ids).
        self.position_offset = config.pad_token_id + 1 if self.model_type in ("roberta", "xlm-roberta") else 0
        self.takes_token_types = self.model_type != "modernbert"
        """The runner passes each token's segment (`token_type_ids`): BERT's pairs embed their second text apart."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        inputs_embeds: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last layer's hidden states `[T, hidden]` (the `CausalLM` forward, engine/models/base.py, plus the
        token type ids; passed always, since the embeddings' own default is a buffer of max_position_embeddings
        zeros, shorter than a packed row)."""
        inputs = {"input_ids": input_ids[None]} if inputs_embeds is None else {"inputs_embeds": inputs_embeds[None]}
        if self.takes_token_types:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            inputs["token_type_ids"] = types[None]
        position_ids = (positions + self.position_offset)[None]
        out = self.hf_model.base_model(**inputs, position_ids=position_ids, return_dict=True)
        return out.last_hidden_state[0]

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """The classifier head's logits `[B, labels]` of the first tokens' states `[B, hidden]`, as the model's own
        forward computes them from its sequence output (BERT: pooler then classifier; RoBERTa: its head reads the
        first token)."""
        model = self.hf_model
        first = pooled[:, None]  # [B, 1, hidden]: the heads take a sequence and read its first token
        if self.model_type == "bert":
            return model.classifier(model.dropout(model.bert.pooler(first)))
        if self.model_type in ("roberta", "xlm-roberta"):
            return model.classifier(first)
        if self.model_type == "modernbert":  # its pooled state (cls or mean, `classifier_pooling`) through its head
            return model.classifier(model.drop(model.head(pooled)))
        raise ValueError(f"no classifier head for {self.model_type!r}")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """An encoder has no LM head: no request samples from it, so the runner only ever asks for no rows."""
        if hidden.shape[0]:
            raise RuntimeError(f"the {self.model_type} encoder has no LM head: nothing samples from it")
        return hidden.new_empty((0, self.vocab_size), dtype=torch.float32)

    def cache_specs(self) -> list[CacheSpec]:
        """Full attention in every layer: the K/V of the input's tokens for the step that computes it."""
        return list(self._specs)

    def attention_needs(self) -> AttentionNeeds:
        return AttentionNeeds(frozenset({AttentionFeature.NONCAUSAL_SPANS}))


def _window(config: PretrainedConfig, layer: int) -> int | None:
    """Layer `layer`'s attention window: ModernBERT's local layers see `sliding_window` positions on either side (the
    window its attention passes, flash-attn's convention: `|q - k| < window`); other layers and encoders none."""
    layer_types = getattr(config, "layer_types", None)
    if config.model_type == "modernbert" and layer_types and layer_types[layer] == "sliding_attention":
        return config.sliding_window + 1
    return None
