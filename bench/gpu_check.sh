#!/usr/bin/env bash
# GPU check: one GRPO step of a randomly initialised Qwen2.5-3B-shaped model (bf16 over float32 weights, gradient
# checkpointing, HFSampler) on one GPU; prints rollout tokens/s, update tokens/s and peak GPU
# memory. A smoke test: one cold step each, not a benchmark of steady-state speed. Needs a CUDA
# build of torch and transformers, nothing else (no vLLM, no downloads).
# A few minutes on one H200; stopped at 8. Arguments go to bench/gpu_check.py (see --help).
#
#   bash bench/gpu_check.sh
#   CUDA_VISIBLE_DEVICES=3 PYTHON=python3 bash bench/gpu_check.sh --questions 16
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=$(command -v python3 || command -v python); fi
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader
else
  echo "gpu_check: nvidia-smi not found; torch decides below whether a GPU is usable" >&2
fi
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export TOKENIZERS_PARALLELISM=false

LIMIT=470  # seconds: under 8 minutes with room to exit
timeout --kill-after=15 "$LIMIT" "$PY" -u bench/gpu_check.py "$@"
status=$?
if [ "$status" = 124 ] || [ "$status" = 137 ]; then
  echo "gpu_check: FAILED: stopped after ${LIMIT}s (the check must finish in under 8 minutes)" >&2
elif [ "$status" != 0 ]; then
  echo "gpu_check: FAILED (exit $status)" >&2
elif [[ " $* " != *" --help "* && " $* " != *" -h "* ]]; then  # (--help checks nothing)
  echo "gpu_check: OK"
fi
exit "$status"
