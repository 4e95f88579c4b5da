#!/usr/bin/env bash
# GPU benchmark (one GPU, under 2 minutes on an H200): LoRA SFT of a random-init ~8B Llama in bf16 with packing,
# sdpa or flash-attn when installed, gradient checkpointing on and off, and a full fine-tune of a ~1B one; prints
# tokens/s/device, MFU, peak memory and the planner's prediction (bench/gpu_bench.py; outputs/gpu_bench/results.json).
#   bench/gpu_bench.sh [--steps 12] [--batch 4] [--seq 2048] [--full-size none]
# Written by hand (not emitted). For a GPU image without trl: put
# the wheels in .whl/ (pip download --no-deps --python-version 3.12 ... trl==1.16.0 datasets==5.2.0 peft==0.21.2
# transformers==5.24.0 dill multiprocess regex) and they are installed into /tmp/site for this run only; the run
# of 2026-11-29 (docs/benchmarks.md, "GPU") was made so.
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
