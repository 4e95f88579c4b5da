#!/usr/bin/env bash
# GPU benchmark (one GPU, about 8 minutes on an H200): LoRA SFT of a random-init ~8B Llama in bf16 with packing,
# sdpa or flash-attn when installed, gradient checkpointing on and off; prints tokens/s/device, MFU, peak memory
# and the planner's prediction (bench/gpu_bench.py; results in outputs/gpu_bench/results.json).
#   scripts/gpu_bench.sh [--steps 12] [--batch 4] [--seq 2048]
# Written by hand (not emitted). For a GPU image that has torch, transformers, peft and accelerate but not trl:
# put the missing wheels in .whl/ (pip download --no-deps trl==1.16.0 pyyaml psutil tensorboard matplotlib ...)
# and they are installed into /tmp/site for this run only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
if ! "$PY" -c "import trl, yaml, psutil" 2>/dev/null; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "error: trl (or yaml/psutil) is missing and .whl/ holds no wheels; see the header of $0" >&2; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" bench/gpu_bench.py "$@"
