"""Native mixture-of-experts (Mixtral, Qwen2-MoE, Qwen3-MoE): the grouped expert matmuls against each expert run
alone, the checkpoint layouts, and what is refused by name. The engine oracle (greedy tokens and logprobs against
`generate` under mixed batches, chunking, preemption, prefix sharing and TP=2) runs these families in
tests/test_engine_equivalence.py and tests/test_tensor_parallel.py."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from engine import EngineConfig, EngineCore, SamplingParams, generate_batch
from engine.core.request import LoRARequest
from engine.layers.linear import Shard
from engine.layers.linear_method import (
    BlockedLinearMethod,
    PackedLinearMethod,
    onednn_linear_available,
    select_linear_method,
)
from engine.layers.moe import ClampedSwigluExperts, FusedExperts, Routing, clamped_swiglu_experts, every_expert
from engine.lora.adapter import AdapterError, read_adapter
from engine.models.llama import MLP, LlamaFamilyForCausalLM, SparseMoeBlock
from engine.models.registry import choose_model_class
from engine.quantization import UnsupportedQuantization
from tests.lora_adapters import ATTENTION, build_adapter_dir, peft_model
from tests.lora_adapters import MLP as MLP_PROJECTIONS
from tests.test_lora import greedy

MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"]


def _each_expert_alone(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """transformers' loop: every (token, expert) pair through its expert's matrices, weighted and summed."""
    width = w2.shape[-1]
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            expert = int(ids[token, slot])
            gate, up = F.linear(x[token], w13[expert]).split(width)
            out[token] += weights[token, slot] * F.linear(F.silu(gate) * up, w2[expert])
    return out


def _expected_kernel(dtype: torch.dtype) -> str:
    """The experts' kernel: the one the dense linears of `dtype` take on this CPU (oneDNN's packed layout for bfloat16
    with AMX or without bfloat16 dot products, the blocked kernel otherwise), or grouped_mm (float16, which no CPU
    kernel takes: the path CUDA runs)."""
    method = select_linear_method(torch.device("cpu"), dtype)
    kernels = {PackedLinearMethod: "onednn", BlockedLinearMethod: "blocked"}
    return kernels.get(type(method), "grouped_mm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@settings(max_examples=15, deadline=None)
@given(
    tokens=st.integers(1, 40),
    num_experts=st.integers(1, 9),
    top_k=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_experts_equal_each_expert_alone_and_split_over_ranks(
    dtype: torch.dtype, tokens: int, num_experts: int, top_k: int, seed: int
) -> None:
    """Any routing (experts with no tokens, one expert taking every token, more than 16 tokens on one) gives each
    pair its expert's product, on whichever kernel the dtype takes here; two ranks' halves of every expert sum to
    the whole."""
    top_k = min(top_k, num_experts)
    generator = torch.Generator().manual_seed(seed)
    hidden, width = 32, 16  # grouped_mm wants rows of 16-byte multiples: width / 2 ranks in float16
    x = torch.randn(tokens, hidden, generator=generator)
    gate = torch.randn(num_experts, width, hidden, generator=generator)
    up = torch.randn(num_experts, width, hidden, generator=generator)
    down = torch.randn(num_experts, hidden, width, generator=generator)
    logits = torch.randn(tokens, num_experts, generator=generator)
    weights, ids = Routing(top_k, renormalize=True).select(logits)
    assert torch.allclose(weights.sum(-1), torch.ones(tokens))
    # The reference in float32 over the weights as `dtype` holds them.
    gate, up, down = (w.to(dtype).float() for w in (gate, up, down))
    want = _each_expert_alone(x.to(dtype).float(), torch.cat([gate, up], dim=1), down, weights, ids)

    def experts(shard: Shard) -> FusedExperts:
        module = FusedExperts(num_experts, hidden, width, shard).to(dtype)
        for expert in range(num_experts):  # one expert at a time, as most checkpoints hold them
            for part, matrix in (("gate", gate[expert]), ("up", up[expert]), ("down", down[expert])):
                module.weight_loader(expert, part, matrix)
        assert module.loaded and module.kernel == _expected_kernel(dtype)
        return module

    # 16-bit: the gate/up products round to the dtype before the down matrix, as transformers' experts do.
    scale = float(want.abs().max())
    relative = 1e-5 if dtype == torch.float32 else 0.02  # of the largest output: sums in another order
    tolerance = dict(atol=relative * scale, rtol=0.0)
    got = experts(Shard())(x.to(dtype), weights, ids)
    torch.testing.assert_close(got.float(), want, **tolerance)
    halves = [experts(Shard(rank, 2))(x.to(dtype), weights, ids).float() for rank in range(2)]
    torch.testing.assert_close(halves[0] + halves[1], want, **tolerance)


@pytest.mark.skipif(
    not onednn_linear_available(torch.device("cpu"), torch.bfloat16), reason="oneDNN multiplies no bfloat16 here"
)
def test_bfloat16_experts_in_either_layout_equal_each_expert_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts take the dense linears' layout, which depends on the CPU (oneDNN's with AMX, the paired blocked one
    with AVX512-BF16 alone): both layouts run here, whichever this CPU picks, the other chosen as on the other kind."""
    generator = torch.Generator().manual_seed(11)
    tokens, num_experts, hidden, width = 21, 6, 64, 32
    x = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
    w13 = torch.randn(num_experts, 2 * width, hidden, generator=generator).to(torch.bfloat16)
    w2 = torch.randn(num_experts, hidden, width, generator=generator).to(torch.bfloat16)
    weights, ids = Routing(2, renormalize=True).select(torch.randn(tokens, num_experts, generator=generator))
    want = _each_expert_alone(x.float(), w13.float(), w2.float(), weights, ids)
    methods = {"onednn": PackedLinearMethod(), "blocked": BlockedLinearMethod()}
    for kernel, method in methods.items():
        monkeypatch.setattr("engine.layers.moe.select_linear_method", lambda *args, method=method: method)
        module = FusedExperts(num_experts, hidden, width).to(torch.bfloat16)
        for expert in range(num_experts):
            module.weight_loader(expert, "gate", w13[expert, :width])
            module.weight_loader(expert, "up", w13[expert, width:])
            module.weight_loader(expert, "down", w2[expert])
        assert module.loaded and module.kernel == kernel
        got = module(x, weights, ids).float()
        torch.testing.assert_close(got, want, atol=0.02 * float(want.abs().max()), rtol=0.0)


