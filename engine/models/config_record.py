"""A model directory's transformers config, remembered from one start to the next.

`AutoConfig` imports transformers (~1 s of an engine's start on this project's 2-core machines) and the model's
configuration class, whose validators import transformers' model-loading machinery and torch's distributed tensors
(~0.5 s more), for a config whose values come from one small JSON file. So the first start asks `AutoConfig` and
records every value the config it returned answers for; a later start with the same config.json, at the same path,
under the same transformers, rebuilds it from the record as a `RecordedConfig` without importing transformers.

A `RecordedConfig` holds values, not behaviour: every attribute the original had (its fields, its class's attributes,
the base class's properties, evaluated when recorded), its aliases (`attribute_map`), and the one method
transformers' rope functions call on a config, `standardize_rope_params`, which the recorded values have been
through already. Recorded are only the configs a record holds exactly: a class of transformers' own (code of a
checkpoint's own is never recorded), no nested configs (an image model's), one config for every layer, and values of
plain JSON types and torch dtypes.

A checkpoint whose config.json names configuration code of its own (`auto_map`) for a model type transformers does
not know is read through transformers' class of the family that code is a copy of, where there is one
(`CONFIG_TWINS`); Ferry runs no checkpoint code (engine/models/support.py refuses the rest by name).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.records import package_version, read_record, record_path, write_record

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

_FORMAT = "2"
"""Bumped when the record's layout changes: a new layout is a new key."""

_DEPRECATED = {"torch_dtype": "dtype", "use_return_dict": "return_dict"}
"""The base class's deprecated names of other attributes: aliases here, not values (reading them logs a warning)."""

CONFIG_TWINS = {"kimi_k2": "deepseek_v3"}
"""Model types whose checkpoints ship configuration code of their own that is a copy of a transformers family's
config class -> that family: Kimi K2's `configuration_deepseek.DeepseekV3Config` is DeepSeek V3's own (its config.json
names `DeepseekV3ForCausalLM`, whose modules run it)."""

_VIEWS = frozenset({"per_layer_config"})
"""Base-class properties that make a new view of the config on each read, rather than hold a value."""


class RecordedConfig:
    """A transformers config rebuilt from its record (see the module's docstring)."""

    def __init__(self, values: dict[str, Any], causal_lm_class: bool) -> None:
        vars(self).update(values)
        self.transformers_has_causal_lm = causal_lm_class
        """Whether transformers has a causal LM class for this model type (engine/models/support.py asks)."""

    def __getattr__(self, name: str) -> Any:
        # Reached only for names that are not set: the aliases.
        target = vars(self).get("attribute_map", {}).get(name) or _DEPRECATED.get(name)
        if target is None:
            raise AttributeError(f"the recorded {vars(self).get('model_type')!r} config has no attribute {name!r}")
        return getattr(self, target)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, vars(self).get("attribute_map", {}).get(name, name), value)

    def standardize_rope_params(self) -> None:
        """transformers' rope functions call this on the config first; the recorded `rope_parameters` are the
        standardized ones (checked when recorded)."""


def load_config(model_dir: str) -> PretrainedConfig | RecordedConfig:
    """What `AutoConfig.from_pretrained(model_dir)` returns, or its recorded copy."""
    try:
        record = config_record(model_dir)
    except (OSError, RuntimeError) as exc:  # an unreadable config.json; no home directory to find the cache in
        logger.warning("Cannot key a config record for %s (%s): asking AutoConfig", model_dir, exc)
        return _auto_config(model_dir)
    recorded = _recorded(record)
    if recorded is not None:
        return recorded
    config = _auto_config(model_dir)
    entry = _entry(config)
    if entry is not None:
        write_record(record, entry)
    return config


def transformers_config(config: PretrainedConfig | RecordedConfig, model_dir: str) -> PretrainedConfig:
    """`config` as an instance of transformers' own class, for the paths that hand it to transformers' model classes
    (the fallback, encoders), which take nothing else: a recorded config is read again through `AutoConfig` (those
    paths import transformers' modelling anyway), with the changes the engine made to it (`architectures`)."""
    if not isinstance(config, RecordedConfig):
        return config
    original = _auto_config(model_dir)
    original.architectures = config.architectures
    return original


def config_record(model_dir: str) -> Path:
    """The record of `model_dir`'s config: keyed by config.json's bytes, the directory as named (the config's
    `_name_or_path`) and transformers' version."""
    config_json = (Path(model_dir) / "config.json").read_bytes()
    return record_path("configs", (_FORMAT, package_version("transformers"), model_dir, config_json))


def _auto_config(model_dir: str) -> PretrainedConfig:
    from transformers import AutoConfig

    with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
        model_type = json.load(f).get("model_type")
    twin = CONFIG_TWINS.get(model_type)
    if twin is None:
        return AutoConfig.from_pretrained(model_dir)
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[twin]
    values, options = config_class.get_config_dict(model_dir)
    logger.info("model_type %r is read as %r (its configuration code is %s's)", model_type, twin, twin)
    # Without its own type and code map, the config is the twin's as transformers would save it.
    values = {name: value for name, value in values.items() if name not in ("model_type", "auto_map")}
    return config_class.from_dict(values, **options)


def _recorded(record: Path) -> RecordedConfig | None:
    entry = read_record(record)
    if entry is None:
        return None
    try:
        return RecordedConfig(_decode(entry["values"]), bool(entry["causal_lm_class"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        logger.warning("Ignoring the config record %s (%s)", record, exc)
        return None


def _entry(config: PretrainedConfig) -> dict[str, Any] | None:
    """The record of `config`, or None where a record could not rebuild it exactly."""
    from transformers import PretrainedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not type(config).__module__.startswith("transformers.models.") or config.is_heterogeneous:
        return None
    rope = getattr(config, "rope_parameters", None)
    if rope:
        standardized = copy.deepcopy(config)
        standardized.standardize_rope_params()
        if standardized.rope_parameters != rope:
            return None
    values = {}
    for name in dir(config):
        if name.startswith("__") or name in _DEPRECATED or name in _VIEWS:
            continue
        try:
            value = getattr(config, name)
        except AttributeError:  # a property of what the config lacks (`rope_scaling` without rope): so does the copy
            continue
        if isinstance(value, PretrainedConfig):
            return None
        if not callable(value):
            values[name] = value
    try:
        entry = {
            "values": _encode(values),
            "causal_lm_class": config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        }
    except _Unrecordable:
        return None
    rebuilt = RecordedConfig(_decode(entry["values"]), entry["causal_lm_class"])
    if any(getattr(rebuilt, name) != getattr(config, name) for name in (*values, *config.attribute_map)):
        return None
    return entry


class _Unrecordable(TypeError):
    pass


def _encode(value: Any) -> Any:
    """`value` as JSON whose decoding gives back the same types: containers and dtypes tagged, dict keys kept."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if type(value) in (list, tuple, set, frozenset):
        return {type(value).__name__: [_encode(item) for item in value]}
    if type(value) is dict:
        return {"dict": [[_encode(key), _encode(item)] for key, item in value.items()]}
    raise _Unrecordable(type(value).__name__)


def _decode(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    ((tag, content),) = value.items()
    if tag == "dtype":
        dtype = getattr(torch, content)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{content!r} is not a torch dtype")
        return dtype
    if tag == "list":
        return [_decode(item) for item in content]
    if tag in ("tuple", "set", "frozenset"):
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](_decode(item) for item in content)
    if tag == "dict":
        return {_decode(key): _decode(item) for key, item in content}
    raise ValueError(f"unknown tag {tag!r}")
