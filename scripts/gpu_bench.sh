#!/usr/bin/env bash
# One prepared GPU run for an H200 machine with no network, in under 10 minutes (12 with the TP step):
#   1. the GPU tests (pytest -m gpu);
#   2. a float32 greedy-equality check of Ferry against transformers on the GPU (Qwen3-0.6B shape, strict);
#   3. the offline benchmark, bfloat16, Qwen3-0.6B-shaped (static, transformers' continuous batching, Ferry);
#   4. the offline benchmark, bfloat16, Qwen3-4B-shaped (transformers' continuous batching, Ferry);
#   5. on a machine with more than one GPU: tensor parallelism, the TP=2 engine step against TP=1 (NCCL).
# Models are named configs with random weights built locally; nothing is downloaded.
# Usage: scripts/gpu_bench.sh OUTDIR    (JSON results, logs and the timeline PNG land in OUTDIR)
# Exit status: 0 when every step passed, 1 when one failed or hit its time limit (the others still run).
set -uo pipefail

OUT=${1:?usage: scripts/gpu_bench.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python}
status=0

# Each step has its own time limit so that one slow step cannot push the whole run past 10 minutes.
step() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start))s"
    [ "$rc" -eq 0 ] || status=1
}

{ nvidia-smi || true; "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"; } > "$OUT/machine.txt" 2>&1
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || { echo "no CUDA device"; exit 2; }

# Upstream flash-attn reads paged K/V only in pages of 256 tokens: give Ferry pages it can use when it is there.
if "$PY" -c "import flash_attn" 2>/dev/null; then PAGE=256; else PAGE=16; fi
echo "Ferry page size: $PAGE" | tee -a "$OUT/machine.txt"

step gpu-tests 120 "$PY" -m pytest -q -m gpu tests -p no:cacheprovider --junitxml "$OUT/gpu-tests.xml"

# float32 on the GPU: the same saved weights in both systems, so greedy tokens must match exactly. flash-attn has
# no float32 kernels, so Ferry gets 16-token pages (its torch backend) whatever is installed.
step offline-qwen3-0.6b-fp32-check 75 "$PY" -m bench offline --model qwen3-0.6b --weights saved --dtype float32 \
    --systems transformers-cb,ferry --check strict --num-requests 16 --prompt-len uniform:16:256 \
    --output-len uniform:8:64 --batch-size 8 --page-size 16 --no-floor \
    --json "$OUT/offline-qwen3-0.6b-fp32-check.json"

# bfloat16: kernels differ between systems, so token agreement is recorded (--check report), not required.
step offline-qwen3-0.6b 150 "$PY" -m bench offline --model qwen3-0.6b --weights saved --dtype bfloat16 \
    --check report --num-requests 128 --prompt-len uniform:32:512 --output-len pareto:16:512:1.2 \
    --batch-size 64 --max-batch-tokens 8192 --page-size "$PAGE" \
    --json "$OUT/offline-qwen3-0.6b.json" --plot "$OUT/timeline-qwen3-0.6b.png"

# 4B: per-system dummy weights (saving and reloading 8 GB would eat the time budget), so no token check.
step offline-qwen3-4b 180 "$PY" -m bench offline --model qwen3-4b --weights dummy --dtype bfloat16 \
    --systems transformers-cb,ferry --num-requests 128 --prompt-len uniform:32:512 \
    --output-len pareto:16:512:1.2 --batch-size 64 --max-batch-tokens 8192 --page-size "$PAGE" \
    --json "$OUT/offline-qwen3-4b.json"

# Tensor parallelism needs a GPU per rank: on a one-GPU machine this step is skipped, not failed.
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$GPUS" -gt 1 ]; then
    step tp-qwen3-4b 120 "$PY" -m ferry bench tp --model qwen3-4b --tensor-parallel-size 2 --device cuda \
        --dtype bfloat16 --sizes 1,16,64 --steps 50 --json "$OUT/tp-qwen3-4b.json"
else
    echo "=== tp-qwen3-4b: skipped ($GPUS GPU; tensor parallelism needs at least 2)"
fi

echo "results in $OUT (exit $status)"
exit "$status"
