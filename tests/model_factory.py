"""Tiny model directories of real architectures, written to disk and loaded back through the real loading path.

Random weights from a transformers config, `save_pretrained` to safetensors, and a byte-level BPE tokenizer trained
locally with `tokenizers` (with a chat template). Nothing here touches the network.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

VOCAB_SIZE = 384
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

ARCHITECTURES: dict[str, dict] = {
    "llama": dict(model_type="llama", num_key_value_heads=2),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=16),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=24),
    # Layer 0 full attention, layer 1 a 20-token sliding window: per-layer windows in one model.
    "qwen2_hybrid": dict(
        model_type="qwen2", num_key_value_heads=2, use_sliding_window=True, sliding_window=20, max_window_layers=1
    ),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=512),
    "gpt_neox": dict(model_type="gpt_neox", num_attention_heads=4, rotary_pct=0.5),
    # Caps small enough to bend these tiny models' scores and logits (the defaults, 50 and 30, barely would);
    # layer 0 slides over 16 tokens, layer 1 attends to everything.
    "gemma2": dict(
        model_type="gemma2",
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        attn_logit_softcapping=4.0,
        final_logit_softcapping=8.0,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "bloom": dict(model_type="bloom", n_head=4),  # ALiBi
    "falcon": dict(model_type="falcon"),  # the default: multi-query, parallel attention, rotary
    "falcon_gqa": dict(model_type="falcon", new_decoder_architecture=True, num_kv_heads=2),
    "mixtral": dict(model_type="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    ),
    # Experts only in the second layer (the first dense, as `mlp_only_layers` makes it); top-k renormalised.
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    "phi3": dict(model_type="phi3", num_key_value_heads=2),
    "starcoder2": dict(model_type="starcoder2", num_key_value_heads=2, sliding_window=24),
    # Logits scaled after the head: Cohere multiplies them, Granite divides them (and scales attention itself).
    "cohere": dict(model_type="cohere", num_key_value_heads=2, logit_scale=0.5),
    "granite": dict(
        model_type="granite",
        num_key_value_heads=2,
        logits_scaling=2.0,
        attention_multiplier=0.2,
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
    ),
    "stablelm": dict(model_type="stablelm", num_key_value_heads=2, partial_rotary_factor=0.5, qk_layernorm=True),
    # Attention sinks (gpt-oss's s_aux) beside alternating sliding windows: run through the adapter.
    "gpt_oss": dict(
        model_type="gpt_oss",
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
    ),
    # Refused at load (tests/test_model_support.py): an attention-class table without a paged entry, and a model whose
    # own code needs the masks paged attention does not build.
    "gpt_neo": dict(model_type="gpt_neo", num_heads=4, num_layers=2, attention_types=[[["global", "local"], 1]]),
    "mpt": dict(model_type="mpt", n_heads=4, n_layers=2, d_model=64),
    # State-space models (native, their state in slots): Mamba; Falcon-Mamba (Mamba, its time step, B and C
    # normalised); Mamba2 in 2 groups of 4 heads, its chunk shorter than
    # the prompts; Jamba with Mamba layers (and experts) at 0 and 2, attention at 1 and 3; a Granite 4 hybrid with
    # rotary attention between two Mamba2 layers, experts beside its shared MLP and every multiplier away from 1.
    "mamba": dict(model_type="mamba", state_size=8, time_step_rank=8),
    "falcon_mamba": dict(model_type="falcon_mamba", state_size=8, time_step_rank=8),
    "mamba2": dict(model_type="mamba2", num_heads=8, head_dim=16, n_groups=2, state_size=8, chunk_size=16),
    "jamba": dict(
        model_type="jamba",
        num_hidden_layers=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=0,
        mamba_d_state=8,
        mamba_dt_rank=8,
    ),
    # Bamba: Mamba2, attention with half its head dimensions rotary, Mamba2; a dense MLP after each.
    "bamba": dict(
        model_type="bamba",
        num_hidden_layers=3,
        num_key_value_heads=2,
        attn_layer_indices=[1],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_chunk_size=16,
        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rope_type": "default"},
    ),
    "granitemoehybrid": dict(
        model_type="granitemoehybrid",
        num_hidden_layers=3,
        num_key_value_heads=2,
        intermediate_size=64,
        shared_intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["mamba", "attention", "mamba"],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=8,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=2.0,
        position_embedding_type="rope",
    ),
    # Multi-head latent attention (native): V3 with a LoRA'd query, sigmoid routing over 2 groups of 4 experts (a
    # random correction bias: tests/model_factory.py), renormalised and scaled, YaRN positions whose mscale_all_dim
    # moves the softmax scale, and a latent of 16 + 8 (the C++ kernel's scalar path); V2 with a plain query,
    # softmax routing limited to 2 of 4 groups, and a latent of 56 + 8 (a vectorised head size). Value heads are
    # narrower than key heads in both; the first layer is dense.
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=12,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=128,
            mscale=1.0,
            mscale_all_dim=0.8,
        ),
    ),
    # GLM-4.7-Flash: V3's attention and router, its dense and sparse layers listed (here sparse, then dense).
    "glm4_moe_lite": dict(
        model_type="glm4_moe_lite",
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        q_lora_rank=32,
        kv_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=12,
        v_head_dim=16,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.8,
        mlp_layer_types=["sparse", "dense"],
    ),
    "deepseek_v2": dict(
        model_type="deepseek_v2",
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=2,
        q_lora_rank=None,
        kv_lora_rank=56,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        first_k_dense_replace=1,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    ),
}


def _training_text() -> list[str]:
    """English-ish text that exists on every machine: the docstrings of a few standard-library modules."""
    import collections
    import json
    import pathlib
    import textwrap

    texts = []
    for module in (collections, json, pathlib, textwrap, inspect):
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj)
            if doc:
                texts.append(doc)
    texts.append("héllo wörld — 你好，世界 🙂 ferry boats carry passengers across the river")
    return texts


@functools.cache
def _trained_tokenizer() -> str:
    """The byte-level BPE tokenizer, trained once per process (as JSON): the trainer breaks ties between equally
    frequent pairs differently from run to run under load, and models meant to share a vocabulary (a draft model
    and its target) must get the same one."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(), trainer)
    return tokenizer.to_str()


