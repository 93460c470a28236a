"""From a local Hugging Face model directory (or a config alone, with dummy weights) to a runnable model."""

from __future__ import annotations

import ctypes
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from engine.attention import AttentionBackend, select_backend
from engine.config import EngineConfig, EngineStartupError
from engine.distributed.parallel import TensorParallel
from engine.execution.compile import check_compile_level, compile_model
from engine.execution.cpu_threads import decode_threads
from engine.layers.linear import LinearBase
from engine.layers.linear_method import (
    LinearMethod,
    UnquantizedLinearMethod,
    select_linear_method,
)
from engine.layers.moe import PackedOnLoad
from engine.models.base import CausalLM
from engine.models.checkpoint import checkpoint_files
from engine.models.config_record import load_config, transformers_config
from engine.models.gguf import gguf_tensors, source_file
from engine.models.llama import check_tensor_parallel
from engine.models.registry import (
    ADAPTED_VISION_MODELS,
    BASE_MODELS,
    NATIVE_MODELS,
    VISION_MODELS,
    VISION_TEXT_TYPES,
    architecture,
    runs_native,
)
from engine.models.support import (
    STATE_SPACE_TYPES,
    UnsupportedModelError,
    check_config_code,
    has_causal_lm_class,
    unsupported_feature,
)
from engine.models.vision_language import LanguageModelAlone, VisionLanguageModel
from engine.pooling.config import ENCODER_TYPES, PoolingConfig, UnsupportedPooling, pooling_config
from engine.pooling.pooler import Pooler
from engine.quantization import (
    UnsupportedQuantization,
    check_device,
    check_layers,
    quantized_head_method,
    quantized_linear_method,
)
from engine.quantization.base import CheckpointQuantization, QuantizedLinearMethod
from engine.quantization.checkpoints import stored_quantization

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: nn.Module
    """A `CausalLM` (engine/models/base.py)."""
    hf_config: PretrainedConfig
    eos_token_ids: frozenset[int]
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    native: bool
    backend: AttentionBackend
    """The attention kernels the model's layers call."""
    rank: int = 0
    """The tensor-parallel rank this shard belongs to (0 without tensor parallelism): only rank 0 gets logits."""
    pooler: Pooler | None = None
    """What the model pools (engine/pooling/); None for a model that only generates."""
    stored: CheckpointQuantization | None = None
    """How the checkpoint stores its weights quantized, where the linears run its codes as stored
    (engine/quantization/checkpoints.py); None otherwise."""

    @property
    def takes_images(self) -> bool:
        """Whether its prompts may hold images (an image model: engine/models/vision_language.py)."""
        return hasattr(self.model, "encode_images")

    @property
    def generates(self) -> bool:
        """Whether requests sample from it (a pooling model of an encoder, or an embedding model, does not)."""
        return self.pooler is None or self.pooler.config.generates


def weight_bytes(model: nn.Module) -> int:
    """The bytes of `model`'s weights: parameters, and the weights a module keeps as plain tensors in its linear
    method's layout (blocked, oneDNN-packed, quantized codes and scales, alone or in a tuple), each tensor once (a
    tied matrix counts once). Buffers (rotary tables) are left out."""
    held = (
        value
        for module in model.modules()
        for attribute in (*module.parameters(recurse=False), *vars(module).values())
        for value in (attribute if isinstance(attribute, tuple) else (attribute,))
    )
    sizes = {id(t): t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor)}
    return sum(sizes.values())


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    return device


def resolve_dtype(name: str, device: torch.device, checkpoint: torch.dtype | None = None) -> torch.dtype:
    """The dtype `name` means for a model on `device` whose checkpoint is stored in `checkpoint` (None: unknown).
    `auto` is bfloat16 on GPU; on CPU the checkpoint's own bfloat16 (decode reads every weight each token, and the
    CPU kernels take bfloat16 at half float32's bytes on every CPU), float32 otherwise (a float16 checkpoint widens
    exactly; the CPU kernels have no float16)."""
    if name == "auto":
        if device.type == "cuda" or checkpoint == torch.bfloat16:
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def checkpoint_dtype(hf_config: PretrainedConfig) -> torch.dtype | None:
    """The dtype config.json says the weights are stored in (`dtype`, formerly `torch_dtype`), if it says."""
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) else None


