"""Which tokenizer class a model directory loads with, remembered from one start to the next.

`AutoTokenizer` picks the class from the model's config: it imports transformers' config classes, and through them
torch (`transformers.configuration_utils`) and torch's distributed tensors (`LlamaConfig`'s validators), which cost a
front end that needs neither 1.7-2.2 s of its start on the demo model; the class it then calls loads the files in
10 ms. So the first start asks `AutoTokenizer` and writes down the class it returned; a later start with the same
files, the same directory and the same transformers calls that class the way `AutoTokenizer` does. A record that
cannot be read or written only sends the start back to `AutoTokenizer`.

The record's key covers everything `AutoTokenizer`'s choice reads: the directory (its path is matched against
checkpoint names), its file names (Mistral's files select another backend), config.json, tokenizer_config.json and
tokenizer.json (a ByteLevel pre-tokenizer overrides a declared LlamaTokenizer), and the versions of transformers and
of the tokenizer backends' packages.
A tokenizer with its own code (`auto_map`) is never recorded: its class comes from the checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from server.model_source import ferry_cache_dir

logger = logging.getLogger(__name__)

KEYED_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")
"""The files whose bytes AutoTokenizer's choice of class depends on."""
KEYED_PACKAGES = ("transformers", "tokenizers", "sentencepiece", "tiktoken", "mistral_common")
"""The packages whose presence and version AutoTokenizer's choice depends on (Mistral's backend needs
mistral-common; a class is only found where its backend's package is installed)."""


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    """The tokenizer `AutoTokenizer.from_pretrained(model_dir)` loads, through its recorded class when there is
    one."""
    tokenizer_config = _read_json(Path(model_dir) / "tokenizer_config.json")
    if "auto_map" in tokenizer_config:
        return _auto_tokenizer(model_dir)
    try:
        record = records_dir() / f"{record_key(model_dir)}.json"
    except (OSError, RuntimeError) as exc:  # an unlistable directory; no home directory to find the cache in
        logger.warning("Cannot key a tokenizer-class record for %s (%s): asking AutoTokenizer", model_dir, exc)
        return _auto_tokenizer(model_dir)
    tokenizer_class = _recorded_class(record)
    if tokenizer_class is not None:
        # AutoTokenizer's own call, keyword for keyword: a local directory's revision stays None.
        return tokenizer_class.from_pretrained(
            model_dir, _from_auto=True, revision=None, _commit_hash=tokenizer_config.get("_commit_hash")
        )
    tokenizer = _auto_tokenizer(model_dir)
    _write_record(record, type(tokenizer))
    return tokenizer


def records_dir() -> Path:
    return ferry_cache_dir() / "tokenizer-classes"


def record_key(model_dir: str) -> str:
    digest = hashlib.sha256()
    directory = Path(model_dir)
    for part in (*map(_version, KEYED_PACKAGES), model_dir, os.path.abspath(model_dir), *sorted(os.listdir(directory))):
        digest.update(part.encode() + b"\0")
    for name in KEYED_FILES:
        path = directory / name
        digest.update(path.read_bytes() if path.is_file() else b"absent")
        digest.update(b"\0")
    return digest.hexdigest()


def _version(package: str) -> str:
    try:
        return f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{package} absent"


def _auto_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    # Imported here: transformers' auto classes import torch (see the module's docstring).
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _recorded_class(record: Path) -> type[PreTrainedTokenizerBase] | None:
    """The class the record names; None when there is no record or it no longer names a tokenizer class."""
    try:
        names = json.loads(record.read_text(encoding="utf-8"))
        # AutoTokenizer's classes (code of a checkpoint's own is never recorded) are transformers': a record
        # naming another module is not imported.
        if not names["module"].startswith("transformers."):
            raise ValueError(f"{names['module']} is not a transformers module")
        tokenizer_class = getattr(importlib.import_module(names["module"]), names["name"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError) as exc:
        logger.warning("Ignoring the tokenizer-class record %s (%s)", record, exc)
        return None
    if not (isinstance(tokenizer_class, type) and issubclass(tokenizer_class, PreTrainedTokenizerBase)):
        logger.warning("Ignoring the tokenizer-class record %s (not a tokenizer class)", record)
        return None
    return tokenizer_class


def _write_record(record: Path, tokenizer_class: type[Any]) -> None:
    """Written whole or not at all (a temporary file moved into place), since another server may read it; a cache
    that cannot be written costs the next start its speed, nothing else."""
    names = {"module": tokenizer_class.__module__, "name": tokenizer_class.__qualname__}
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=record.parent, suffix=".tmp")
    except OSError as exc:
        logger.warning("Cannot record the tokenizer class in %s (%s)", record.parent, exc)
        return
    try:
        os.fchmod(descriptor, 0o644)  # mkstemp's 0600 would keep the record from a cache's other users
        with os.fdopen(descriptor, "w", encoding="utf-8") as f:
            json.dump(names, f)
        os.replace(temporary, record)
    except OSError as exc:
        logger.warning("Cannot record the tokenizer class in %s (%s)", record, exc)
        with contextlib.suppress(OSError):
            os.unlink(temporary)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        return {}
    return value if isinstance(value, dict) else {}
