"""Any transformers causal LM, driven through paged attention: the breadth path.

The model runs on the packed `[1, T]` row with per-token `position_ids`; its attention layers reach the step's
paged backend through `engine/models/hf_attention.py`. A custom implementation name also stops transformers from
building masks per step. The output projection runs apart from the model (logits only at the sampled rows), so the
logit post-processing some models apply after it (soft-capping, scaling) is reproduced here.

What a config does not say, running the model does: `check_runs_exactly` probes it at load and refuses a model
whose attention the adapter cannot reach or does not implement, whose output depends on its neighbours in the
packed row, or whose logits are post-processed in a way `compute_logits` does not reproduce.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from engine.attention import AttentionNeeds, StepMetadata, TorchPagedBackend
from engine.attention.context import StepContext, step_context
from engine.attention.spec import CacheSpec, attention_specs
from engine.models.hf_attention import ATTN_IMPLEMENTATION, KNOWN_ARGUMENT_FEATURES, AttentionCall, num_kv_heads
from engine.models.llama import sliding_window_of_layer
from engine.models.support import UnsupportedModelError

__all__ = ["ATTN_IMPLEMENTATION", "TransformersCausalLM"]

_PROBE_PAGE = 4
"""Tokens per page in the probe's caches: one page holds each of its sequences."""
_PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
"""Largest difference, relative to the largest magnitude, between two computations of the same values that the
probe accepts: what packing or a different matmul shape may change, far below what a missing feature changes."""


