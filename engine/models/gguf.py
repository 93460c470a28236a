"""GGUF files (llama.cpp's format; what llama.cpp and Ollama users download) as Ferry model directories.

`--model model.gguf` is turned once into a directory of the files the rest of Ferry reads (`materialize`):
config.json, generation_config.json and the tokenizer with its chat template, all from the file's metadata
(transformers' GGUF readers), and `gguf.json`, which names the file. The weights stay in the file: the loader reads
them from it one tensor at a time (`gguf_tensors`), under the checkpoint names the native modules load, each
dequantized to float32 as it is read and converted to the model's dtype as it is copied into its parameter; a
file whose linears are all Q4_0 or all Q8_0 runs them on the int4 or grouped int8 kernel with its own codes, and a
Q8_0 LM head too (`kept_types`, engine/quantization/gguf.py).

llama.cpp's converter reorders the rows of a Llama model's Q and K projections (its rotary pairs adjacent rows
where transformers pairs the two halves of a head); they are put back as they were. Qwen2 and Qwen3 files are
written unpermuted. Other architectures are refused by name.

The front end imports this module (torch-free until a tensor is read).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SOURCE_FILE = "gguf.json"
"""In a materialized directory: which GGUF file holds the weights."""

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
"""GGUF `general.architecture` -> the transformers architecture whose native modules run it."""

DENSE_TYPES = ("F32", "F16", "BF16")
LAYOUT = 4
"""What a materialized directory holds; a new value makes every file's directory again."""

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_MODEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_LINEAR_WEIGHTS = tuple(
    f".{name}.weight" for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
)
"""The decoder's linears (what a `--quantization` method takes), by their GGUF names' ends."""
KEPT_TYPES = ("Q4_0", "Q8_0")
"""The types whose linears keep the file's codes: Q4_0 on the int4 kernel, Q8_0 on the grouped int8 one
(engine/quantization/gguf.py)."""
BLOCK = 32
"""Inputs a Q4_0 or Q8_0 block (one scale) covers: the groups its linears run in."""


class GGUFError(ValueError):
    """A GGUF file Ferry cannot serve; the message names the file and why."""


def is_gguf(spec: str) -> bool:
    return spec.endswith(".gguf") and Path(spec).expanduser().is_file()


