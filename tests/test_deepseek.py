"""Native DeepSeek V2 / V3: the routing against transformers' routers, the rotary layouts, what is refused by name.

The engine oracle (greedy tokens and logprobs against `generate` under mixed batches, chunking, preemption, prefix
sharing, compiled graphs and TP=2) runs both families in tests/test_engine_equivalence.py and
tests/test_tensor_parallel.py; the latent cache's sizes are checked in tests/test_cache_specs.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from engine import EngineConfig, EngineCore, SamplingParams, generate_batch
from engine.attention import CpuPagedBackend, TorchPagedBackend
from engine.attention.context import StepContext, step_context
from engine.attention.latent import latent_attention
from engine.config import EngineStartupError
from engine.layers.moe import GroupedRouting
from engine.models.deepseek import DeepseekForCausalLM, Router, check_tensor_parallel
from engine.models.registry import choose_model_class
from tests.model_factory import build_model_dir
from tests.test_cpu_attention import KERNEL, _inputs, _ragged_step
from tests.test_engine_equivalence import generate_alone

ROUTERS = {
    "v2 greedy": ("deepseek_v2", dict(topk_method="greedy")),
    "v2 group-limited": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    "v3 grouped": ("deepseek_v3", dict(n_group=4, topk_group=2, norm_topk_prob=True)),
    "v3 not renormalised": ("deepseek_v3", dict(n_group=2, topk_group=1, norm_topk_prob=False)),
}


@pytest.mark.parametrize("case", list(ROUTERS))
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 9))
def test_routing_picks_and_weighs_what_transformers_routers_do(case: str, seed: int, tokens: int) -> None:
    model_type, options = ROUTERS[case]
    config = AutoConfig.for_model(
        model_type, hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, routed_scaling_factor=2.5, **options
    )
    generator = torch.Generator().manual_seed(seed)
    reference = (DeepseekV3TopkRouter if model_type == "deepseek_v3" else DeepseekV2TopkRouter)(config)
    router = Router(config)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(16, 32, generator=generator))
        router.weight.copy_(reference.weight)
        if model_type == "deepseek_v3":
            reference.e_score_correction_bias.copy_(torch.rand(16, generator=generator) - 0.5)
            assert router.e_score_correction_bias is not None
            router.e_score_correction_bias.copy_(reference.e_score_correction_bias)
    x = torch.randn(tokens, 32, generator=generator)
    _, expected_weights, expected_ids = reference(x)
    weights, ids = GroupedRouting.of(config).select(router(x), router.e_score_correction_bias)
    # transformers leaves the top-k unsorted: compare each token's (expert, weight) pairs as sets.
    for token in range(tokens):
        got = sorted(zip(ids[token].tolist(), weights[token].tolist(), strict=True))
        want = sorted(zip(expected_ids[token].tolist(), expected_weights[token].tolist(), strict=True))
        assert [e for e, _ in got] == [e for e, _ in want]
        assert [w for _, w in got] == pytest.approx([w for _, w in want], rel=1e-6)


def test_v3_rotary_in_halves_is_served_exactly(tmp_path: Path) -> None:
    """`rope_interleave=False`: the checkpoint's rotary rows are already in halves and are loaded as they are."""
    path = build_model_dir(tmp_path, "deepseek_v3", rope_interleave=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts, max_new = [[11, 40, 7, 99, 123, 5], list(range(20, 61))], [9, 6]
    expected, expected_logprobs = generate_alone(hf, prompts, max_new)
    engine = EngineCore(EngineConfig.of(model=str(path), num_pages=64, max_batch_tokens=16, debug_checks=True))
    params = [SamplingParams(max_new_tokens=n, logprobs=True) for n in max_new]
    results = generate_batch(prompts, params=params, engine=engine)
    for i in range(len(prompts)):
        assert results[f"req_{i}"].generated_ids == expected[i]
        got = [t.logprob for t in results[f"req_{i}"].logprobs]
        assert max(abs(a - b) for a, b in zip(got, expected_logprobs[i], strict=True)) <= 1e-4
    engine.close()


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3", "glm4_moe_lite"])
def test_the_family_is_claimed_by_the_native_modules(model_dir: Callable[[str], Path], arch: str) -> None:
    config = AutoConfig.from_pretrained(model_dir(arch))
    assert choose_model_class(config, "auto") is DeepseekForCausalLM


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_bfloat16_serves_on_the_cpu_kernels(model_dir: Callable[[str], Path], arch: str) -> None:
    """bfloat16 runs the kernels' paths (the latent head through the C++ attention, the experts' op); greedy tokens
    are not compared with float32's (roundings differ), only that every request completes in full."""
    engine = EngineCore(EngineConfig.of(model=str(model_dir(arch)), dtype="bfloat16", num_pages=64))
    assert engine.runner.backend.name == "cpu"
    prompts = [[11, 40, 7, 99], list(range(20, 50))]
    results = generate_batch(prompts, params=[SamplingParams(max_new_tokens=8, ignore_eos=True)] * 2, engine=engine)
    assert [len(results[f"req_{i}"].generated_ids) for i in range(2)] == [8, 8]
    engine.close()


def test_heads_that_do_not_split_over_the_ranks_are_refused_by_name(model_dir: Callable[[str], Path]) -> None:
    config = AutoConfig.from_pretrained(model_dir("deepseek_v3"))
    with pytest.raises(EngineStartupError, match="its 4 attention heads do not divide by 3"):
        check_tensor_parallel(config, 3)


def test_lora_is_refused_by_name(model_dir: Callable[[str], Path]) -> None:
    served = r"adapters on a deepseek_v2 model \(latent attention, absorbed projections\) are not served"
    with pytest.raises(EngineStartupError, match=served):
        EngineCore(EngineConfig.of(model=str(model_dir("deepseek_v2")), num_pages=16, enable_lora=True))


def test_a_multi_token_prediction_layer_in_the_checkpoint_is_skipped(tmp_path: Path) -> None:
    """V3 and GLM-4.7-Flash checkpoints carry one layer past `num_hidden_layers` (their MTP head), which
    transformers skips as it loads: so does Ferry, and serves the rest exactly."""
    path = build_model_dir(tmp_path, "deepseek_v3")
    save_file({"model.layers.2.eh_proj.weight": torch.zeros(64, 128)}, path / "mtp.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected, _ = generate_alone(hf, [[11, 40, 7, 99]], [6])
    engine = EngineCore(EngineConfig.of(model=str(path), num_pages=16))
    got = generate_batch([[11, 40, 7, 99]], params=[SamplingParams(max_new_tokens=6)], engine=engine)
    assert got["req_0"].generated_ids == expected[0]
    engine.close()


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_fresh_prompts_expanded_equal_the_absorbed_form(
    backend_name: str, dtype: torch.dtype, tolerance: float
) -> None:
    """A ragged step (decodes, chunks over cached latents, short and long fresh prompts) through `latent_attention`:
    fresh prompts of 32 tokens and more expanded into per-head keys and values, the other rows absorbed over the
    pages, equal the absorbed form over the whole step (the path before expansion) and write the same cache."""
    if backend_name == "cpu" and KERNEL is None:
        pytest.skip("the CPU attention kernel does not build here")
    heads, nope, rope, v_dim, latent = 4, 48, 16, 40, 64
    step = _ragged_step(random.Random(11), decodes=9, max_len=150)
    meta, *_ = _inputs(step, 16, heads, 1, latent + rope, None, seed=11)
    generator = torch.Generator().manual_seed(11)
    total = sum(n for _, n in step)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.3).to(dtype)

    q_nope, q_pe, lat, k_pe = (
        rand(total, heads, nope),
        rand(total, heads, rope),
        rand(total, latent),
        rand(total, 1, rope),
    )
    w_uk, w_uv = rand(heads, nope, latent), rand(heads, v_dim, latent)
    pages = meta.page_tables_host.max() + 1
    cache = rand(int(pages) + 2, 16, 1, latent + rope)
    scale = (nope + rope) ** -0.5

    # The absorbed form over every row, through the torch backend.
    want_cache = cache.clone()
    key = torch.cat([lat.unsqueeze(1), k_pe], dim=-1)
    query = torch.cat([torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe], dim=-1)
    mixed = TorchPagedBackend().forward(query, key, key, (want_cache, want_cache), meta, scale, None)
    want = torch.bmm(mixed[..., :latent].transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    backend = TorchPagedBackend() if backend_name == "torch" else CpuPagedBackend(KERNEL)
    with step_context(StepContext(backend, [meta], [None], [(cache, cache)])):
        got = latent_attention(q_nope, q_pe, lat, k_pe, w_uk, w_uv, cache, scale)
    split = meta.backend_state["prompt_split"]
    assert [end - first for first, end in split.prompts] == [n for c, n in step if c == 0 and n >= 32]
    assert split.rest is not None and split.rest.num_seqs == sum(1 for c, n in step if c or n < 32)
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(cache, want_cache, atol=0, rtol=0)
