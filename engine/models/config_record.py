"""A model directory's transformers config, remembered from one start to the next.

`AutoConfig` imports the model's configuration class, and transformers 5's classes import their validators, which
import its activations and through them its model-loading machinery and torch's distributed tensors: ~0.5 s of an
engine's ~3 s start on the demo model, for a config whose values come from one small JSON file. So the first start
asks `AutoConfig` and records what the config it returned holds (every attribute, and the class's attribute aliases);
a later start with the same config.json, at the same path, under the same transformers, rebuilds it from the record
as a `RecordedConfig` without importing the class.

Recorded are only the configs a record can hold exactly: a class of transformers' own (code of a checkpoint's own
is never recorded) whose only behaviour beyond its fields is validation (no properties computed from them: the
Mamba and Jamba families' `layer_types`), with no nested configs (an image model's), and values of plain JSON types
and torch dtypes. The rebuilt config is compared with the original before the record is written.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers.configuration_utils import PreTrainedConfig

from engine.records import package_version, read_record, record_path, write_record

logger = logging.getLogger(__name__)

_FORMAT = "1"
"""Bumped when the record's layout changes: a new layout is a new key."""


class RecordedConfig(PreTrainedConfig):
    """A transformers config rebuilt from a record: the original's instance attributes and its class's (`model_type`,
    `attribute_map`, ...), on the base class (its properties: `num_labels`, `output_attentions`, ...)."""

    @classmethod
    def rebuild(cls, class_attributes: dict[str, Any], state: dict[str, Any]) -> RecordedConfig:
        config = cls.__new__(cls)
        # The original's instance dictionary as it was: no __init__ (it would validate and set defaults again) and
        # no __setattr__ (it would follow aliases). The base class reads `attribute_map` through the instance.
        vars(config).update(class_attributes, **state)
        return config


def load_config(model_dir: str) -> PreTrainedConfig:
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


def config_record(model_dir: str) -> Path:
    """The record of `model_dir`'s config: keyed by config.json's bytes, the directory as named (the config's
    `_name_or_path`) and transformers' version."""
    config_json = (Path(model_dir) / "config.json").read_bytes()
    return record_path("configs", (_FORMAT, package_version("transformers"), model_dir, config_json))


def _auto_config(model_dir: str) -> PreTrainedConfig:
    from transformers import AutoConfig  # its lazy import table; the class it picks imports what is said above

    return AutoConfig.from_pretrained(model_dir)


def _recorded(record: Path) -> RecordedConfig | None:
    entry = read_record(record)
    if entry is None:
        return None
    try:
        return RecordedConfig.rebuild(_decode(entry["class_attributes"]), _decode(entry["state"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        logger.warning("Ignoring the config record %s (%s)", record, exc)
        return None


def _entry(config: PreTrainedConfig) -> dict[str, Any] | None:
    """The record of `config`, or None where a record could not rebuild it exactly."""
    cls = type(config)
    # What the class adds to the base: values (`model_type`, `attribute_map`, field defaults) and behaviour.
    added = {
        name: value
        for klass in cls.__mro__[: cls.__mro__.index(PreTrainedConfig)]
        for name, value in vars(klass).items()
        if not name.startswith("__")
    }
    behaviour = [
        name
        for name, value in added.items()
        if isinstance(value, property) or (callable(value) and not name.startswith("validate"))
    ]
    state = dict(vars(config))
    if (
        not cls.__module__.startswith("transformers.models.")
        or behaviour
        or any(isinstance(value, PreTrainedConfig) for value in state.values())
    ):
        return None
    class_attributes = {
        name: value for name, value in added.items() if name not in state and not name.startswith("validate")
    }
    try:
        entry = {"class_attributes": _encode(class_attributes), "state": _encode(state)}
    except _Unrecordable:
        return None
    rebuilt = RecordedConfig.rebuild(_decode(entry["class_attributes"]), _decode(entry["state"]))
    if any(getattr(rebuilt, name) != getattr(config, name) for name in (*state, *class_attributes, *cls.attribute_map)):
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
    if type(value) in (list, tuple):
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
    if tag == "tuple":
        return tuple(_decode(item) for item in content)
    if tag == "dict":
        return {_decode(key): _decode(item) for key, item in content}
    raise ValueError(f"unknown tag {tag!r}")
