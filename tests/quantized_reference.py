"""The oracle of quantized models (tests/test_quantization.py, and tests/test_gpu.py on a GPU): transformers' own
forward pass, float32, over the weights Ferry multiplies by, dequantized, with the activations quantized as Ferry
quantizes them for the schemes that do; Ferry's tokens fed back to it (teacher forcing)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from engine.quantization import QuantizedLinearMethod
from engine.quantization.fp8 import quantize_fp8_rows

LOGPROB_TOLERANCE = 2e-3
"""Weight-only schemes: float32 sums in another order (about 1e-5), far below it."""
ACTIVATION_TOLERANCE = 5e-2
"""Schemes that quantize activations (int8-dynamic, fp8): the reference quantizes the same activations, but an
input that differs from Ferry's in its last bit can land on the other side of a rounding boundary, moving that
element by one step (1/127 of its row's largest for int8, 1/16 of itself for e4m3); on the tiny models' sharp
logits (weights of std 0.2) that moves a logprob by up to a few 1e-2."""


def tolerance_of(scheme: str) -> float:
    return ACTIVATION_TOLERANCE if scheme in ("int8-dynamic", "fp8") else LOGPROB_TOLERANCE


def _fake_quantize(scheme: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the scheme does to a linear's input, in float32 (None: nothing)."""
    if scheme == "fp8":

        def fp8(x: torch.Tensor) -> torch.Tensor:
            rows = x.reshape(-1, x.shape[-1])
            q, scale = quantize_fp8_rows(rows)
            return (q.float() * scale).view(x.shape)

        return fp8
    if scheme == "int8-dynamic":
        from engine.kernels.quant_linear import quantize_activations

        def int8(x: torch.Tensor) -> torch.Tensor:
            q, scale = quantize_activations(x)
            return q.float() * scale

        return int8
    return None


@torch.no_grad()
def reference_model(path: Path, ferry: nn.Module, scheme: str) -> nn.Module:
    """transformers' model of `path`, float32, its decoder linears holding what Ferry's (native Llama modules)
    multiply by, and, for schemes that quantize activations, their inputs quantized the same way (a pre-hook)."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    quantize_input = _fake_quantize(scheme)
    for ours, theirs in zip(ferry.model.layers, hf.model.layers, strict=True):
        qkv = ours.self_attn.qkv_proj
        q, k, v = qkv.method.dequantized_weight(qkv).split([qkv.q_size, qkv.kv_size, qkv.kv_size])
        gate_up = ours.mlp.gate_up_proj
        gate, up = gate_up.method.dequantized_weight(gate_up).split(gate_up.part_sizes)
        o_proj, down = ours.self_attn.o_proj, ours.mlp.down_proj
        pairs = {
            theirs.self_attn.q_proj: q,
            theirs.self_attn.k_proj: k,
            theirs.self_attn.v_proj: v,
            theirs.self_attn.o_proj: o_proj.method.dequantized_weight(o_proj),
            theirs.mlp.gate_proj: gate,
            theirs.mlp.up_proj: up,
            theirs.mlp.down_proj: down.method.dequantized_weight(down),
        }
        for linear, weight in pairs.items():
            assert linear.weight.shape == weight.shape
            linear.weight.copy_(weight)
            if quantize_input is not None:
                linear.register_forward_pre_hook(lambda _, args, f=quantize_input: (f(args[0]),))
    head = ferry.lm_head
    if isinstance(head.method, QuantizedLinearMethod):  # an int8 head (a tied embedding reads the same rows)
        hf.lm_head.weight.copy_(head.method.dequantized_weight(head)[: hf.config.vocab_size])
    return hf.eval()


def prompts_for(vocab: int, shared_prefix: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(7)
    prefix = [rng.randrange(10, vocab) for _ in range(shared_prefix)]
    lengths = [3, 17, 31, 52, 66, 12, 40, 9]
    return [prefix + [rng.randrange(10, vocab) for _ in range(n)] for n in lengths], [12, 20, 9, 16, 6, 24, 14, 18]


@torch.no_grad()
def check_against(
    reference: nn.Module,
    prompts: list[list[int]],
    results: dict,
    what: str,
    tolerance: float = LOGPROB_TOLERANCE,
    mean_tolerance: float | None = None,
) -> None:
    """Ferry's tokens and logprobs against the reference's, teacher-forced on Ferry's tokens; with
    `mean_tolerance`, the mean error over every generated position too."""
    errors = []
    for i, prompt in enumerate(prompts):
        got = results[f"req_{i}"]
        ids = torch.tensor([prompt + got.generated_ids], device=reference.device)
        logits = reference(ids).logits[0, len(prompt) - 1 : -1].float().cpu()  # [generated, vocab]
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = torch.tensor(got.generated_ids)
        want = logprobs.gather(1, chosen[:, None]).squeeze(1)
        ours = torch.tensor([t.logprob for t in got.logprobs])
        errors.append((ours - want).abs())
        worst = errors[-1].max().item()
        assert worst <= tolerance, f"{what}: request {i}: a chosen token's logprob is {worst:.2e} off"
        top2 = logprobs.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > tolerance
        best = logprobs.argmax(dim=-1)
        assert torch.equal(best[decided], chosen[decided]), f"{what}: request {i} chose another token than a clear best"
    if mean_tolerance is not None:
        mean = torch.cat(errors).mean().item()
        assert mean <= mean_tolerance, f"{what}: the chosen tokens' logprobs are {mean:.2e} off on average"