def test_every_expert_equals_each_expert_alone() -> None:
    """The path CUDA takes for dtypes grouped_mm does not take there, run here on the CPU."""
    generator = torch.Generator().manual_seed(3)
    tokens, num_experts, hidden, width = 9, 5, 16, 8
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(num_experts, 2 * width, hidden, generator=generator)
    w2 = torch.randn(num_experts, hidden, width, generator=generator)
    weights, ids = Routing(2, renormalize=False).select(torch.randn(tokens, num_experts, generator=generator))
    want = _each_expert_alone(x, w13, w2, weights, ids)
    torch.testing.assert_close(every_expert(x, w13, w2, weights, ids), want, atol=1e-4, rtol=1e-5)


def test_gpt_oss_experts_equal_transformers_experts_both_ways() -> None:
    """gpt-oss's biased, clamped experts against transformers' `GptOssExperts` (its loop over experts): the
    grouped_mm path the CPU runs and the every-expert path CUDA takes outside bfloat16."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=5, num_experts_per_tok=2)
    torch.manual_seed(5)
    theirs = GptOssExperts(config)
    for param in theirs.parameters():
        torch.nn.init.normal_(param, std=0.5)
    x = torch.randn(11, 32)
    weights, ids = Routing(2, renormalize=False, softmax_of_top_k=True).select(torch.randn(11, 5))
    with torch.no_grad():
        want = theirs(x, ids, weights)
        for every in (False, True):
            got = clamped_swiglu_experts(
                x, weights, ids, theirs.gate_up_proj, theirs.gate_up_proj_bias, theirs.down_proj,
                theirs.down_proj_bias, config.swiglu_alpha, config.swiglu_limit, every_expert=every,
            )  # fmt: skip
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    for dtype in (torch.float32, torch.bfloat16):  # the module: each expert packed for the CPU kernels' loop
        module = ClampedSwigluExperts(5, 32, 16, config.swiglu_alpha, config.swiglu_limit).to(dtype)
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            module.weight_loader(name, getattr(theirs, name).detach())
        assert module.loaded and (module.packed13 is not None) == (_expected_kernel(dtype) != "grouped_mm")
        reference = clamped_swiglu_experts(
            x.to(dtype), weights, ids, *(getattr(theirs, name).detach().to(dtype) for name in (
                "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")),
            config.swiglu_alpha, config.swiglu_limit,
        )  # fmt: skip
        scale = float(reference.float().abs().max())
        relative = 1e-5 if dtype == torch.float32 else 0.02
        torch.testing.assert_close(module(x.to(dtype), weights, ids).float(), reference.float(),
                                   atol=relative * scale, rtol=0.0)  # fmt: skip


def test_routing_as_transformers_routes() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    weights, ids = Routing(2, renormalize=False).select(logits)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, probs[:, [1, 2]])
    weights, _ = Routing(2, renormalize=True).select(logits)
    torch.testing.assert_close(weights, probs[:, [1, 2]] / probs[:, [1, 2]].sum())


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_families_run_on_native_modules_where_transformers_has_experts(
    model_dir: Callable[[str], Path], arch: str
) -> None:
    path = model_dir(arch)
    config = AutoConfig.from_pretrained(path)
    assert choose_model_class(config, "auto") is LlamaFamilyForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = EngineCore(EngineConfig.of(model=str(path), num_pages=64))
    model = engine.runner.model
    assert isinstance(model, LlamaFamilyForCausalLM)
    for theirs, ours in zip(hf.model.layers, model.model.layers, strict=True):
        sparse = hasattr(getattr(theirs, "mlp", None) or theirs.block_sparse_moe, "experts")
        assert isinstance(ours.mlp, SparseMoeBlock if sparse else MLP)
    if arch == "qwen3_moe":  # the fixture's layer 0 is in mlp_only_layers
        assert [type(layer.mlp) for layer in model.model.layers] == [MLP, SparseMoeBlock]
    if arch == "qwen2_moe":
        assert all(layer.mlp.shared_expert is not None for layer in model.model.layers)
    engine.close()


def _stacked(source: Path, target: Path) -> Path:
    """`source`'s checkpoint with each layer's experts stacked as transformers 5 holds them in memory
    (`experts.gate_up_proj` `[experts, 2 * width, hidden]`, `experts.down_proj` `[experts, hidden, width]`)."""
    shutil.copytree(source, target)
    tensors = load_file(source / "model.safetensors")
    config = AutoConfig.from_pretrained(source)
    stacked: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if ".experts." not in name:
            stacked[name] = tensor
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        if f"{prefix}.0.gate_proj.weight" not in tensors:
            continue
        count = config.num_experts
        part = [[tensors[f"{prefix}.{e}.{p}_proj.weight"] for e in range(count)] for p in ("gate", "up", "down")]
        stacked[f"{prefix}.gate_up_proj"] = torch.cat([torch.stack(part[0]), torch.stack(part[1])], dim=1)
        stacked[f"{prefix}.down_proj"] = torch.stack(part[2])
    save_file(stacked, target / "model.safetensors", metadata={"format": "pt"})
    return target


def _greedy_tokens(path: Path, prompts: list[list[int]], **overrides: object) -> list[list[int]]:
    with EngineCore(EngineConfig.of(model=str(path), num_pages=128, **overrides)) as engine:
        results = generate_batch(prompts, params=SamplingParams(max_new_tokens=10), engine=engine)
        return [results[f"req_{i}"].generated_ids for i in range(len(prompts))]


def test_stacked_experts_load_as_one_expert_at_a_time(model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    path = model_dir("qwen3_moe")
    prompts = [[5, 80, 13, 200, 7], [9, 9, 41]]
    want = _greedy_tokens(path, prompts)
    assert _greedy_tokens(_stacked(path, tmp_path / "stacked"), prompts) == want


def test_a_missing_expert_is_named(model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    path = tmp_path / "missing"
    shutil.copytree(model_dir("mixtral"), path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.3\.down"):
        EngineCore(EngineConfig.of(model=str(path), num_pages=64))


def test_dummy_weights_and_bfloat16_run(model_dir: Callable[[str], Path]) -> None:
    prompts = [[5, 80, 13, 200, 7]]
    assert len(_greedy_tokens(model_dir("qwen2_moe"), prompts, load_format="dummy")[0]) == 10
    assert len(_greedy_tokens(model_dir("mixtral"), prompts, dtype="bfloat16")[0]) == 10
    assert len(_greedy_tokens(model_dir("gpt_oss"), prompts, dtype="bfloat16", load_format="dummy")[0]) == 10


def test_quantizing_a_mixture_of_experts_is_refused_by_name(model_dir: Callable[[str], Path]) -> None:
    config = EngineConfig.of(model=str(model_dir("mixtral")), quantization="int8", num_pages=64)
    with pytest.raises(UnsupportedQuantization, match="'mixtral' model's experts"):
        EngineCore(config)


def test_adapters_on_a_moe_model_adapt_attention(model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """An adapter of Qwen3-MoE's attention is served exactly; PEFT's LoRA on the experts (`target_parameters`,
    what PEFT makes of MLP targets on this family) and an adapter naming a sparse layer's MLP are refused, saying
    so."""
    base = model_dir("qwen3_moe")
    adapter = build_adapter_dir(base, tmp_path / "adapter", r=8, lora_alpha=16, target_modules=list(ATTENTION))
    prompt = [11, 45, 2, 99, 130, 7, 64, 3, 18]
    want, want_logprobs = greedy(peft_model(base, adapter), prompt, max_new=8)
    config = EngineConfig.of(model=str(base), enable_lora=True, max_loras=1, num_pages=64)
    with EngineCore(config) as engine:
        lora = LoRARequest("moe-adapter", 1, str(adapter))
        params = SamplingParams(max_new_tokens=8, logprobs=True)
        got = generate_batch([prompt], params=params, engine=engine, loras=[lora])["req_0"]
    assert got.generated_ids == want
    assert max(abs(t.logprob - w) for t, w in zip(got.logprobs, want_logprobs, strict=True)) <= 1e-4
    hf_config = AutoConfig.from_pretrained(base)

    experts = build_adapter_dir(base, tmp_path / "experts", r=8, lora_alpha=16, target_modules=list(MLP_PROJECTIONS))
    with pytest.raises(AdapterError, match="target_parameters"):
        read_adapter(str(experts), hf_config, 16)

    # The first adapter with a gate_proj pair added to layer 1, whose MLP is experts.
    moved = tmp_path / "moved"
    shutil.copytree(adapter, moved)
    tensors = load_file(moved / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.1.mlp.gate_proj"
    tensors[f"{prefix}.lora_A.weight"] = torch.zeros(8, hf_config.hidden_size)
    tensors[f"{prefix}.lora_B.weight"] = torch.zeros(hf_config.intermediate_size, 8)
    save_file(tensors, moved / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="gate_proj of layer 1, whose feed-forward is a mixture of experts"):
        read_adapter(str(moved), hf_config, 16)
