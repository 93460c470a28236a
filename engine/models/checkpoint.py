"""Which files, and which tensors in them, make a safetensors checkpoint (torch-free: the front end reads it too,
to fetch exactly those files from the Hub)."""

from __future__ import annotations

import glob
import json
import os

SAFETENSORS_INDEX = "model.safetensors.index.json"


def indexed_shards(model_dir: str) -> dict[str, list[str]] | None:
    """Shard file name -> the tensors the index puts in it, or None when the checkpoint has no index."""
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if not os.path.isfile(index_path):
        return None
    with open(index_path) as f:
        weight_map: dict[str, str] = json.load(f)["weight_map"]
    shards: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        shards.setdefault(file, []).append(name)
    return shards


def checkpoint_files(model_dir: str) -> dict[str, list[str] | None]:
    """Each safetensors file to read, with the tensor names to read from it (None: all of them).

    With an index (`model.safetensors.index.json`, what sharded checkpoints carry) exactly the files and tensors
    it lists: a repository may hold other safetensors beside the shards (Mistral's `consolidated.safetensors`
    repeats every weight under other names). Without one, every `*.safetensors` file in the directory.
    """
    shards = indexed_shards(model_dir)
    if shards is not None:
        missing = sorted(file for file in shards if not os.path.isfile(os.path.join(model_dir, file)))
        if missing:
            raise FileNotFoundError(
                f"{SAFETENSORS_INDEX} lists shards that are not in {model_dir}: {', '.join(missing)}"
            )
        return {os.path.join(model_dir, file): names for file, names in shards.items()}
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (use load_format='dummy' for random ones)")
    return dict.fromkeys(files)