def _eos_ids(model_dir: str, hf_config: PretrainedConfig) -> frozenset[int]:
    eos = None
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")  # GenerationConfig's, read without importing transformers
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def _checkpoint_tensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors one at a time, each read from disk only when it is asked for; what loading the last
    one freed goes back to the system before the next is read. A directory made from a GGUF file reads that file."""
    gguf_file = source_file(model_dir)
    if gguf_file is not None:
        for name, tensor in gguf_tensors(gguf_file):
            yield name, tensor
            _release_freed_memory()
        return
    for path, names in checkpoint_files(model_dir).items():
        with safe_open(path, framework="pt") as f:
            for name in f.keys() if names is None else names:
                yield name, f.get_tensor(name)
                _release_freed_memory()


_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; other C libraries go without


def _release_freed_memory() -> None:
    """Hand the pages of freed heap memory back to the system. After the first large free glibc serves large
    allocations from its heap rather than mmap, so the temporaries of converting a tensor (its float32 copy, a
    layer's codes before they are packed) leave holes between weights that stay resident: loading a bfloat16
    checkpoint as int8 peaked at 1.17-1.33x the int8 weights without this, 1.07x with it (AVX2 build, 230M
    parameters; ~3 ms a call)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _check_state_space(config: EngineConfig, hf_config: PretrainedConfig) -> None:
    """Refuse, by option, what a model with recurrent layers does not run with: its state runs on one device,
    eagerly, without adapters, and every token it computes is kept (a rejected draft would have advanced the
    state)."""
    refused = []
    if config.parallel.tensor_parallel_size > 1:
        refused.append(f"--tensor-parallel-size {config.parallel.tensor_parallel_size}")
    if config.execution.compile != "none":
        refused.append(f"--compile {config.execution.compile}")
    if config.lora.enable_lora:
        refused.append("--enable-lora")
    if config.scheduler.speculative_config is not None:
        refused.append("--speculative-config (a rejected draft would already have advanced the recurrent state)")
    if refused:
        raise EngineStartupError(
            f"model_type {hf_config.model_type!r} has recurrent (state-space) layers, which Ferry runs on one device, "
            f"eagerly, without adapters or drafts: {', '.join(refused)} is not supported with it"
        )


def model_config(config: EngineConfig) -> tuple[PretrainedConfig, bool, PoolingConfig | None]:
    """The model's transformers config, whether it runs on the native modules (else a transformers adapter), and
    what it pools (None: it only generates); raises UnsupportedModelError for a model the engine cannot run
    exactly, UnsupportedPooling for pooling it cannot compute, EngineStartupError for a model it cannot shard over
    --tensor-parallel-size."""
    config_path = os.path.join(config.model.path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config.model.path!r} is not a model directory (no config.json)")
    with open(config_path, encoding="utf-8") as f:
        config_json = json.load(f)
    check_config_code(config_json)
    hf_config = load_config(config.model.path)
    model = config.model
    pooling = pooling_config(
        model.path,
        config_json,
        runner=model.runner,
        pooling_type=model.pooling_type,
        pooling_normalize=model.pooling_normalize,
        reranker_tokens=model.reranker_tokens,
    )
    if getattr(hf_config, "vision_config", None) is not None:
        _check_vision(config, hf_config, pooling)
        return hf_config, True, None
    if pooling is not None and pooling.bidirectional:
        _check_encoder(config, hf_config)
        return transformers_config(hf_config, config.model.path), False, pooling
    if pooling is not None and not has_causal_lm_class(hf_config):
        raise UnsupportedPooling(
            f"model_type {hf_config.model_type!r} ({architecture(hf_config)}): Ferry pools with the encoders "
            f"{', '.join(sorted(ENCODER_TYPES))} and with causal LMs' hidden states"
        )
    causal = BASE_MODELS.get(architecture(hf_config))
    if causal is not None:
        if pooling is None:
            raise UnsupportedModelError(
                hf_config.model_type,
                f"a {architecture(hf_config)} checkpoint (a base model without an LM head) served to generate: "
                "serve it with --runner pooling (it has no head to generate with)",
            )
        # A sentence-transformers save of a decoder (its base model's weights): the causal LM's modules run it.
        hf_config.architectures = [causal]
    native = runs_native(hf_config, config.model.model_impl)
    if not native:
        hf_config = transformers_config(hf_config, config.model.path)
    if hf_config.model_type in STATE_SPACE_TYPES:
        _check_state_space(config, hf_config)
    check_compile_level(config, native=native, device=resolve_device(config.model.device))
    if config.parallel.tensor_parallel_size > 1:
        if not native:
            # The adapter runs transformers' modules whole, on one device: refused rather than served unsharded.
            if config.model.model_impl == "transformers":
                why = "--model-impl transformers"
            elif architecture(hf_config) not in NATIVE_MODELS:
                why = "there are no native modules for it"
            else:
                why = f"the native modules lack {unsupported_feature(hf_config, native=True)}"
            raise EngineStartupError(
                f"--tensor-parallel-size {config.parallel.tensor_parallel_size}: this {hf_config.model_type!r} "
                f"model runs on the transformers adapter, which Ferry cannot shard ({why}); tensor parallelism runs "
                f"the native models only ({', '.join(sorted(NATIVE_MODELS))})"
            )
        check_tensor_parallel(hf_config, config.parallel.tensor_parallel_size)
    return hf_config, native, pooling


def _check_encoder(config: EngineConfig, hf_config: PretrainedConfig) -> None:
    """Refuse, by flag, what the encoders' path (transformers' modules, one rank, full precision) does not do."""
    refused = [
        (config.parallel.tensor_parallel_size > 1, f"--tensor-parallel-size {config.parallel.tensor_parallel_size}"),
        (config.model.quantization != "none", f"--quantization {config.model.quantization}"),
        (bool(getattr(hf_config, "quantization_config", None)), "a quantized checkpoint (quantization_config)"),
        (config.model.model_impl == "native", "--model-impl native"),
        (config.execution.compile != "none", f"--compile {config.execution.compile}"),
    ]
    for asked, flag in refused:
        if asked:
            raise EngineStartupError(
                f"{flag}: this {hf_config.model_type!r} encoder runs on transformers' modules, on one rank, in full "
                "precision, uncompiled"
            )


def _check_vision(config: EngineConfig, hf_config: PretrainedConfig, pooling: PoolingConfig | None) -> None:
    """Refuse, by name, an image model whose family Ferry does not run, and the options its path does not take."""
    arch = architecture(hf_config)
    text = hf_config.text_config
    text_only = config.model.max_images == 0 and text.model_type in VISION_TEXT_TYPES
    if arch not in VISION_MODELS and not text_only:
        raise UnsupportedModelError(
            hf_config.model_type,
            f"images through {arch} (the image models Ferry runs: {', '.join(sorted(VISION_MODELS))}; with a "
            f"language model of {', '.join(sorted(VISION_TEXT_TYPES))}, --limit-mm-per-prompt image=0 serves it "
            "text-only)",
        )
    adapted = arch in ADAPTED_VISION_MODELS
    if not adapted and text.model_type not in VISION_TEXT_TYPES:
        raise UnsupportedModelError(
            hf_config.model_type,
            f"a {text.model_type!r} language model inside {arch} (its native modules run "
            f"{', '.join(sorted(VISION_TEXT_TYPES))})",
        )
    feature = unsupported_feature(text, native=not adapted, inside_image_model=True)
    if feature is not None:
        raise UnsupportedModelError(hf_config.model_type, f"its language model's {feature}")
    speculative = config.scheduler.speculative_config
    refused = [
        (adapted and config.model.quantization != "none", f"--quantization {config.model.quantization}"),
        (adapted and config.model.model_impl == "native", "--model-impl native"),
        (pooling is not None, "--runner pooling"),
        (config.model.model_impl == "transformers", "--model-impl transformers"),
        (config.parallel.tensor_parallel_size > 1, f"--tensor-parallel-size {config.parallel.tensor_parallel_size}"),
        (config.execution.compile != "none", f"--compile {config.execution.compile}"),
        (config.lora.enable_lora, "--enable-lora"),
        (speculative is not None and speculative.method == "draft_model", "a draft model (--speculative-config)"),
    ]
    for asked, flag in refused:
        if asked:
            modules = "transformers' modules (through the adapter)" if adapted else "the native modules"
            raise EngineStartupError(
                f"{flag}: this {hf_config.model_type!r} image model runs its language model on {modules}, on one "
                "rank, uncompiled, generating, without LoRA adapters or a draft model"
            )


def text_config(hf_config: PretrainedConfig) -> PretrainedConfig:
    """The language model's config: an image model's `text_config`, else the config itself."""
    return hf_config.text_config if getattr(hf_config, "vision_config", None) is not None else hf_config


def load_model(config: EngineConfig, tp: TensorParallel | None = None) -> LoadedModel:
    """The model of `config` on its device, with the attention backend it runs with (sets torch's CPU threads);
    with `tp`, this rank's shard of it on the rank's device.

    The backend is chosen for what the model says its attention needs (`CausalLM.attention_needs`): an explicit
    `--attention-backend` that lacks one is refused by name (`UnsupportedAttention`), before a native model's
    weights are read; `auto` passes over kernels that lack one."""
    full_config, native, pooling = model_config(config)
    hf_config = text_config(full_config)
    device = resolve_device(config.model.device) if tp is None else tp.device
    threads = decode_threads(config)
    if device.type == "cpu" and threads is not None:
        torch.set_num_threads(threads)
    dtype = resolve_dtype(config.model.dtype, device, checkpoint_dtype(full_config))
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is not None and hf_config.model_type in ("roberta", "xlm-roberta"):
        limit -= hf_config.pad_token_id + 1  # its positions start after the padding index
    max_model_len = config.model.max_model_len or limit or 4096
    if limit is not None and max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}")
    torch.manual_seed(config.scheduler.seed)
    # Weights go straight into `dtype` on `device`: each checkpoint tensor is converted as it is copied into its
    # parameter, so the peak is the model in its own dtype plus one tensor, never a float32 copy of the model.
    method = select_linear_method(device, dtype)
    quantized = quantized_linear_method(config.model, device)
    stored = stored_quantization(config.model, config.parallel.tensor_parallel_size)
    if stored is not None and stored.format == "gguf" and device.type != "cpu":
        stored = None  # the grouped kernels are CPU kernels: on a GPU a GGUF file's weights serve dequantized
    if stored is not None:
        check_device(stored.runs_as, device)
        logger.info("weights stored quantized (%s: %s): run as %s", stored.format, stored.description, stored.runs_as)
        quantized = stored.method()
    if quantized is not None and not native:
        raise UnsupportedQuantization(
            quantized.scheme,
            f"this {hf_config.model_type!r} model runs on the transformers adapter, which loads it whole in full "
            f"precision before a layer could be quantized; quantized weights run on the native modules "
            f"({', '.join(sorted(NATIVE_MODELS))})",
        )
    if pooling is not None and pooling.bidirectional:
        from engine.models.transformers_loading import load_encoder  # imports transformers' modelling (seconds)

        model = load_encoder(config, hf_config, pooling, dtype, device, method)
        backend = _backend_for(config, model, device, dtype)
    elif architecture(full_config) in ADAPTED_VISION_MODELS:
        from engine.models.transformers_loading import load_adapted_vision_model

        model = load_adapted_vision_model(config, full_config, dtype, device, method)
        backend = _backend_for(config, model, device, dtype)
    elif native:
        arch = architecture(full_config)
        model_class = VISION_MODELS.get(arch) or NATIVE_MODELS.get(arch) or LanguageModelAlone
        # A tied LM head reads the embedding's matrix, which the embedding looks rows up in: a plain layout, so
        # the matrix is stored once (see `_tied_head_method`). The CPU schemes quantize the head (int8), fp8 keeps it
        # in the model's dtype.
        head_method = quantized_head_method(config.model)
        if stored is not None and stored.head is not None:
            head_method = stored.head()
        if head_method is None and getattr(hf_config, "tie_word_embeddings", False):
            head_method = _tied_head_method(device, dtype)
        elif head_method is None and quantized is not None:
            head_method = method
        base_checkpoint = (
            pooling is not None and config.model.load_format != "dummy" and _is_base_checkpoint(config.model.path)
        )
        if base_checkpoint:
            # The base model's weights alone (a sentence-transformers save): it pools, and its LM head would be
            # unused, so the head shares the embedding rather than being read from a checkpoint that lacks it.
            hf_config.tie_word_embeddings = True
        model = model_class.empty(full_config, max_model_len, device, dtype, tp, quantized or method, head_method)
        check_layers(model)
        backend = _backend_for(config, model, device, dtype)
        if config.model.load_format == "dummy":
            _init_dummy(model)
        else:
            tensors = _checkpoint_tensors(config.model.path)
            model.load_weights(_as_causal_lm(tensors) if base_checkpoint else tensors)
    else:
        from engine.models.transformers_loading import load_transformers_model

        model = load_transformers_model(config, hf_config, dtype, device, method)
        backend = _backend_for(config, model, device, dtype)
    if isinstance(model, VisionLanguageModel) and not isinstance(method, UnquantizedLinearMethod):
        model.adopt_vision_layers(method)  # the CPU kernels' layouts (never --quantization's)
    model.eval()
    if native and config.execution.compile == "none" and not config.execution.enforce_eager:
        model.fuse_decoder()
    compile_model(model, config.execution.compile)
    return LoadedModel(
        model,
        hf_config,
        _eos_ids(config.model.path, hf_config),
        max_model_len,
        device,
        dtype,
        native,
        backend,
        rank=0 if tp is None else tp.rank,
        pooler=None if pooling is None else _pooler(config, pooling, model, device, dtype),
        stored=stored,
    )


