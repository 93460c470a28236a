"""Where a model's files are: a local directory, a GGUF file (turned into one), or a Hugging Face Hub repository
resolved to one snapshot of the local Hugging Face cache, downloaded into it when the Hub can be reached (as vLLM
does with `--model org/name`).

The front end resolves once and hands the engine process the snapshot's path, so the engine and the tokenizer read
the same commit. Only what Ferry reads is fetched: config, tokenizer and chat-template files, then the weights: the
shards the safetensors index lists, or every `*.safetensors` file when there is no index.
"""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id

from engine.models.checkpoint import checkpoint_files, indexed_shards
from engine.models.gguf import GGUFError, is_gguf, materialize
from engine.records import ferry_cache_dir

METADATA_PATTERNS = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
"""Config, generation config, tokenizer and chat-template files: everything but the weights."""


class ModelSourceError(ValueError):
    """The model (or tokenizer) named cannot be found or fetched; the message says why."""


def is_hub_id(spec: str) -> bool:
    """Whether `spec` names a Hub repository rather than a local directory (a path that exists is local)."""
    if Path(spec).expanduser().exists():
        return False
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def default_served_name(spec: str) -> str:
    """The name clients send as `model` when none is given: a Hub id as written, or the directory's name."""
    return spec if is_hub_id(spec) else Path(spec).expanduser().resolve().name


def resolve(
    spec: str,
    *,
    flag: str,
    revision: str | None,
    download_dir: str | None,
    offline: bool,
    weights: bool,
) -> Path:
    """The local directory of `spec`: itself when it is a directory, the directory made from it when it is a GGUF
    file (engine/models/gguf.py: under `download_dir`, else the Ferry cache), else its Hub snapshot (with the
    weights when `weights`); `flag` names the option it came from, for messages."""
    if is_gguf(spec):
        if revision is not None:
            raise ModelSourceError(f"{flag} {spec} is a local file: a revision applies to Hub ids only")
        try:
            return materialize(Path(spec), Path(download_dir) if download_dir else ferry_cache_dir())
        except GGUFError as exc:
            raise ModelSourceError(f"{flag} {exc}") from exc
    if not is_hub_id(spec):
        path = Path(spec).expanduser()
        if not path.is_dir() or (weights and not (path / "config.json").is_file()):
            raise ModelSourceError(
                f"{flag} {spec}: not a model directory (no config.json), nor a Hugging Face Hub id (org/name)"
            )
        if revision is not None:
            raise ModelSourceError(f"{flag} {spec} is a local directory: a revision applies to Hub ids only")
        return path
    try:
        snapshot = Path(_snapshot(spec, revision, download_dir, offline, METADATA_PATTERNS))
        if weights:
            # The snapshot's directory is named by its commit: the weights come from that same commit.
            _snapshot(spec, snapshot.name, download_dir, offline, _weight_patterns(snapshot))
    except LocalEntryNotFoundError as exc:
        where = download_dir or huggingface_hub.constants.HF_HUB_CACHE
        why = "HF_HUB_OFFLINE=1 forbids downloading it" if offline else f"the Hub could not be reached ({exc})"
        raise ModelSourceError(
            f"{flag} {spec}: revision {revision or 'main'} is not in the Hugging Face cache ({where}), and {why}"
        ) from exc
    except (OSError, ValueError) as exc:  # the Hub's HTTP errors (no such repo, revision, access) are OSErrors
        raise ModelSourceError(f"{flag} {spec}: {exc}") from exc
    if weights:
        if not (snapshot / "config.json").is_file():
            raise ModelSourceError(f"{flag} {spec}: the repository has no config.json, so it is not a model")
        try:
            checkpoint_files(str(snapshot))
        except FileNotFoundError as exc:
            raise ModelSourceError(f"{flag} {spec}: the cached snapshot is incomplete: {exc}") from exc
    return snapshot


def _weight_patterns(snapshot: Path) -> list[str]:
    shards = indexed_shards(str(snapshot))
    return ["*.safetensors"] if shards is None else sorted(shards)


def _snapshot(repo_id: str, revision: str | None, cache_dir: str | None, offline: bool, patterns: list[str]) -> str:
    return huggingface_hub.snapshot_download(
        repo_id, revision=revision, cache_dir=cache_dir, local_files_only=offline, allow_patterns=patterns
    )
