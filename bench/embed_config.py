"""`ferry bench embed`'s shapes and options: plain data, apart from the benchmark (bench/embed.py), so that building
the `ferry` command line imports neither torch nor transformers."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ShapeKind = Literal["bert", "qwen3"]
SYSTEMS = ("ferry", "st", "vllm")
DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class EmbedShape:
    kind: ShapeKind
    config: dict[str, int | float]
    """transformers config fields (vocab_size included)."""
    pooling: Literal["mean", "lasttoken"]
    normalize: bool
    checkpoint_dtype: Literal["float32", "bfloat16"]
    """What the weights are saved in, as the public checkpoint's: `--dtype auto` runs every system in it."""
    init_std: float
    """Random weights' std: wide enough that different inputs get clearly different vectors, narrow enough that
    bfloat16 stays near float32 (Qwen3's 28 layers at 0.05 leave bfloat16 at cosine 0.9987 to float32, at 0.02 at
    0.9999; BERT's mean pooling wants 0.05 to part inputs)."""


QWEN3_EOS = "<|endoftext|>"
QWEN3_EOS_ID = 151643
"""Qwen3's vocabulary: regular tokens below this, then its special tokens; the embedder appends EOS to every input."""

EMBED_SHAPES: dict[str, EmbedShape] = {
    # bert-base-uncased's config; mean pooling, as sentence-transformers' bert-base-nli-mean-tokens.
    "bert-base": EmbedShape(
        kind="bert",
        config=dict(
            vocab_size=30522,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            max_position_embeddings=512,
            type_vocab_size=2,
            pad_token_id=0,
        ),
        pooling="mean",
        normalize=False,
        checkpoint_dtype="float32",
        init_std=0.05,
    ),
    # Qwen3-Embedding-0.6B's config: last-token pooling, normalized, saved in bfloat16.
    "qwen3-embedding-0.6b": EmbedShape(
        kind="qwen3",
        config=dict(
            vocab_size=151669,
            hidden_size=1024,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            max_position_embeddings=32768,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            bos_token_id=QWEN3_EOS_ID,
            eos_token_id=QWEN3_EOS_ID,
            pad_token_id=QWEN3_EOS_ID,
        ),
        pooling="lasttoken",
        normalize=True,
        checkpoint_dtype="bfloat16",
        init_std=0.02,
    ),
    # The smoke test's shape: the same files and paths as bert-base, in milliseconds. Head dim 64: vLLM's CPU
    # attention has no kernel for the test models' 16.
    "tiny-bert": EmbedShape(
        kind="bert",
        config=dict(
            vocab_size=1000,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=256,
            max_position_embeddings=512,
            type_vocab_size=2,
            pad_token_id=0,
        ),
        pooling="mean",
        normalize=False,
        checkpoint_dtype="float32",
        init_std=0.1,
    ),
}


@dataclass
class EmbedOptions:
    model: str = "bert-base"
    num_inputs: int = 1024
    min_len: int = 16
    max_len: int = 512
    seed: int = 0
    systems: tuple[str, ...] = SYSTEMS
    """Each `system` or `system@dtype` (`st@float32`: sentence-transformers in float32 whatever `dtype` says)."""
    dtype: str = "auto"
    """Every system's dtype unless its entry names one; `auto`: the checkpoint's (float32 BERT, bfloat16 Qwen3)."""
    batch_size: int = 32
    """Inputs per /v1/embeddings request, and `encode`'s batch size."""
    concurrency: int = 8
    """Requests in flight at once against a server."""
    max_batch_tokens: int = 2048
    """Token budget of one engine step: Ferry's --max-batch-tokens, vLLM's --max-num-batched-tokens."""
    threads: int | None = None
    """CPU threads for every system; None: each system's own default."""
    check_inputs: int = 8
    min_cosine: float = 0.999
    vllm_python: Path | None = None
    workdir: Path = Path(tempfile.gettempdir()) / "ferry-bench-embed"
    ferry_args: tuple[str, ...] = ()
    vllm_args: tuple[str, ...] = ()
    timeout: float = 1800.0
    startup_timeout: float = 600.0
