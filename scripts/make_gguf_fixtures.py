"""Make the GGUF test fixtures (tests/fixtures/gguf/) with llama.cpp's own tools: its converter
(convert_hf_to_gguf.py) and `llama-quantize`, from tiny random models of the native families.

The tools do not install beside the project's pins (the converter brings its own gguf package; llama-quantize is
built from source, about ten minutes), so they run from ../shared/peers/install-llama-cpp.sh's folder, and the
files they write are committed (about 2 MB in all). Run once, from the repository root:

    bash ../shared/peers/install-llama-cpp.sh /tmp/llama-cpp
    python scripts/make_gguf_fixtures.py /tmp/llama-cpp

The tests compare Ferry against transformers loading the same file (it dequantizes every type these use).
K-quant types pack rows in blocks of 256 values, so the model
they quantize is 256 wide (and its MLP 512); the others are 64 wide.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.model_factory import build_model_dir

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gguf"

SMALL = dict(num_hidden_layers=2)
# transformers reads a Qwen model's tokenizer as Qwen2Tokenizer, which adds a token past the trained vocabulary: the
# converter wants every id inside the config's vocabulary, so the Qwen models get a few rows to spare.
QWEN = dict(num_hidden_layers=2, vocab_size=392)
WIDE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, tie_word_embeddings=True)

FIXTURES: list[tuple[str, str, dict[str, object], str, str | None]] = [
    # (name, architecture, config overrides, converter outtype, llama-quantize type or None)
    ("llama-f16", "llama", SMALL, "f16", None),
    ("llama-bf16", "llama", SMALL, "bf16", None),
    ("llama-q8_0", "llama", SMALL, "q8_0", None),
    ("llama-q4_0", "llama", SMALL, "f32", "q4_0"),
    ("qwen2-q8_0", "qwen2", QWEN, "q8_0", None),
    ("qwen3-f16", "qwen3", QWEN, "f16", None),
    ("llama-wide-q4_k_m", "llama", WIDE, "f32", "q4_k_m"),
    ("llama-wide-q6_k", "llama", WIDE, "f32", "q6_k"),
]


def main(llama_cpp: Path) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    made: dict[tuple[str, str], Path] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, arch, overrides, outtype, quant in FIXTURES:
            key = (arch, repr(sorted(overrides.items())))
            if key not in made:
                made[key] = build_model_dir(Path(tmp) / f"{arch}-{len(made)}", arch, seed=len(made), **overrides)
            hf_dir = made[key]
            target = OUT / f"{name}.gguf"
            converted = target if quant is None else Path(tmp) / f"{name}-{outtype}.gguf"
            subprocess.run([str(llama_cpp / "convert"), str(hf_dir), str(converted), outtype], check=True)
            if quant is not None:
                quantize = llama_cpp / "bin" / "llama-quantize"
                subprocess.run([str(quantize), str(converted), str(target), quant], check=True)
    for path in sorted(OUT.iterdir()):
        print(path.name, path.stat().st_size)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/llama-cpp"))