def checkpoint_name(gguf_name: str) -> str | None:
    """The transformers checkpoint name of a GGUF tensor (None: one Ferry does not read, such as rotary tables)."""
    if gguf_name in _MODEL_NAMES:
        return _MODEL_NAMES[gguf_name]
    match = _LAYER.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def _reader(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # a truncated or foreign file: numpy and struct errors, not ours to list
        raise GGUFError(f"{path}: not a GGUF file Ferry can read ({exc})") from exc


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def materialize(path: Path, cache_dir: Path) -> Path:
    """The model directory of the GGUF file `path`, made under `cache_dir` the first time (keyed by the file's
    path, size and modification time, so a changed file is read again); raises GGUFError for a file Ferry cannot
    serve. Logs a warning naming the quantized types it dequantizes as they load."""
    path = path.expanduser().resolve()
    stat = path.stat()
    identity = f"{LAYOUT}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    directory = cache_dir / "gguf" / f"{path.stem}-{key}"
    reader = _reader(path)
    architecture = _field(reader, "general.architecture")
    if architecture not in ARCHITECTURES:
        raise GGUFError(
            f"{path.name}: a GGUF file of architecture {architecture!r}; Ferry reads GGUF files of "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    linear_types = {tensor.tensor_type.name for tensor in reader.tensors if tensor.name.endswith(_LINEAR_WEIGHTS)}
    tensor_types = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    head_type = tensor_types.get("output.weight", tensor_types.get("token_embd.weight"))
    kept = _kept(linear_types, head_type)
    dequantized = Counter(
        kind
        for name, kind in tensor_types.items()
        if kind not in DENSE_TYPES and not _keeps(name, kind, kept, tied="output.weight" not in tensor_types)
    )
    if dequantized:
        listed = ", ".join(f"{name} ({count} tensors)" for name, count in sorted(dequantized.items()))
        logger.warning(
            "%s: %s dequantized as they load (Ferry's kernels read Q4_0 and Q8_0 linears and a Q8_0 LM head as "
            "stored; an untied embedding's rows are looked up in the model's dtype)",
            path.name,
            listed,
        )
    if (directory / SOURCE_FILE).is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        _write_directory(path, reader, architecture, types, linear_types, head_type, dequantized, staging)
        try:
            os.rename(staging, directory)
        except OSError:  # another process made it first: theirs is the same
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def _kept(linear_types: set[str], head_type: str | None) -> list[str]:
    """The types the file's linears (and LM head) run on as they are stored."""
    kept = sorted(linear_types) if len(linear_types) == 1 and linear_types <= set(KEPT_TYPES) else []
    if head_type == "Q8_0" and kept and head_type not in kept:
        kept.append(head_type)
    return kept


def _keeps(name: str, kind: str, kept: list[str], tied: bool) -> bool:
    """Whether tensor `name` of type `kind` runs on its codes: a kept linear, or the kept head (a tied embedding
    reads its rows from the head)."""
    head = name == "output.weight" or (tied and name == "token_embd.weight")
    return kind in kept and (name.endswith(_LINEAR_WEIGHTS) or (head and kind == "Q8_0"))


def _write_directory(
    path: Path,
    reader: Any,
    architecture: str,
    types: Counter[str],
    linear_types: set[str],
    head_type: str | None,
    dequantized: Counter[str],
    directory: Path,
) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # transformers' GGUF readers raise whatever their parsing meets
        raise GGUFError(f"{path.name}: its config could not be read ({exc})") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:
        # The weights still serve, with another tokenizer (`has_tokenizer`: `ferry serve` asks for --tokenizer).
        logger.warning("%s: its tokenizer could not be read (%r): serve it with --tokenizer", path.name, exc)
        tokenizer = None
    config.architectures = [ARCHITECTURES[architecture]]
    # transformers' GGUF reader leaves head_dim at the config class's default (Qwen3's 128) whatever the file says.
    head_dim = _field(reader, f"{architecture}.attention.key_length")
    if head_dim is not None:
        config.head_dim = int(head_dim)
    # Stored in one dense dtype: load in it (the loader's `auto`); quantized types dequantize to float32.
    dense = {name for name in types if name in DENSE_TYPES and name != "F32"}
    if dense == {"BF16"} and set(types) <= {"BF16", "F32"}:
        config.dtype = "bfloat16"
    config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(directory)
    stat = path.stat()
    source = {
        "file": str(path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "architecture": architecture,
        "tensor_types": dict(sorted(types.items())),
        "linear_types": sorted(linear_types),
        "head_type": head_type,
        "kept_types": _kept(linear_types, head_type),
        "dequantized_types": sorted(dequantized),
        "tokenizer": tokenizer is not None,
    }
    (directory / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def source_info(model_dir: str) -> dict[str, Any] | None:
    """What a materialized directory says of its GGUF file (file, size, mtime_ns, architecture, tensor_types: the
    number of tensors of each type, linear_types and head_type, kept_types and dequantized_types: the types some of
    whose tensors run on their codes or are dequantized as they load, where the codes are kept); None for any other
    directory."""
    marker = Path(model_dir) / SOURCE_FILE
    return json.loads(marker.read_text()) if marker.is_file() else None


def has_tokenizer(model_dir: str) -> bool:
    """False for a directory made from a GGUF file whose tokenizer could not be read (it needs --tokenizer)."""
    source = source_info(model_dir)
    return source is None or bool(source.get("tokenizer", True))


def kept_types(model_dir: str) -> tuple[str | None, str | None]:
    """(the type every decoder linear of the directory's GGUF file keeps its codes in, that of its LM head), each
    None where it is dequantized as it loads: linears all Q4_0 or all Q8_0 keep theirs, and then a Q8_0 head too
    (engine/quantization/gguf.py)."""
    source = source_info(model_dir)
    if source is None:
        return None, None
    kept = source["kept_types"]
    if not kept:
        return None, None
    (linear_type,) = source["linear_types"]  # kept only where every linear is of one type
    return linear_type, source["head_type"] if source["head_type"] in kept else None


def source_file(model_dir: str) -> Path | None:
    """The GGUF file a materialized directory's weights are in (None: not such a directory); raises GGUFError when
    the file changed or went since the directory was made."""
    source = source_info(model_dir)
    if source is None:
        return None
    path = Path(source["file"])
    if not path.is_file():
        raise GGUFError(f"{path}: the GGUF file {model_dir} was made from is gone")
    stat = path.stat()
    if (stat.st_size, stat.st_mtime_ns) != (source["size"], source["mtime_ns"]):
        raise GGUFError(f"{path}: the GGUF file changed since {model_dir} was made from it; pass the file again")
    return path


def gguf_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors under their transformers checkpoint names, one at a time, dequantized to float32 (a
    Llama file's Q and K rows back in transformers' order)."""
    import numpy as np
    import torch
    from gguf import quants

    reader = _reader(path)
    architecture = _field(reader, "general.architecture")
    heads = _field(reader, f"{architecture}.attention.head_count")
    kv_heads = _field(reader, f"{architecture}.attention.head_count_kv") or heads
    for tensor in reader.tensors:
        name = checkpoint_name(tensor.name)
        if name is None:
            continue
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists dimensions innermost first
        values = np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        weight = torch.from_numpy(values if values.flags.writeable else values.copy())  # (F32: the file's map)
        if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = _unpermute(weight, heads if "q_proj" in name else kv_heads)
        yield name, weight


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo the converter's row order for rotary pairs: per head, its rows were interleaved from the two halves
    (`reshape(heads, 2, d/2, ...).swapaxes(1, 2)`)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
