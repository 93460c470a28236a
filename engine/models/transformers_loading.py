"""Models built by transformers' own classes, with Ferry's paged attention as their attention implementation: the
encoders that pool, the image models whose language model has no native modules (Gemma 3), and the fallback for
any causal LM without native modules (`--model-impl transformers`, or a feature the native modules lack).

Its own module, imported only when such a model loads: transformers' modelling classes import its model-loading
machinery (torch.distributed's tensors, torch._dynamo, scipy), seconds of start-up a native model does not pay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    Mxfp4Config,
    PretrainedConfig,
    PreTrainedModel,
)

from engine.config import EngineConfig
from engine.layers.linear import adopt_linears
from engine.layers.linear_method import (
    LinearMethod,
    PackedLinearMethod,
    UnquantizedLinearMethod,
    onednn_linear_available,
)
from engine.models.encoder import TransformersEncoder
from engine.models.hf_adapter import ATTN_IMPLEMENTATION, TransformersCausalLM
from engine.models.hf_attention import replace_own_attention
from engine.models.registry import VISION_MODELS, architecture
from engine.models.support import UnsupportedModelError, dequantized_at_load
from engine.pooling.config import PoolingConfig

logger = logging.getLogger(__name__)


def load_encoder(
    config: EngineConfig,
    hf_config: PretrainedConfig,
    pooling: PoolingConfig,
    dtype: torch.dtype,
    device: torch.device,
    method: LinearMethod,
) -> TransformersEncoder:
    """An encoder (or its classifier) through transformers' `from_pretrained`, its linears adopted into the CPU
    kernels' layouts, its attention on the paged backend (engine/models/encoder.py)."""
    auto = AutoModelForSequenceClassification if pooling.kind == "classify" else AutoModel
    hf_config._attn_implementation = ATTN_IMPLEMENTATION
    if config.model.load_format == "dummy":
        hf_model = auto.from_config(hf_config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    else:
        hf_model = auto.from_pretrained(config.model.path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    hf_model = hf_model.eval().to(device)
    # An encoder only ever computes whole inputs, hundreds of rows a step: there oneDNN's packed layout multiplies
    # float32 1.45x as fast as the blocked kernel, whose strength is streaming weights for a few decode rows
    # (2,048 x 768 x 3,072 on this Intel CPU: 282 against 200 GFLOP/s on two cores).
    if onednn_linear_available(device, dtype):
        method = PackedLinearMethod()
    if not isinstance(method, UnquantizedLinearMethod):
        adopt_linears(hf_model, method)
    return TransformersEncoder(hf_model)


def paged_transformers_model(
    hf_config: PretrainedConfig, build: Callable[[PretrainedConfig], PreTrainedModel]
) -> PreTrainedModel:
    """transformers' model of `hf_config`, made by `build` with Ferry's paged attention as its attention
    implementation; UnsupportedModelError for a model that looks its attention classes up in a table of its own,
    which has no paged entry."""
    hf_config._attn_implementation = ATTN_IMPLEMENTATION
    try:
        return build(hf_config)
    except KeyError as error:
        if error.args != (ATTN_IMPLEMENTATION,):
            raise
        raise UnsupportedModelError(
            hf_config.model_type, "attention classes from a table of the model's own with no paged entry"
        ) from error


def load_adapted_vision_model(
    config: EngineConfig, hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device, method: LinearMethod
) -> nn.Module:
    """An image model whose language model has no native modules (Gemma 3): transformers' whole model with paged
    attention, its language model and head driven through the adapter, its vision modules as they are."""
    model_class = VISION_MODELS[architecture(hf_config)]
    # Paged attention for the language model; the vision tower's attention is transformers' own (sdpa).
    attention = {"text_config": ATTN_IMPLEMENTATION, "vision_config": "sdpa"}
    if config.model.load_format == "dummy":
        hf_model = AutoModelForImageTextToText.from_config(hf_config, dtype=dtype, attn_implementation=attention)
    else:
        hf_model = AutoModelForImageTextToText.from_pretrained(
            config.model.path, dtype=dtype, attn_implementation=attention
        )
    hf_model = hf_model.eval().to(device)
    replace_own_attention(hf_model)
    # The language model with its head, as transformers' causal LM of the text config holds them (made on the meta
    # device, then given the loaded model's modules: nothing is allocated twice).
    text_config = hf_model.config.text_config
    with torch.device("meta"):
        causal_lm = AutoModelForCausalLM.from_config(text_config, attn_implementation=ATTN_IMPLEMENTATION)
    causal_lm.model = hf_model.model.language_model
    causal_lm.lm_head = hf_model.lm_head
    language_model = TransformersCausalLM(causal_lm)
    language_model.check_runs_exactly()
    if not isinstance(method, UnquantizedLinearMethod):
        adopt_linears(causal_lm, method)
    return model_class(hf_config, language_model, hf_model.model.vision_tower, hf_model.model.multi_modal_projector)


def load_transformers_model(
    config: EngineConfig,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    method: LinearMethod,
) -> TransformersCausalLM:
    if config.model.load_format == "dummy":
        hf_model = paged_transformers_model(
            hf_config,
            lambda hf_config: AutoModelForCausalLM.from_config(
                hf_config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
            ),
        )
    else:
        options = {}
        if dequantized_at_load(hf_config):
            # Explicitly: where triton's MXFP4 kernels are installed transformers would run the experts on them.
            logger.info("MXFP4 experts dequantized to %s as they load", dtype)
            options["quantization_config"] = Mxfp4Config(dequantize=True)
        hf_model = paged_transformers_model(
            hf_config,
            lambda _: AutoModelForCausalLM.from_pretrained(
                config.model.path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, **options
            ),
        )
    # Built (or loaded) in `dtype` on the CPU, then moved: loading straight onto a GPU (`device_map`) would need
    # accelerate.
    hf_model = hf_model.eval().to(device)
    replace_own_attention(hf_model)
    model = TransformersCausalLM(hf_model)
    model.check_runs_exactly()
    if not isinstance(method, UnquantizedLinearMethod):
        adopt_linears(hf_model, method)
    return model
