#!/usr/bin/env bash
# GPU check (one GPU, under 8 minutes on an H200 before the 32k step, which adds up to its 200 s budget): (0) the suite's GPU-marked tests (pytest -m gpu); (1) packed-attention numerics in bf16 (varlen, flex, flash-attn 2
# where importable, against sdpa with the dense block-diagonal mask); (2) throughput rows — LoRA ~8B with gradient
# checkpointing on and off and a full ~1B, each with sdpa padded / sdpa packed / varlen / flex / flash-attn 2, each
# without and with Liger — tokens/s/device, MFU, peak memory and the planner's figure; (3) QLoRA loading — a 1B
# random-weight Llama in bf16 loaded with the QLoRA ZeRO-3 twin's settings, partitioned as it loads and whole, the GPU's
# peak over each load against the planner's loading phase (bench/gpu_check.py, bench/qlora_load_probe.py; skipped with
# the reason where deepspeed or bitsandbytes is not importable: add deepspeed==0.19.8 and bitsandbytes==0.50.2 to .whl/);
# before (1)-(3), where `vllm` is on PATH, vLLM serving a tiny LoRA run and its export against transformers' greedy
# tokens (bench/vllm_check.py); and GRPO on the tiny recipe, transformers' generate and vLLM colocate where vllm is
# importable: seconds per step and the GPU's peak (bench/grpo_probe.py); and 32k-token rows (8B LoRA, varlen and
# flash-attn 2): tokens/s, peak memory, the plan (bench/results/longctx-32k-<date>).
# Writes bench/results/gpu-check-<gpu>-<date>.{json,md}; docs/benchmarks.md, "GPU check", says how to read them.
#   bench/gpu_check.sh [--budget-s 330] [--steps 6] [--only sdpa,sft_varlen] [--no-liger-rows]
#   python bench/gpu_check.py --cpu-smoke --out /tmp/x     # the same code on CPU (tests/test_gpu_check.py)
# Written by hand (not emitted). For a GPU image without trl: put the wheels in .whl/ (pip download --no-deps
# --python-version 3.12 --only-binary :all: trl==1.16.0 datasets==5.2.0 peft==0.21.2 transformers==5.24.0
# accelerate==1.15.0 liger-kernel==0.8.5 dill multiprocess regex) and they are installed into /tmp/site for this run
# only; the machine's own torch (and its triton) is used.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
if ! "$PY" -c "import trl, yaml, psutil" 2>/dev/null || { ls .whl/liger_kernel-*.whl >/dev/null 2>&1 && ! "$PY" -c "import liger_kernel" 2>/dev/null; }; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "error: trl (or yaml/psutil) is missing and .whl/ holds no wheels; see the header of $0" >&2; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# the suite's GPU-marked tests first (make test skips them), where pytest is importable; then the check itself
if "$PY" -c "import pytest" 2>/dev/null; then
  SFT_GPU_TESTS=1 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests || echo "gpu_check: GPU-marked tests failed (above)" >&2
else
  echo "gpu_check: pytest is not importable here; the GPU-marked tests (pytest -m gpu, SFT_GPU_TESTS=1) were not run" >&2
fi
# activation offloading: the GPU's and the pinned host memory's peak with it off and on against the plan
# (bench/offload_probe.py, docs/planner.md "Activation offloading"); a failure here does not stop the check
"$PY" bench/offload_probe.py --out "bench/results/offload-probe-$(date +%Y%m%d)" || echo "gpu_check: offload probe failed (above)" >&2
# vLLM (where `vllm` is on PATH; skipped with the reason otherwise): a tiny LoRA run served as scripts/serve_*.sh serve
# it -- the adapter on its base, then the merged export -- its greedy tokens against transformers' (bench/vllm_check.py,
# its two servers within --budget-s 300, starts included); a failure here does not stop the check
"$PY" bench/vllm_check.py --out "bench/results/vllm-check-$(date +%Y%m%d)" || echo "gpu_check: vLLM check failed (above)" >&2
# GRPO (recipes/tiny/grpo.yaml through train.run, 8 steps a row, each row a process of its own): transformers' generate,
# then vLLM colocate where vllm is importable here (else the row says why); seconds per step, GPU peak, rewards
# (bench/grpo_probe.py -> grpo-probe.{json,md}); a failure here does not stop the check
"$PY" bench/grpo_probe.py --out "bench/results/grpo-probe-$(date +%Y%m%d)" || echo "gpu_check: GRPO probe failed (above)" >&2
# long context (issue 41): the 8B LoRA with checkpointing at 32768 tokens a row, one GPU (sequence parallelism needs
# several: its equality with one process is proven on CPU, tests/train/test_seqpar.py), varlen and flash-attn 2:
# tokens/s, the GPU's peak and the planner's figure (bench/gpu_check.py's throughput rows); a failure does not stop
"$PY" bench/gpu_check.py --seq 32768 --batch 1 --steps 4 --configs lora_ckpt --only sft_varlen,flash_attention_2 \
  --no-liger-rows --no-qlora-load --budget-s 200 --row-timeout-s 150 --out "bench/results/longctx-32k-$(date +%Y%m%d)" \
  || echo "gpu_check: 32k long-context rows failed (above)" >&2
exec "$PY" bench/gpu_check.py "$@"