def build_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer.from_str(_trained_tokenizer())
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def build_model_dir(directory: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Write a tiny `arch` model (random weights, float32) with its tokenizer into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    spec = dict(ARCHITECTURES[arch])
    model_type = spec.pop("model_type")
    common = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    if model_type != "gpt2":
        common.update(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
        )
    config = AutoConfig.for_model(model_type, **{**common, **spec, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is near-uniform; sharper logits make greedy ties (and so flaky comparisons) vanishingly rare.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek V3's, zero at init: let it change choices
                buffer.uniform_(-0.3, 0.3)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(directory)
    return directory


def build_scripted_model_dir(directory: Path, scripts: Mapping[str, Sequence[str]], chat_template: str) -> Path:
    """A llama whose greedy output follows a script: `scripts[trigger]` is what it writes after a prompt ending in
    the token `trigger`, then EOS (after any other token, EOS at once).

    Every trigger and script piece is a token of its own (an added, non-special token, so it decodes to itself).
    Embeddings are one-hot and every layer's output projections are zero, so the residual stream holds only the
    last token's embedding; the LM head maps each token of a script to the next one. The weights go through the
    real loading path like any other model's.
    """
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    chain = [piece for trigger, script in scripts.items() for piece in (trigger, *script)]
    assert len(set(chain)) == len(chain), "each piece may appear once: its token alone decides what follows"
    tokenizer.add_tokens([AddedToken(piece, normalized=False, special=False) for piece in chain])
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    vocab_size = len(tokenizer)
    successor = torch.full((vocab_size,), tokenizer.eos_token_id)
    for trigger, script in scripts.items():
        ids = [tokenizer.convert_tokens_to_ids(piece) for piece in (trigger, *script)]
        successor[ids[:-1]] = torch.tensor(ids[1:])
    _save_successor_model(directory, tokenizer, successor, 1.0)
    return directory


def _save_successor_model(
    directory: Path, tokenizer: PreTrainedTokenizerFast, successor: torch.Tensor, sharpness: float
) -> None:
    """A one-layer llama whose next-token logits are `sharpness` at `successor[token]` and 0 elsewhere: one-hot
    embeddings, every layer's output projections zero, so the residual stream holds only the last token's
    embedding and the LM head maps it to its successor."""
    vocab_size = len(tokenizer)
    hidden_size = -(-vocab_size // 64) * 64  # one-hot embeddings need a dimension per token
    config = AutoConfig.for_model(
        "llama",
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0 if name.endswith("norm.weight") else 0.0)  # RMSNorms pass the one-hot rows through
        model.model.embed_tokens.weight[:, :vocab_size] = torch.eye(vocab_size)
        model.lm_head.weight[successor, torch.arange(vocab_size)] = sharpness
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(directory)


def build_cycling_model_dir(directory: Path, cycle: int = 6, sharpness: float = 10.0, seed: int = 0) -> Path:
    """A llama that continues any token along short cycles: the vocabulary is shuffled into cycles of `cycle`
    tokens, and each token's next is its successor in its cycle with probability about 1 - vocab / e^sharpness.

    Its output repeats itself every `cycle` tokens, so a draft source that looks back (ngram, suffix) finds what
    comes next, for greedy and sampled requests alike. Built as `build_scripted_model_dir`'s models are.
    """
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    vocab_size = len(tokenizer)
    order = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
    order = order[order != tokenizer.eos_token_id]  # never generated by the cycles: the output runs its full length
    cycles = order[: len(order) // cycle * cycle].view(-1, cycle)
    successor = torch.arange(vocab_size)  # the few tokens left over repeat themselves
    successor[cycles] = cycles.roll(-1, dims=1)
    _save_successor_model(directory, tokenizer, successor, sharpness)
    return directory
