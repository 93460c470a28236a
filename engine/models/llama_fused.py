"""The native Llama family's decoder stack as one C++ call on the CPU (`ferry_kernels::llama_decoder`,
engine/kernels/cpu_decoder.cpp).

At one token a step's arithmetic on a small model is a few hundred microseconds, and running the decoder's ops one
by one from Python (module calls, views, a dispatch per op) cost as much again: on the demo model (4 layers), the
eager forward pass took 675 us of which the kernels were under 300. The C++ decoder runs the same kernels with the
same arguments in the same order, so its output is the eager path's bit for bit (tests/test_fused_decoder.py).

It serves a model whose every decoder linear runs on a kernel it calls (`LinearMethod.decoder_weight`): one of the
CPU defaults (`BlockedLinearMethod`, or `PackedLinearMethod` where oneDNN multiplies bfloat16) or a quantized
scheme's (int8, int8-dynamic, int4, and a checkpoint's codes in groups: GPTQ, AWQ, compressed-tensors, GGUF's Q4_0
and Q8_0; not GPTQ's act order, whose x is gathered first); on one rank (the row-parallel all-reduces are Python), and a
step that the CPU attention kernel computes over caches of the model's dtype with no non-causal spans and no
bfloat16 prompt the backend attends through torch's SDPA (`CpuPagedBackend.attends_prompts_densely`), LoRA adapters
included (their slots' tensors and the step's slots join the call); anything else runs the eager modules
(`FusedDecoder.forward` returns None), as does a `torch.compile` trace, which must see the modules.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.context import current_step
from engine.attention.cpu_paged import CpuPagedBackend
from engine.kernels.library import cpu_kernels_take
from engine.layers.linear import LinearBase
from engine.layers.linear_method import DecoderWeight
from engine.lora.slots import LoRALayer


class FusedDecoder:
    """A native Llama-family backbone's (engine/models/llama.py) tensors in the C++ decoder's order, gathered once
    (the modules' own tensors: no copies)."""

    def __init__(self, backbone: nn.Module, silu_max_tokens: int) -> None:
        first, mlp = backbone.layers[0].self_attn, backbone.layers[0].mlp
        self.weights = [tensor for layer in backbone.layers for tensor in _layer_tensors(layer)]
        self.schemes = [int(_decoder_weight(linear).scheme) for layer in backbone.layers for linear in _linears(layer)]
        self.final_norm = backbone.norm.weight
        self.sizes = [first.num_heads, first.num_kv_heads, first.head_dim, mlp.intermediate, silu_max_tokens]
        self.eps = backbone.norm.eps
        self.scale = first.scale
        self.windows = [layer.self_attn.sliding_window or 0 for layer in backbone.layers]
        self.dtype = self.final_norm.dtype
        self.layers = list(backbone.layers)
        self._adapter_tensors: list[torch.Tensor] | None = None
        """The layers' LoRA slots in the C++ decoder's order (`LoRAPart`), gathered at the first step with
        adapters (the slots are made after the model)."""

    @staticmethod
    def of(backbone: nn.Module, silu_max_tokens: int) -> FusedDecoder | None:
        """The fused decoder of `backbone`, or None where it cannot serve it (see the module's docstring);
        `silu_max_tokens`: up to this many tokens SiLU-and-multiply is one kernel call (the MLP's rule)."""
        layers = list(backbone.layers)
        linears = [module for layer in layers for module in layer.modules() if isinstance(module, LinearBase)]
        if (
            not cpu_kernels_take(backbone.norm.weight)
            or any(not hasattr(layer.mlp, "gate_up_proj") for layer in layers)  # a mixture of experts
            or any(linear.method.decoder_weight(linear) is None for linear in linears)
            or any(getattr(linear, "all_reduce", None) is not None for linear in linears)
            or len({(layer.self_attn.scale, layer.input_layernorm.eps) for layer in layers}) != 1
        ):
            return None
        return FusedDecoder(backbone, silu_max_tokens)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,  # [T, 1, head_dim]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor | None:  # [T, hidden], after the final norm
        """The decoder over this step, or None where the step needs the eager modules."""
        step = current_step()
        metas = step.layer_metas
        if (
            torch.compiler.is_compiling()
            or not isinstance(step.backend, CpuPagedBackend)
            or kv_caches[0][0].dtype != self.dtype
            or metas[0].token_spans is not None
            # bfloat16 prompts go to torch's SDPA (engine/attention/cpu_paged.py), which the modules' attention calls:
            # a prompt step is large products, where the modules' per-op cost does not show.
            or step.backend.attends_prompts_densely(metas[0], self.dtype)
        ):
            return None
        lora = step.lora
        if lora is not None and self._adapter_tensors is None:
            self._adapter_tensors = [tensor for layer in self.layers for tensor in _adapter_tensors(layer)]
        return torch.ops.ferry_kernels.llama_decoder(
            hidden,
            cos,
            sin,
            self.weights,
            self.final_norm,
            self.schemes,
            self.sizes,
            self.eps,
            self.scale,
            [cache[0] for cache in kv_caches],
            [cache[1] for cache in kv_caches],
            self.windows,
            [meta.slot_mapping for meta in metas],
            [meta.page_tables for meta in metas],
            metas[0].query_start_loc,
            metas[0].seq_lens,
            self._adapter_tensors if lora is not None else [],
            None if lora is None else lora.slots,
            None if lora is None else lora.scalings,
            0 if lora is None else lora.rank,
        )


def _linears(layer: nn.Module) -> list[LinearBase]:
    """One layer's linears in the order of `LinearPart` in cpu_decoder.cpp."""
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]


def _layer_tensors(layer: nn.Module) -> list[torch.Tensor | None]:
    """One layer's tensors in the order of `Slot` in cpu_decoder.cpp: each linear's three (`DecoderWeight`'s),
    then its bias."""
    attn = layer.self_attn
    qkv, out, gate_up, down = ([*_decoder_weight(linear)[1:], linear.bias] for linear in _linears(layer))
    return [
        layer.input_layernorm.weight,
        *qkv,
        attn.q_norm.weight if attn.qk_norm else None,
        attn.k_norm.weight if attn.qk_norm else None,
        *out,
        layer.post_attention_layernorm.weight,
        *gate_up,
        *down,
    ]


def _adapter_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """One layer's LoRA slots (A and B, each transposed, per part) in the order of `LoRAPart` in cpu_decoder.cpp."""
    attn, mlp = layer.self_attn, layer.mlp
    parts = [
        (attn.qkv_proj, "q"), (attn.qkv_proj, "k"), (attn.qkv_proj, "v"), (attn.o_proj, None),
        (mlp.gate_up_proj, 0), (mlp.gate_up_proj, 1), (mlp.down_proj, None),
    ]  # fmt: skip
    tensors = []
    for linear, shard_id in parts:
        slots = linear.lora
        assert isinstance(slots, LoRALayer), "a step with adapters on a model without adapter slots"
        part = slots.parts[shard_id]
        tensors += [part.a_t, part.bt]
    return tensors


def _decoder_weight(linear: LinearBase) -> DecoderWeight:
    weight = linear.method.decoder_weight(linear)
    assert weight is not None, "FusedDecoder.of admits only linears the decoder multiplies"
    return weight
