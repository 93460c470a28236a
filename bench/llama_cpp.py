"""llama.cpp as a server of `ferry bench serve --server llama.cpp`: `llama-server` on a GGUF conversion of the same
model directory, at the same precision.

llama.cpp is not a dependency of Ferry: it comes from the folder `../shared/peers/install-llama-cpp.sh` builds
(`--llama-cpp DIR`: `DIR/bin/llama-server`, `DIR/convert`). The model is converted once per model directory and
precision, into `DIR/models/`, named by a hash of the checkpoint's files (a retrained model converts anew). The
server gets one slot per client of the widest concurrency and a context of the longest request for each slot (its
`-c` is split evenly between slots); prompts are token-id lists, which llama-server's /v1/completions takes, with
`ignore_eos` as Ferry and vLLM are asked.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

_OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
QUANTIZED_TYPES = {"int8": "q8_0", "int4": "q4_0"}
"""llama.cpp's type for a Ferry --quantization: Q8_0 (int8 in blocks of 32 with a float16 scale) beside int8,
Q4_0 (4-bit in blocks of 32 with a float16 scale) beside int4. Both quantize llama.cpp's output matrix (Ferry's
head is int8 under either scheme) and its token embedding (Ferry keeps an untied one in the model's dtype)."""


def gguf_type(model_dir: Path) -> str:
    """The converter's `--outtype` for the checkpoint's own precision (config.json's dtype; float32 without one)."""
    config = json.loads((model_dir / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype not in _OUTTYPES:
        raise ValueError(f"no GGUF type for a {dtype} checkpoint (llama.cpp runs {', '.join(_OUTTYPES)} here)")
    return _OUTTYPES[dtype]


def gguf_of(install: Path, model_dir: Path, quantization: str = "none") -> Path:
    """The GGUF conversion of `model_dir` at its own precision, or in llama.cpp's counterpart of `quantization`
    (`QUANTIZED_TYPES`: Q8_0 by the converter, Q4_0 by `llama-quantize` from the full-precision conversion),
    converted now unless it was before."""
    if quantization != "none":
        if quantization not in QUANTIZED_TYPES:
            raise ValueError(f"llama.cpp has no counterpart here for --quantization {quantization}")
        outtype = QUANTIZED_TYPES[quantization]
        if outtype == "q4_0":
            full = gguf_of(install, model_dir)
            target = full.with_name(full.name.replace(f"-{gguf_type(model_dir)}.gguf", "-q4_0.gguf"))
            if not target.exists():
                partial = target.with_suffix(".partial")
                quantize = [str(install / "bin" / "llama-quantize"), str(full), str(partial), "q4_0"]
                subprocess.run(quantize, check=True, capture_output=True)
                partial.rename(target)
            return target
    else:
        outtype = gguf_type(model_dir)
    digest = hashlib.sha256()
    for file in sorted(p for p in model_dir.iterdir() if p.is_file()):
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    target = install / "models" / f"{model_dir.name}-{digest.hexdigest()[:12]}-{outtype}.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        subprocess.run([str(install / "convert"), str(model_dir), str(partial), outtype], check=True)
        partial.rename(target)
    return target


def llama_server_command(
    install: Path, gguf: Path, port: int, *, slots: int, context_per_slot: int, extra: Sequence[str] = ()
) -> list[str]:
    """`llama-server` on `gguf` at 127.0.0.1:`port`; `extra` last (e.g. `-t 2`), so it can override the rest."""
    return [
        str(install / "bin" / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(slots), "-c", str(slots * context_per_slot), "--log-disable", *extra,
    ]  # fmt: skip