def _pooler(
    config: EngineConfig, pooling: PoolingConfig, model: nn.Module, device: torch.device, dtype: torch.dtype
) -> Pooler:
    pooler = Pooler(pooling, model, device, dtype)
    if pooling.yes_no_tokens is not None:
        # Imported here: a tokenizer loads transformers, which a warm engine otherwise never imports.
        from engine.models.tokenizer import auto_tokenizer

        tokenizer = auto_tokenizer(config.model.path)
        ids = []
        for token in pooling.yes_no_tokens:
            encoded = tokenizer.encode(token, add_special_tokens=False)
            if len(encoded) != 1:
                raise UnsupportedPooling(
                    f"--reranker-tokens {config.model.reranker_tokens}: {token!r} is {len(encoded)} tokens of this "
                    "model's vocabulary, not one"
                )
            ids.append(encoded[0])
        pooler.yes_no_ids = (ids[0], ids[1])
    logger.info("pooling: %s", pooling)
    return pooler


def _is_base_checkpoint(model_dir: str) -> bool:
    """Whether the checkpoint holds a base model's weights (no `model.` prefix, as sentence-transformers saves a
    decoder) rather than a causal LM's."""
    for path, names in checkpoint_files(model_dir).items():
        if names is None:
            with safe_open(path, framework="pt") as f:
                names = list(f.keys())
        if any(name.startswith("model.") for name in names):
            return False
    return True


