"""The model a benchmark runs: a local Hugging Face directory, or a named architecture with random weights.

Named configs are written by hand from the public architectures so that nothing is downloaded. With
`weights="saved"` the transformers model is built once from a seed and saved, and Ferry loads that same directory:
every system then runs identical weights and greedy outputs can be compared token for token. With
`weights="dummy"` only config.json is written and Ferry builds its own random weights (`load_format="dummy"`):
faster for multi-GB models, but the systems' tokens are no longer comparable.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel

from bench.checkpoints import CHECKPOINTS
from engine.models.loader import resolve_device, resolve_dtype

WeightsMode = Literal["saved", "dummy"]

_LLAMA_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
_QWEN3_IDS = dict(bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
_QWEN3_COMMON = dict(
    model_type="qwen3",
    head_dim=128,
    num_key_value_heads=8,
    vocab_size=151936,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    **_QWEN3_IDS,
)

NAMED_CONFIGS: dict[str, dict[str, object]] = {
    # The engine issue's reference figure: a 4-layer, 256-hidden Llama.
    "tiny-llama": dict(
        model_type="llama",
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
        **_LLAMA_IDS,
    ),
    "small-llama": dict(
        model_type="llama",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=4096,
        **_LLAMA_IDS,
    ),
    # Issue 32's one-stream row: a 280M Llama (558 MB in bfloat16), 24 x 1024, untied, vocabulary 4096.
    "llama-280m": dict(
        model_type="llama",
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=2048,
        **_LLAMA_IDS,
    ),
    # Issue 12's matmul-bound row: Qwen2.5-0.5B's shape (GQA 14:2, biased QKV, tied 152k-token embedding).
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        **_QWEN3_IDS,
    ),
    # Issue 22's second shape: Llama-3.2-1B's (16 x 2048, GQA 32:8, tied 128k-token embedding).
    "llama-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500_000.0,
        max_position_embeddings=8192,
        **_LLAMA_IDS,
    ),
    # Issue 26's MoE row: Qwen3-30B-A3B's layer (128 experts of width 768, 8 per token, GQA 32:4, untied 152k
    # vocabulary) in 2 of its 48 layers, to fit beside a second copy on a 24 GiB machine.
    "qwen3-30b-a3b-2l": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        **_QWEN3_IDS,
    ),
    # gpt-oss-20b's layer (32 experts of width 2880, 4 per token, biased clamped SwiGLU, sinks, GQA 64:8 of head
    # dim 64, untied 201k vocabulary) in 2 of its 24 layers, one sliding and one full.
    "gpt-oss-20b-2l": dict(
        model_type="gpt_oss",
        num_local_experts=32,
        num_experts_per_tok=4,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
    ),
    # Issue 26's latent-attention row: DeepSeek-V2-Lite's layers (MLA of 16 heads over a 512 + 64 latent, a plain
    # query; 64 experts of width 1408, 6 per token, 2 shared; YaRN x40; untied 102k vocabulary) in 2 of its 27: its
    # dense first layer and one sparse layer.
    "deepseek-v2-lite-2l": dict(
        model_type="deepseek_v2",
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=2,
        first_k_dense_replace=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        vocab_size=102400,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=163840,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
        bos_token_id=100000,
        eos_token_id=100001,
        pad_token_id=100001,
    ),
    # State-space shapes reduced to fit 2 cores: Mamba2-130m's layers (24 of 768 wide, 24 heads of 64, a 128-wide
    # state), and a Jamba of 8 layers 1024 wide (attention at 4, experts every second layer: 8 of 1024, top 2;
    # Mamba's 16-wide state, dt rank 64), both on a 32k vocabulary.
    "mamba2-reduced": dict(
        model_type="mamba2",
        hidden_size=768,
        num_hidden_layers=24,
        num_heads=24,
        head_dim=64,
        n_groups=1,
        state_size=128,
        expand=2,
        conv_kernel=4,
        chunk_size=256,
        vocab_size=32000,
        tie_word_embeddings=True,
        **_LLAMA_IDS,
    ),
    "jamba-reduced": dict(
        model_type="jamba",
        hidden_size=1024,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        attn_layer_period=8,
        attn_layer_offset=4,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=8,
        num_experts_per_tok=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=64,
        vocab_size=32000,
        max_position_embeddings=4096,
        **_LLAMA_IDS,
    ),
    "qwen3-0.6b": dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=3072, **_QWEN3_COMMON
    ),
    "qwen3-4b": dict(
        hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, intermediate_size=9728, **_QWEN3_COMMON
    ),
}

# Default init (std 0.02) gives near-uniform logits where greedy ties flip on rounding noise; sharper random
# weights make the token-equality check meaningful (the same choice as tests/model_factory.py).
_INIT_STD = 0.2


@dataclass
class BenchModel:
    name: str
    path: Path
    """Directory Ferry loads: config.json, plus safetensors when `has_weights`."""
    has_weights: bool
    hf: PreTrainedModel
    """The transformers model the baselines run; same weights as Ferry's when `has_weights`."""
    device: torch.device
    dtype: torch.dtype

    @property
    def config(self) -> PretrainedConfig:
        return self.hf.config

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def pad_token_id(self) -> int:
        pad = self.config.pad_token_id
        return 0 if pad is None else int(pad)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "weights": "saved (identical in every system)" if self.has_weights else "dummy (per system)",
            "parameters": sum(p.numel() for p in self.hf.parameters()),
            "device": str(self.device),
            "dtype": self.dtype_name,
        }


def _random_model(config: PretrainedConfig, device: torch.device, dtype: torch.dtype, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    # Building under the device context initialises multi-GB models on the GPU instead of slowly on the host.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, _INIT_STD)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    return model.eval()


def prepare_model(
    model: str,
    workdir: Path,
    *,
    device: str = "auto",
    dtype: str = "auto",
    weights: WeightsMode = "saved",
    seed: int = 0,
) -> BenchModel:
    """Resolve `model` (a named config, a kept checkpoint or a local directory) into a loaded transformers model
    and a Ferry path.

    `weights` applies to named configs; a local directory brings its own weights (or, with config.json alone,
    runs random weights on both sides).
    """
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if model in NAMED_CONFIGS:
        spec = dict(NAMED_CONFIGS[model])
        config = AutoConfig.for_model(spec.pop("model_type"), **spec)
        hf = _random_model(config, dev, torch_dtype, seed)
        path = workdir / model
        if weights == "saved":
            hf.save_pretrained(path)
        else:
            path.mkdir(parents=True, exist_ok=True)
            config.save_pretrained(path)
        return BenchModel(model, path, weights == "saved", hf, dev, torch_dtype)

    path = CHECKPOINTS.get(model, Path(model))
    if not (path / "config.json").is_file():
        names = ", ".join([*NAMED_CONFIGS, *CHECKPOINTS])
        raise ValueError(f"{model!r} is neither a named model ({names}) nor a model directory")
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    if has_weights:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(dev).eval()
    else:
        config = AutoConfig.from_pretrained(path)
        hf = _random_model(config, dev, torch_dtype, seed)
    return BenchModel(path.name, path, has_weights, hf, dev, torch_dtype)
