"""Quantized checkpoints: what `config.json`'s `quantization_config` says (or a GGUF file's types), and the linear
method that keeps the checkpoint's weights as they are stored (engine/quantization/compressed_tensors.py, gptq.py,
awq.py, gguf.py).

A checkpoint is served on the kernels of `--quantization`'s schemes where one takes its layout exactly, and refused
by name otherwise (`UnsupportedQuantization`): never dequantized, never quantized again. Its LM head and embedding
are stored in the model's dtype by every tool here, and stay so; a GGUF file's Q8_0 head keeps its codes too. A
GGUF file is read dequantized in any case (engine/models/gguf.py), so `--quantization` may quantize it anew
instead; a checkpoint with `quantization_config` takes no `--quantization`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

from engine.config import ModelConfig
from engine.models.gguf import kept_types
from engine.quantization import UnsupportedQuantization
from engine.quantization.awq import AWQLayout
from engine.quantization.base import CheckpointQuantization
from engine.quantization.compressed_tensors import FORMAT as COMPRESSED_TENSORS
from engine.quantization.compressed_tensors import scheme as compressed_tensors_scheme
from engine.quantization.gptq import GPTQLayout
from engine.quantization.grouped import GroupedIntMethod

logger = logging.getLogger(__name__)


def _refusal(quant_method: str) -> Callable[[str], UnsupportedQuantization]:
    return lambda why: UnsupportedQuantization(quant_method, f"this checkpoint's {why} cannot be served")


def checkpoint_quantization(
    hf_quantization: dict[str, Any] | None, tensor_parallel_size: int = 1
) -> CheckpointQuantization | None:
    """`quantization_config` (None: a checkpoint in plain floats) -> how Ferry serves it; raises
    `UnsupportedQuantization`, naming the format and the feature, for what it cannot serve exactly."""
    if not hf_quantization:
        return None
    quant_method = str(hf_quantization.get("quant_method", "unknown"))
    refuse = _refusal(quant_method)
    if quant_method == COMPRESSED_TENSORS:
        return compressed_tensors_scheme(hf_quantization, refuse)
    if quant_method in ("gptq", "awq"):
        return _grouped(quant_method, hf_quantization, tensor_parallel_size, refuse)
    raise UnsupportedQuantization(
        quant_method, "Ferry serves compressed-tensors, GPTQ and AWQ checkpoints (and GGUF files), not this format"
    )


def _grouped(
    quant_method: str,
    config: dict[str, Any],
    tensor_parallel_size: int,
    refuse: Callable[[str], UnsupportedQuantization],
) -> CheckpointQuantization:
    bits = config.get("bits", config.get("w_bit"))
    if bits not in (4, 8) or (quant_method == "awq" and bits != 4):
        raise refuse(f"{bits}-bit weights (Ferry's kernels take 4-bit {quant_method} weights, and 8-bit GPTQ ones)")
    group_size = config.get("group_size", config.get("q_group_size", 128))
    group = None if group_size == -1 else int(group_size)
    if config.get("lm_head"):
        raise refuse("quantized lm_head")
    if config.get("dynamic"):
        raise refuse("per-module overrides (dynamic)")
    if config.get("modules_to_not_convert"):
        raise refuse(f"linears left unquantized (modules_to_not_convert: {config['modules_to_not_convert']})")
    if str(config.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise refuse(f"codes packed in {config['pack_dtype']} words (Ferry reads int32 words)")
    where = "a scale per output row" if group is None else f"groups of {group}"
    if quant_method == "awq":
        layout_format = str(config.get("version", config.get("format", "gemm"))).lower()
        if layout_format != "gemm":
            raise refuse(f"{layout_format!r} layout (Ferry reads AutoAWQ's GEMM layout)")
        if not config.get("zero_point", True):
            raise refuse("symmetric AWQ (zero_point false)")
        return CheckpointQuantization(
            quant_method, f"int4 weights, asymmetric, {where}", "int4", lambda: GroupedIntMethod(AWQLayout(group))
        )
    layout_format = str(config.get("checkpoint_format", config.get("format", "gptq"))).lower()
    if layout_format not in ("gptq", "gptq_v2"):
        raise refuse(f"{layout_format!r} layout (Ferry reads the gptq and gptq_v2 layouts)")
    act_order = bool(config.get("desc_act"))
    if act_order and tensor_parallel_size > 1:
        # Activation order scatters a group's inputs over every rank's columns of a row-parallel layer.
        raise refuse(f"activation order (desc_act) over --tensor-parallel-size {tensor_parallel_size}")
    layout = GPTQLayout(bits, group, act_order, zeros_minus_one=layout_format == "gptq")
    side = "symmetric" if config.get("sym", True) else "asymmetric"
    order = ", in activation order" if act_order else ""
    return CheckpointQuantization(
        quant_method, f"int{bits} weights, {side}, {where}{order}", f"int{bits}", lambda: GroupedIntMethod(layout)
    )


def stored_quantization(model: ModelConfig, tensor_parallel_size: int = 1) -> CheckpointQuantization | None:
    """How the model directory's weights are stored quantized and run so: its config.json's `quantization_config`,
    or the GGUF file it was made from (None: stored in floats, or a GGUF file that `--quantization` quantizes
    anew); raises `UnsupportedQuantization` for what Ferry cannot serve, and for `--quantization` over a quantized
    checkpoint."""
    linear_type, head_type = kept_types(model.path)
    if linear_type is not None and model.quantization != "none":
        logger.warning(
            "--quantization %s: the GGUF file's %s linears are quantized anew from their dequantized weights (leave "
            "--quantization out to run the file's own codes)",
            model.quantization,
            linear_type,
        )
        return None
    if linear_type is not None:
        return _gguf(linear_type, head_type)
    found = _quantization_config(model.path)
    if found and found.get("quant_method") == "mxfp4":
        if _model_type(model.path) == "gpt_oss":
            return None  # its experts, dequantized as the adapter loads them (engine/models/support.py)
        raise UnsupportedQuantization("mxfp4", "MXFP4 weights are served for gpt-oss only (its experts, dequantized "
                                      "exactly as they load)")  # fmt: skip
    stored = checkpoint_quantization(found, tensor_parallel_size)
    if stored is not None and model.quantization != "none":
        raise UnsupportedQuantization(
            model.quantization,
            f"this checkpoint is quantized already ({stored.format}: {stored.description}); leave --quantization "
            "out to serve it as stored",
        )
    return stored


def _model_type(model_dir: str) -> str | None:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f).get("model_type")


def _quantization_config(model_dir: str) -> dict[str, Any] | None:
    """config.json's `quantization_config` (`compression_config` in compressed-tensors' first releases), or the
    settings file older GPTQ and AWQ checkpoints keep beside it (quantize_config.json, quant_config.json)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    found = config.get("quantization_config") or config.get("compression_config")
    if found:
        return found
    for name, quant_method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        side_file = os.path.join(model_dir, name)
        if os.path.isfile(side_file):
            with open(side_file, encoding="utf-8") as f:
                return {"quant_method": quant_method, **json.load(f)}
    return None


def _gguf(linear_type: str, head_type: str | None) -> CheckpointQuantization:
    from engine.quantization.gguf import GGUFQ4_0Method, GGUFQ8_0Method
    from engine.quantization.int8 import Int8HeadMethod

    if linear_type == "Q4_0":
        linears = "int4", GGUFQ4_0Method, "Q4_0: 4-bit codes in blocks of 32, a float16 scale each"
    else:
        linears = "int8", GGUFQ8_0Method, "Q8_0: 8-bit codes in blocks of 32, a float16 scale each"
    runs_as, method, description = linears
    # A head of another type (a K-quant) is dequantized as it loads: int8 per row then, as `--quantization`'s CPU
    # schemes keep theirs (on a small model the head is a large part of a step's reads).
    head = GGUFQ8_0Method if head_type == "Q8_0" else Int8HeadMethod
    head_words = "its Q8_0 LM head too" if head_type == "Q8_0" else "the LM head in int8 by row"
    return CheckpointQuantization("gguf", f"{description}; {head_words}", runs_as, method, head)
