#!/usr/bin/env bash
# One prepared GPU run for an H200 machine with no network, in under 10 minutes (12 with the TP step):
#   1. the GPU tests (pytest -m gpu: bf16 against transformers' bf16 within tolerance, float32 greedy-exact,
#      the Triton paged kernel against the torch backend, CUDA graphs against eager);
#   2. a float32 greedy-equality check of Ferry against transformers on the GPU (Qwen3-0.6B shape, strict);
#   3. the offline benchmark, bfloat16, Qwen3-0.6B-shaped: transformers' `generate_batch` (its continuous batching),
#      Ferry with CUDA graphs, then Ferry with --enforce-eager, then Ferry with --async-scheduling;
#   4. the same for Qwen3-4B-shaped dummy weights, and for a 2-layer Qwen3-30B-A3B shape (mixture of experts);
#   5. decode step time at batch 1 / 16 / 64 / 256 against the HBM roofline, CUDA graphs on and off, both shapes;
#      fp8 weights and an fp8 KV cache against bfloat16 on the 4B shape;
#   6. on a machine with more than one GPU: tensor parallelism, the TP=2 engine step against TP=1 (NCCL).
# Models are named configs with random weights built locally; nothing is downloaded. Pages are 16 tokens throughout.
# Usage: scripts/gpu_bench.sh OUTDIR    (JSON results, logs and the timeline PNG land in OUTDIR)
#        STEPS="gpu-tests decode-qwen3-0.6b" scripts/gpu_bench.sh OUTDIR    runs only the steps named.
# The machine's own python3 runs it (PYTHON to choose another); Python packages it lacks travel as wheels in .whl/,
# installed into a scratch folder first (the device machine has no package index).
# Exit status: 0 when every step passed, 1 when one failed or hit its time limit (the others still run).
set -uo pipefail

OUT=${1:?usage: scripts/gpu_bench.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
STEPS=${STEPS:-}
status=0

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ferry-site .whl/*.whl \
        && export PYTHONPATH=/tmp/ferry-site${PYTHONPATH:+:$PYTHONPATH}
fi

# Each step has its own time limit (600 s in all, the TP step aside) so that one slow step cannot push the whole run
# past 10 minutes; each is about 1.1-1.8x what the step took on the H200 of 2026-12-04 (BENCHMARKS.md, GPU); the MoE
# step (new, not yet run on a GPU) has what the others gave up.
step() {
    local name=$1 limit=$2
    shift 2
    if [ -n "$STEPS" ] && [[ " $STEPS " != *" $name "* ]]; then
        echo "=== $name: not among STEPS"
        return
    fi
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start))s"
    [ "$rc" -eq 0 ] || status=1
}

{ nvidia-smi || true; "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"; } > "$OUT/machine.txt" 2>&1
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || { echo "no CUDA device"; exit 2; }

# Only the files that hold GPU tests: collecting the others would import the server's packages.
step gpu-tests 115 "$PY" -m pytest -q -m gpu tests/test_gpu.py tests/test_sampler.py -p no:cacheprovider \
    --junitxml "$OUT/gpu-tests.xml"

# float32 on the GPU: the same saved weights in both systems, so greedy tokens must match exactly.
step offline-qwen3-0.6b-fp32-check 35 "$PY" -m bench offline --model qwen3-0.6b --weights saved --dtype float32 \
    --systems transformers-cb,ferry --check strict --num-requests 16 --prompt-len uniform:16:256 \
    --output-len uniform:8:64 --batch-size 8 --page-size 16 --no-floor \
    --json "$OUT/offline-qwen3-0.6b-fp32-check.json"

# bfloat16: kernels differ between systems, so token agreement is recorded (--check report), not required.
step offline-qwen3-0.6b 75 "$PY" -m bench offline --model qwen3-0.6b --weights saved --dtype bfloat16 \
    --systems transformers-cb,ferry --check report --num-requests 128 --prompt-len uniform:32:512 \
    --output-len pareto:16:512:1.2 --batch-size 64 --max-batch-tokens 8192 --page-size 16 \
    --json "$OUT/offline-qwen3-0.6b.json" --plot "$OUT/timeline-qwen3-0.6b.png"
step offline-qwen3-0.6b-eager 35 "$PY" -m bench offline --model qwen3-0.6b --weights dummy --dtype bfloat16 \
    --systems ferry --enforce-eager --num-requests 128 --prompt-len uniform:32:512 \
    --output-len pareto:16:512:1.2 --batch-size 64 --max-batch-tokens 8192 --page-size 16 \
    --json "$OUT/offline-qwen3-0.6b-eager.json"
# Overlap: step N+1 planned and prepared on the host while N runs on the device.
step offline-qwen3-0.6b-async 30 "$PY" -m bench offline --model qwen3-0.6b --weights dummy --dtype bfloat16 \
    --systems ferry --async-scheduling --num-requests 128 --prompt-len uniform:32:512 \
    --output-len pareto:16:512:1.2 --batch-size 64 --max-batch-tokens 8192 --page-size 16 \
    --json "$OUT/offline-qwen3-0.6b-async.json"

# 4B: per-system dummy weights (saving and reloading 8 GB would eat the time budget), so no token check.
step offline-qwen3-4b 85 "$PY" -m bench offline --model qwen3-4b --weights dummy --dtype bfloat16 \
    --systems transformers-cb,ferry --num-requests 128 --prompt-len uniform:32:512 \
    --output-len pareto:16:512:1.2 --batch-size 64 --max-batch-tokens 8192 --page-size 16 \
    --json "$OUT/offline-qwen3-4b.json"
step offline-qwen3-4b-eager 35 "$PY" -m bench offline --model qwen3-4b --weights dummy --dtype bfloat16 \
    --systems ferry --enforce-eager --num-requests 128 --prompt-len uniform:32:512 \
    --output-len pareto:16:512:1.2 --batch-size 64 --max-batch-tokens 8192 --page-size 16 \
    --json "$OUT/offline-qwen3-4b-eager.json"

# Mixture of experts (issue 26): Qwen3-30B-A3B's layer in 2 layers, native grouped expert matmuls with CUDA graphs
# against transformers' continuous batching (its experts one by one).
step offline-qwen3-30b-a3b 50 "$PY" -m bench offline --model qwen3-30b-a3b-2l --weights dummy --dtype bfloat16 \
    --systems transformers-cb,ferry --num-requests 32 --prompt-len uniform:32:512 \
    --output-len pareto:16:256:1.2 --batch-size 64 --max-batch-tokens 8192 --page-size 16 \
    --json "$OUT/offline-qwen3-30b-a3b.json"

# The roofline: bytes of weights and K/V one decode step reads, over ~4.3 TB/s.
for shape in qwen3-0.6b qwen3-4b; do
    step "decode-$shape" 40 "$PY" -m bench decode --model "$shape" --device cuda --dtype bfloat16 \
        --sizes 1,16,64,256 --context-len 512 --steps 30 --graphs on,off --json "$OUT/decode-$shape.json"
done

# fp8 weights (scaled matmuls) and an fp8 KV cache against bfloat16, side by side: decode is bound by bytes read.
step decode-qwen3-4b-fp8 60 "$PY" -m bench decode --model qwen3-4b --device cuda --dtype bfloat16 \
    --sizes 1,64 --context-len 512 --steps 30 --quantization none,fp8 --kv-cache-dtype auto,fp8 \
    --json "$OUT/decode-qwen3-4b-fp8.json"

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
