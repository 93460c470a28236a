"""--model and --tokenizer: local directories, and Hub ids resolved through a Hugging Face cache laid out on disk
(offline: nothing here reaches the network)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from server.model_source import ModelSourceError, default_served_name, is_hub_id, resolve
from tests.hub_cache import add_snapshot

MAIN = "a" * 40
V2 = "b" * 40


@pytest.fixture(scope="module")
def cache(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """org/tiny at two commits (main, and the tag v2), and org/sharded: the same model in shards with an index."""
    root = tmp_path_factory.mktemp("hf-cache")
    add_snapshot(root, "org/tiny", tiny_llama, MAIN)
    add_snapshot(root, "org/tiny", tiny_llama, V2, refs=("v2",))
    sharded = tmp_path_factory.mktemp("sharded")
    shutil.copytree(tiny_llama, sharded, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)
    AutoModelForCausalLM.from_pretrained(tiny_llama).save_pretrained(sharded, max_shard_size="40KB")
    add_snapshot(root, "org/sharded", sharded, MAIN)
    return root


def hub(spec: str, cache: Path, revision: str | None = None, weights: bool = True) -> Path:
    return resolve(spec, flag="--model", revision=revision, download_dir=str(cache), offline=True, weights=weights)


def test_a_hub_id_resolves_to_its_snapshot_in_the_cache(cache: Path) -> None:
    assert hub("org/tiny", cache).name == MAIN
    assert hub("org/tiny", cache, revision="v2").name == V2, "a tag"
    assert hub("org/tiny", cache, revision=V2).name == V2, "a commit"
    assert (hub("org/tiny", cache) / "config.json").is_file()
    assert hub("org/sharded", cache).name == MAIN


def test_a_model_missing_offline_is_a_clear_error(cache: Path) -> None:
    with pytest.raises(ModelSourceError) as info:
        hub("org/absent", cache)
    assert "--model org/absent" in str(info.value) and "HF_HUB_OFFLINE=1" in str(info.value)
    with pytest.raises(ModelSourceError, match="revision v9 is not in the Hugging Face cache"):
        hub("org/tiny", cache, revision="v9")


def test_an_incomplete_snapshot_is_refused_before_the_engine_starts(cache: Path, tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    shutil.copytree(hub("org/sharded", cache), partial, symlinks=False)
    next(partial.glob("model-0000*.safetensors")).unlink()
    add_snapshot(cache, "org/partial", partial, MAIN)
    with pytest.raises(ModelSourceError, match="incomplete"):
        hub("org/partial", cache)
    assert hub("org/partial", cache, weights=False).name == MAIN, "a tokenizer needs no weights"


def test_local_directories_stay_local(tiny_llama: Path, tmp_path: Path) -> None:
    assert resolve(str(tiny_llama), flag="--model", revision=None, download_dir=None, offline=True, weights=True) == (
        tiny_llama
    )
    assert not is_hub_id(str(tiny_llama)) and is_hub_id("org/name") and is_hub_id("gpt2")
    assert default_served_name(str(tiny_llama)) == tiny_llama.name
    assert default_served_name("org/name") == "org/name"
    with pytest.raises(ModelSourceError, match="a revision applies to Hub ids only"):
        resolve(str(tiny_llama), flag="--model", revision="v2", download_dir=None, offline=True, weights=True)
    with pytest.raises(ModelSourceError, match="not a model directory"):
        resolve(str(tmp_path), flag="--model", revision=None, download_dir=None, offline=True, weights=True)