class TransformersCausalLM(nn.Module):
    """Wraps a transformers model in the runner's interface (packed ids in, hidden states out)."""

    def __init__(self, hf_model: PreTrainedModel) -> None:
        super().__init__()
        self.hf_model = hf_model
        config = hf_model.config
        self.model_type = config.model_type
        self.num_layers = config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        windows = [sliding_window_of_layer(config, i) for i in range(self.num_layers)]
        self._specs = attention_specs(num_kv_heads(config), head_dim, hf_model.dtype, windows)
        """Each layer's cache as its config implies it; the probe checks the model's calls against them."""
        self._needs: AttentionNeeds | None = None
        """What the probe saw the layers ask of attention (`check_runs_exactly`)."""
        self.final_logit_softcapping: float | None = getattr(config, "final_logit_softcapping", None)
        self.logit_scale: float | None = getattr(config, "logit_scale", None)  # Cohere: logits * logit_scale
        self.logits_scaling: float | None = getattr(config, "logits_scaling", None)  # Granite: logits / it

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The `CausalLM` forward (engine/models/base.py): final hidden states `[T, hidden]`, inside the step's
        context (engine/attention/context.py), which the runner enters: the attention layers read the K/V caches
        from there, as they read the metadata."""
        if positions.dim() != 1:
            raise ValueError(
                f"the transformers adapter passes one axis of positions to {self.model_type}: positions must be [T], "
                f"not {list(positions.shape)}"
            )
        inputs = {"input_ids": input_ids[None]} if inputs_embeds is None else {"inputs_embeds": inputs_embeds[None]}
        out = self.hf_model.base_model(**inputs, position_ids=positions[None], use_cache=False, return_dict=True)
        return out.last_hidden_state[0]

    def cache_specs(self) -> list[CacheSpec]:
        """Each layer's KV cache: full attention, or a sliding window."""
        return list(self._specs)

    def attention_needs(self) -> AttentionNeeds:
        """What the layers' attention calls asked for when `check_runs_exactly` ran them (windows, soft-capping,
        sinks, Bloom's ALiBi): what the model's own code passes, not what its config is read to imply."""
        if self._needs is None:
            raise RuntimeError("the transformers adapter knows its attention's needs once check_runs_exactly has run")
        return self._needs

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors copied into the transformers model's parameters of the same names (before
        `adopt_linears` repacks them: the loader reads checkpoints through transformers' `from_pretrained`)."""
        params = dict(self.hf_model.named_parameters())
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the {self.model_type} model")
            params[name].copy_(tensor)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Looked up each call: `adopt_linears` replaces the head with a Ferry linear after this wrapper is built.
        logits = self.hf_model.get_output_embeddings()(hidden).float()
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_logit_softcapping is not None:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits

    @torch.inference_mode()
    def check_runs_exactly(self) -> None:
        """Raise UnsupportedModelError for what only running the model reveals.

        A few forward passes over a 3-token prompt: alone (every layer must call the paged attention once, with
        nothing it does not implement), packed after a 2-token prompt (it must come out as it does alone), its last
        token in a step of its own over the cached keys of the others (likewise), and the model's own forward, head
        included (its logits must equal `compute_logits` of the hidden states).
        """
        vocab = self.hf_model.config.vocab_size
        prompt, other = [1 % vocab, 2 % vocab, 3 % vocab], [4 % vocab, 5 % vocab]
        calls: list[AttentionCall] = []
        try:
            alone = self._probe_step([(prompt, 0)], self._probe_caches(1), self._checking(calls))
        except UnsupportedModelError:
            raise
        except Exception as error:  # whatever the model's own code raises without the masks or caches it expects
            raise UnsupportedModelError(
                self.model_type, f"code that does not run on paged attention ({type(error).__name__}: {error})"
            ) from error
        called = sorted(call.layer for call in calls)
        if not called:
            raise UnsupportedModelError(
                self.model_type, "attention computed outside transformers' attention interface (no paged version)"
            )
        if called != list(range(self.num_layers)):
            raise UnsupportedModelError(
                self.model_type, f"layers whose attention is not one call each of the attention interface ({called})"
            )
        self._needs = AttentionNeeds(frozenset().union(*(call.features for call in calls)))
        tolerance = _PROBE_TOLERANCE.get(alone.dtype, 2e-2)
        packed = self._probe_step([(other, 0), (prompt, 0)], self._probe_caches(2))[len(other) :]
        if not _close(packed, alone, tolerance):
            raise UnsupportedModelError(
                self.model_type,
                "outputs that change when another sequence shares the batch (tokens mixing across sequences, or "
                "positions taken from the row instead of position_ids)",
            )
        caches = self._probe_caches(1)
        self._probe_step([(prompt[:-1], 0)], caches)
        resumed = self._probe_step([(prompt[-1:], len(prompt) - 1)], caches)
        if not _close(resumed, alone[-1:], tolerance):
            raise UnsupportedModelError(
                self.model_type,
                "outputs that change when earlier tokens come from the KV cache (positions taken from the row "
                "instead of position_ids)",
            )
        device = alone.device
        with self._probe_context([(prompt, 0)], self._probe_caches(1)):
            own_logits = self.hf_model(
                input_ids=torch.tensor([prompt], device=device),
                position_ids=torch.arange(len(prompt), device=device)[None],
                use_cache=False,
                return_dict=True,
            ).logits[0]
        if not _close(self.compute_logits(alone), own_logits.float(), tolerance):
            raise UnsupportedModelError(
                self.model_type, "logits post-processed after the output projection in a way Ferry does not reproduce"
            )

    def _checking(self, calls: list[AttentionCall]) -> Callable[[AttentionCall], None]:
        def check(call: AttentionCall) -> None:
            calls.append(call)
            feature = self._unsupported_call(call)
            if feature is not None:
                raise UnsupportedModelError(self.model_type, feature)

        return check

    def _unsupported_call(self, call: AttentionCall) -> str | None:
        if call.unimplemented:
            return ", ".join(
                f"{KNOWN_ARGUMENT_FEATURES.get(name, 'the attention argument')} ({name})" for name in call.unimplemented
            )
        if not call.causal:
            return "non-causal attention"
        if call.own_mask:
            return "an attention mask the model builds itself"
        if call.value_dim != call.key_dim:
            return f"value heads of {call.value_dim} dimensions beside key heads of {call.key_dim}"
        spec = self._specs[call.layer]
        if (call.kv_heads, call.key_dim) != (spec.num_kv_heads, spec.head_size):
            return (
                f"K/V heads laid out as {call.kv_heads} x {call.key_dim} where its config implies "
                f"{spec.num_kv_heads} x {spec.head_size}"
            )
        if call.sliding_window != spec.window:
            return (
                f"a sliding window of {call.sliding_window} in layer {call.layer} where its config implies "
                f"{spec.window}"
            )
        return None

    def _probe_caches(self, num_seqs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Fresh K/V caches of one probe page per sequence, each layer's as its spec keeps it."""
        device = self.hf_model.device
        caches = []
        for spec in self._specs:
            shape = (num_seqs, _PROBE_PAGE, spec.num_kv_heads, spec.head_size)
            key, value = (torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(2))
            caches.append((key, value))
        return caches

    def _probe_step(
        self,
        seqs: list[tuple[list[int], int]],
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        on_call: Callable[[AttentionCall], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states of one step computing, for each sequence, its tokens after `computed` cached ones."""
        device = caches[0][0].device
        ids = torch.tensor([t for tokens, _ in seqs for t in tokens], device=device)
        positions = torch.tensor([c + i for tokens, c in seqs for i in range(len(tokens))], device=device)
        with self._probe_context(seqs, caches, on_call):
            return self(ids, positions, caches)

    def _probe_context(
        self,
        seqs: list[tuple[list[int], int]],
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        on_call: Callable[[AttentionCall], None] | None = None,
    ) -> AbstractContextManager[None]:
        """A step context where sequence i owns page i of `caches`, on the reference torch backend."""
        device = caches[0][0].device
        lens = [len(tokens) for tokens, _ in seqs]
        totals = [c + n for (_, c), n in zip(seqs, lens, strict=True)]
        starts = np.concatenate([[0], np.cumsum(lens)])
        positions = np.concatenate([np.arange(c, t) for (_, c), t in zip(seqs, totals, strict=True)])
        pages = np.repeat(np.arange(len(seqs)), lens)
        tables = np.arange(len(seqs), dtype=np.int32)[:, None]
        meta = StepMetadata(
            positions=torch.tensor(positions, device=device),
            slot_mapping=torch.tensor(pages * _PROBE_PAGE + positions, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(totals, dtype=torch.int32, device=device),
            page_tables=torch.tensor(tables, device=device),
            page_tables_host=tables,
            query_start_loc_host=starts.tolist(),
            query_lens_host=lens,
            seq_lens_host=totals,
            max_query_len=max(lens),
            max_seq_len=max(totals),
            page_size=_PROBE_PAGE,
        )
        windows = [spec.window for spec in self._specs]
        context = StepContext(TorchPagedBackend(), [meta] * self.num_layers, windows, caches, on_call)
        return step_context(context)


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> bool:
    scale = want.abs().max().clamp_min(1e-6)
    return bool(((got.float() - want.float()).abs().max() / scale) <= tolerance)
