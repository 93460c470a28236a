"""bfloat16 on CPU: the engine's packed, paged forward agrees with transformers' own bfloat16 forward within
bfloat16's rounding, whichever linear path this CPU takes (oneDNN-packed bfloat16 where the CPU has AMX, the blocked
kernel's bfloat16 dot products where it has AVX512-BF16 without AMX, `WidenedLinearMethod` where it has no bfloat16
arithmetic and no kernel)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from engine import EngineConfig, EngineCore, SamplingParams, generate_batch
from engine.cpu_isa import amx_tiles, bf16_dot_products
from engine.layers.linear import LinearBase, adopt_linears
from engine.layers.linear_method import (
    BlockedLinearMethod,
    PackedLinearMethod,
    WidenedLinearMethod,
    bf16_matmul_native,
    blocked_linear_available,
)
from tests.test_engine_equivalence import _prompts

BF16_LOGPROB_TOLERANCE = 0.15
"""A chosen token's logprob may differ by this much: bfloat16 keeps 8 bits of mantissa, and the engine sums in
another order than transformers (packed rows, paged attention); float32 agrees to 1e-4 (the oracle)."""


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 64, 300])
def test_widened_linear_rounds_as_a_bfloat16_linear_does(bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(96, 2500, bias=bias).to(torch.bfloat16)
    widened = nn.Sequential(layer)
    adopt_linears(widened, WidenedLinearMethod(slice_elements=700 * 96))  # several slices, the last one short
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        exact = x.float() @ layer.weight.float().t() + (layer.bias.float() if bias else 0)
        got = widened(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 2500)
    # One rounding of float32 products summed in float32: within half a bfloat16 ulp of the exact result
    # (plus the bias's own rounding when it is added in bfloat16).
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=8e-3)
    torch.testing.assert_close(widened(x.view(1, rows, 96)), got.view(1, rows, 2500))


def test_widened_linears_keep_tied_weights_shared_and_transpose_conv1d() -> None:
    embedding = nn.Embedding(50, 16).to(torch.bfloat16)
    head = nn.Linear(16, 50, bias=False).to(torch.bfloat16)
    head.weight = embedding.weight
    conv = Conv1D(24, 16).to(torch.bfloat16)
    torch.nn.init.normal_(conv.bias)
    model = nn.ModuleDict({"embed": embedding, "head": head, "conv": conv, "full": nn.Linear(4, 4)})
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = conv(x).float()
        assert adopt_linears(model, WidenedLinearMethod()) == 3
        assert model["head"].weight is embedding.weight
        torch.testing.assert_close(model["conv"](x).float(), want, atol=3e-2, rtol=1e-2)
    assert all(isinstance(model[name].method, WidenedLinearMethod) for name in ("head", "conv", "full"))


@pytest.mark.parametrize(
    ("arch", "level"), [("llama", "none"), ("qwen3", "none"), ("gpt2", "none"), ("llama", "piecewise")]
)
def test_bfloat16_engine_agrees_with_transformers_bfloat16(
    model_dir: Callable[[str], Path], arch: str, level: str, request: pytest.FixtureRequest
) -> None:
    """Prompt logprobs (teacher-forced, so one early rounding cannot change every later token) of a packed,
    chunked batch against transformers' bfloat16 forward of each prompt alone; compiled too, where the blocked
    kernel is an opaque op of the graph (the widened linears are traced into it)."""
    if level != "none":
        request.getfixturevalue("compiling")
    path = model_dir(arch)
    config = EngineConfig.of(
        model=str(path), dtype="bfloat16", num_pages=256, max_batch_tokens=96, page_size=16, compile=level
    )
    engine = EngineCore(config)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, LinearBase)]
    # A tied LM head takes the blocked layout wherever the kernel runs: only untied ones are checked. oneDNN where it
    # multiplies bfloat16 faster than the kernel (AMX, or bfloat16 arithmetic without the kernel's dot products).
    kernel = blocked_linear_available(torch.device("cpu"), torch.bfloat16)
    onednn = bf16_matmul_native(torch.device("cpu")) and (amx_tiles() or not bf16_dot_products() or not kernel)
    want = PackedLinearMethod if onednn else BlockedLinearMethod if kernel else WidenedLinearMethod
    assert linears and all(isinstance(m.method, want) for m in linears if not getattr(m, "tied", False))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    prompts, _ = _prompts(hf.config.vocab_size)
    params = [SamplingParams(max_new_tokens=1, prompt_logprobs=0) for _ in prompts]
    results = generate_batch(prompts, params=params, engine=engine)
    worst = 0.0
    for i, prompt in enumerate(prompts):
        got = results[f"req_{i}"].prompt_logprobs
        assert got is not None and [e.token_id for e in got] == prompt[1:]
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
        want_chosen = want.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        worst = max(worst, (torch.tensor([e.logprob for e in got]) - want_chosen).abs().max().item())
    assert worst <= BF16_LOGPROB_TOLERANCE, f"{arch}: a prompt logprob is {worst:.3f} off transformers' bfloat16"
