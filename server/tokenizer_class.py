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

import importlib
import logging
import os
from pathlib import Path

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from engine.models.tokenizer import auto_tokenizer, read_tokenizer_config
from engine.records import package_version, read_record, record_path, write_record

logger = logging.getLogger(__name__)

KEYED_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")
"""The files whose bytes AutoTokenizer's choice of class depends on."""
KEYED_PACKAGES = ("transformers", "tokenizers", "sentencepiece", "tiktoken", "mistral_common")
"""The packages whose presence and version AutoTokenizer's choice depends on (Mistral's backend needs
mistral-common; a class is only found where its backend's package is installed)."""


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    """The tokenizer `AutoTokenizer.from_pretrained(model_dir)` loads, through its recorded class when there is
    one."""
    tokenizer_config = read_tokenizer_config(Path(model_dir))
    if "auto_map" in tokenizer_config:
        return auto_tokenizer(model_dir)
    try:
        record = tokenizer_record(model_dir)
    except (OSError, RuntimeError) as exc:  # an unlistable directory; no home directory to find the cache in
        logger.warning("Cannot key a tokenizer-class record for %s (%s): asking AutoTokenizer", model_dir, exc)
        return auto_tokenizer(model_dir)
    tokenizer_class = _recorded_class(record)
    if tokenizer_class is not None:
        # AutoTokenizer's own call, keyword for keyword: a local directory's revision stays None.
        return tokenizer_class.from_pretrained(
            model_dir, _from_auto=True, revision=None, _commit_hash=tokenizer_config.get("_commit_hash")
        )
    tokenizer = auto_tokenizer(model_dir)
    write_record(record, {"module": type(tokenizer).__module__, "name": type(tokenizer).__qualname__})
    return tokenizer


def tokenizer_record(model_dir: str) -> Path:
    """The record of `model_dir`'s tokenizer class, keyed by everything AutoTokenizer's choice reads."""
    directory = Path(model_dir)
    files = ((directory / name).read_bytes() if (directory / name).is_file() else b"absent" for name in KEYED_FILES)
    names = (
        *map(package_version, KEYED_PACKAGES),
        model_dir,
        os.path.abspath(model_dir),
        *sorted(os.listdir(directory)),
    )
    return record_path("tokenizer-classes", (*names, *files))


def _recorded_class(record: Path) -> type[PreTrainedTokenizerBase] | None:
    """The class the record names; None when there is no record or it no longer names a tokenizer class."""
    names = read_record(record)
    if names is None:
        return None
    try:
        # AutoTokenizer's classes (code of a checkpoint's own is never recorded) are transformers': a record
        # naming another module is not imported.
        if not names["module"].startswith("transformers."):
            raise ValueError(f"{names['module']} is not a transformers module")
        tokenizer_class = getattr(importlib.import_module(names["module"]), names["name"])
    except (ValueError, KeyError, TypeError, ImportError, AttributeError) as exc:
        logger.warning("Ignoring the tokenizer-class record %s (%s)", record, exc)
        return None
    if not (isinstance(tokenizer_class, type) and issubclass(tokenizer_class, PreTrainedTokenizerBase)):
        logger.warning("Ignoring the tokenizer-class record %s (not a tokenizer class)", record)
        return None
    return tokenizer_class
