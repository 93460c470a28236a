"""A PEFT LoRA adapter on disk, read and checked against the base model without loading its tensors.

PEFT saves `adapter_config.json` and `adapter_model.safetensors`, whose tensors are named
`base_model.model.<module>.lora_A.weight` (`[r, in]`) and `...lora_B.weight` (`[out, r]`). `read_adapter` reads the
config and the safetensors header (names and shapes only: pure Python, no torch, so the API process checks an
adapter before the engine sees it) and refuses, saying why, whatever Ferry would not run exactly: another base
(shapes that do not fit), a rank above --max-lora-rank, DoRA, `modules_to_save`, LoRA on the embedding or LM head,
trainable or added tokens, per-module ranks or alphas, LoRA biases.

The scaling is PEFT's: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.layers.sparse_layers import is_sparse_layer

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may adapt: the attention's and the MLP's (Llama-family names)."""

_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")

_EMPTY = (None, False, {}, [], "", "none")
_UNBUILT = {
    "target_parameters": "LoRA on parameters rather than modules (target_parameters: a mixture of experts' experts)",
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained copies of modules)",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "lora_bias": "LoRA biases (lora_bias)",
    "layer_replication": "layer replication",
    "use_qalora": "QA-LoRA",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
}
"""Adapter config keys that change what the adapter computes beyond plain LoRA; set, they are refused."""


class AdapterError(ValueError):
    """The adapter cannot be served on this model: the message says why."""


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter as read from disk: its rank, scaling and the `[r, in]` / `[out, r]` shapes of each module."""

    path: str
    rank: int
    scaling: float
    modules: dict[tuple[int, str], tuple[tuple[int, int], tuple[int, int]]]
    """(layer, projection) -> (lora_A shape, lora_B shape)."""

    @property
    def weights_file(self) -> Path:
        return Path(self.path) / WEIGHTS_FILE


def projection_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """`[out, in]` of each adaptable projection of a Llama-family model of `hf_config`."""
    hidden, width = hf_config.hidden_size, hf_config.intermediate_size
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    return {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (width, hidden),
        "up_proj": (width, hidden),
        "down_proj": (hidden, width),
    }


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from a safetensors file's header (an 8-byte length, then JSON)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: entry["shape"] for name, entry in header.items() if name != "__metadata__"}


def read_adapter(path: str | Path, hf_config: Any, max_rank: int) -> AdapterSpec:
    """The adapter PEFT saved in directory `path`, checked against the base model of `hf_config`; raises
    AdapterError, saying why, for one Ferry cannot serve exactly."""
    directory = Path(path)
    config = _read_config(directory)
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{directory} is a {config.get('peft_type')} adapter; only LoRA adapters are served")
    for key, what in _UNBUILT.items():
        if config.get(key) not in _EMPTY:
            raise AdapterError(f"the adapter in {directory} uses {what}, which Ferry does not serve")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"the adapter in {directory} trains biases (bias={config['bias']!r}): not served")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise AdapterError(f"{directory / CONFIG_FILE} lacks a valid `r` and `lora_alpha`")
    if rank > max_rank:
        raise AdapterError(
            f"the adapter in {directory} has rank {rank}, above --max-lora-rank {max_rank}: start the server with "
            f"--max-lora-rank {rank} or more to serve it"
        )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    modules = _read_modules(directory, hf_config, rank)
    return AdapterSpec(str(directory.resolve()), rank, scaling, modules)


def _read_config(directory: Path) -> dict[str, Any]:
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"no LoRA adapter in {directory}: {CONFIG_FILE} is missing")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise AdapterError(f"{config_path} cannot be read: {error}") from error
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path} is not a JSON object")
    return config


def _read_modules(
    directory: Path, hf_config: Any, rank: int
) -> dict[tuple[int, str], tuple[tuple[int, int], tuple[int, int]]]:
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        found = "adapter_model.bin (a pickle)" if (directory / "adapter_model.bin").is_file() else "nothing"
        raise AdapterError(f"{directory} has no {WEIGHTS_FILE} (found {found}); save the adapter with safetensors")
    if (directory / "added_tokens.json").is_file() or (directory / "new_embeddings.safetensors").is_file():
        raise AdapterError(f"the adapter in {directory} adds tokens to the vocabulary, which Ferry does not serve")
    try:
        shapes = safetensors_shapes(weights)
    except (OSError, ValueError, KeyError, struct.error) as error:
        raise AdapterError(f"{weights} is not a readable safetensors file: {error}") from error
    expected = projection_shapes(hf_config)
    num_layers = hf_config.num_hidden_layers
    halves: dict[tuple[int, str], dict[str, tuple[int, int]]] = {}
    for name, shape in shapes.items():
        match = _TENSOR.match(name)
        if match is None:
            what = "the embedding or LM head" if ("embed" in name or "lm_head" in name) else "a module"
            raise AdapterError(f"the adapter in {directory} adapts {what} Ferry does not adapt: {name}")
        layer, projection, half = int(match[1]), match[3], match[4]
        if projection not in expected:
            raise AdapterError(f"the adapter in {directory} adapts {projection} ({name}); Ferry adapts "
                               f"{', '.join(TARGETS)}")  # fmt: skip
        if layer >= num_layers:
            raise AdapterError(f"the adapter in {directory} adapts layer {layer}; the model has {num_layers}")
        if match[2] == "mlp" and is_sparse_layer(hf_config, layer):
            raise AdapterError(f"the adapter in {directory} adapts {projection} of layer {layer}, whose feed-forward "
                               "is a mixture of experts here (experts take no adapters)")  # fmt: skip
        out_features, in_features = expected[projection]
        want = (rank, in_features) if half == "A" else (out_features, rank)
        if tuple(shape) != want:
            raise AdapterError(
                f"the adapter in {directory} was not trained on this model: {name} is {list(shape)} where this "
                f"model needs {list(want)}"
            )
        halves.setdefault((layer, projection), {})[half] = want
    modules = {}
    for key, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"the adapter in {directory} has only lora_{''.join(pair)} of layer {key[0]} {key[1]}")
        modules[key] = (pair["A"], pair["B"])
    if not modules:
        raise AdapterError(f"the adapter in {directory} adapts no module")
    return modules