def _as_causal_lm(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A base model's tensors named as its causal LM names them."""
    for name, tensor in tensors:
        yield f"model.{name}", tensor


def _backend_for(config: EngineConfig, model: CausalLM, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    return select_backend(
        config.model.attention_backend, device.type, config.cache.page_size, dtype, needs=model.attention_needs()
    )


def _tied_head_method(device: torch.device, dtype: torch.dtype) -> LinearMethod:
    """The LM head's method where it shares the embedding's matrix: mostly one that gives rows back (`embed_rows`),
    so the matrix is stored once, in the head's layout (the plain layout oneDNN's packing would leave cost the demo
    model about 10% of its offline throughput: a 4096 x 256 float32 head through MKL's sgemm, 2.3 ms a step against
    0.5 ms in the blocked layout). A bfloat16 head takes what the model's linears take, rows not asked back: on a CPU
    with AMX oneDNN's packed layout, the embedding keeping its own plain copy (elsewhere the blocked or the plain
    layout, one copy), since the blocked kernel's paired tiles, bound by their broadcasts, took 1.05x
    (one row) to 3.5x (32 rows) oneDNN's time on a 151,936 x 1,536 head (`python scripts/bench_linear.py`,
    BENCHMARKS.md "Images"), a quarter of a batched Qwen2-VL run, for one more copy of the vocabulary's matrix."""
    return select_linear_method(device, dtype, embeds_rows=dtype != torch.bfloat16)


@torch.no_grad()
def _init_dummy(model: nn.Module) -> None:
    """Random weights of a realistic scale, so activations and timings look like a trained model's; then each
    linear's method processes them, as loading would."""
    quantized = [
        module
        for module in model.modules()
        if isinstance(module, LinearBase)
        and isinstance(module.method, QuantizedLinearMethod)
        and module.method.init_dummy(module)
    ]
    codes = {id(param) for layer in quantized for name, param in layer.named_parameters() if name != "bias"}
    for name, param in model.named_parameters():
        if id(param) in codes:
            continue
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif param.dim() >= 2:
            param.normal_(0.0, 0.02)
        else:
            param.zero_()
    for module in model.modules():
        if isinstance(module, LinearBase | PackedOnLoad) and not module.loaded:
            module.finish_loading()
