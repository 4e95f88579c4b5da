# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cksum requirements.txt | cut -d' ' -f1)
GGUF_STAMP := $(VENV)/.gguf-$(shell cksum requirements-gguf.txt | cut -d' ' -f1)
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export PYTHONDONTWRITEBYTECODE ?= 1
# DeepSpeed compiles its CPU Adam (ZeRO offload's optimizer) on first use; kept with the venv, not in ~/.cache shared
# by every checkout (whose venv paths differ, so each would rebuild it over the other's)
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions
# the venv's tools first, as an activated venv has them: its ninja (DeepSpeed's, 1.13) builds that extension; the
# system's (1.11) logs other command hashes, so each rebuilt what the other had built (~60 s a time)
export PATH := $(CURDIR)/$(BIN):$(PATH)
CPU_ADAM_STAMP := $(VENV)/.cpu-adam

.PHONY: help venv gguf-client cpu-adam assets demo lint test data schema docs emit plan bench bench-dpo bench-grpo bench-overhead bench-data bench-export bench-loading sweep sweep-two-ranks sweep-gguf clean sft-70b-lora sft-70b-qlora sft-offload sft-70b-fsdp sft-70b-qlora-fsdp sft-ddp sft-llama3-70b-lora sft-qwen3-32b-qlora sft-qwen3-moe-lora sft-llama3-70b-qlora sft-llama3-405b-qlora dpo-llama3-70b-lora dpo-qwen3-32b-qlora sft-dpo-llama3-70b-lora grpo-qwen3-8b-lora grpo-llama3-70b-lora sft-grpo-llama3-70b-lora vllm-env

$(STAMP): requirements.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	@rm -f $(VENV)/.installed-*
	@touch $@

venv: $(STAMP)

help:                       ## the targets and what each does (the `##` comments of this file)
	@awk -F':[^#]*## ' '/^[A-Za-z0-9_.-]+:[^=]*## / {printf "  %-26s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# llama.cpp for GGUF exports: a one-time source build of llama-cpp-python (about 3.5 min on 2 cores; pip's wheel cache
# keeps it, so a new venv takes seconds), then its converter unpacked into the venv. The multimodal library is not built.
$(GGUF_STAMP): $(STAMP) requirements-gguf.txt
	CMAKE_ARGS="-DLLAVA_BUILD=OFF $(CMAKE_ARGS)" $(BIN)/python -m pip install -q -r requirements-gguf.txt
	$(BIN)/python -m sftrecipes.facts.llamacpp
	@rm -f $(VENV)/.gguf-*
	@touch $@

# once per venv (about 40 s on 2 cores), so that no test (and no offload run) pays it
$(CPU_ADAM_STAMP): $(STAMP)
	DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
	@touch $@

cpu-adam: $(CPU_ADAM_STAMP)  ## DeepSpeed's CPU Adam for ZeRO offload, compiled into .venv/torch_extensions (one-time, ~40 s)

gguf-client: $(GGUF_STAMP)  ## llama.cpp's runtime, quantizer and converter for `export --to gguf` (one-time build)

assets: $(STAMP)            ## tiny model + tokenizer into .assets/ (deterministic)
	$(BIN)/python -m sftrecipes tiny

demo: $(STAMP)              ## tiny LoRA fine-tune -> merge -> reload -> generate, on CPU
	$(BIN)/python -m sftrecipes demo

lint: $(STAMP)              ## ruff, and the house's import contracts (import-linter; both configured in pyproject.toml)
	$(BIN)/ruff check .
	PYTHONPATH=. $(BIN)/lint-imports --no-cache

test: lint $(GGUF_STAMP) $(CPU_ADAM_STAMP)  ## the linter, then the test suite (CPU target; GPU-marked tests skipped)
	$(BIN)/python -m pytest -q --durations=25 tests

data: $(STAMP)              ## rewrite data/tiny_chat, data/tiny_dpo, data/tiny_kto, data/tiny_grpo (checked in; tests compare)
	$(BIN)/python -m sftrecipes tiny --data
	$(BIN)/python data/make_preference_data.py

schema: $(STAMP)            ## refresh sftrecipes/recipe/{trl_options,trl_methods,peft_options}.json after upgrading TRL/transformers/peft
	$(BIN)/python -m sftrecipes schema --refresh

plan: $(STAMP)              ## memory plan of a recipe: make plan RECIPE=recipes/llama2-70b/lora.yaml [ARGS="--lora_r 16"]
	@test -n "$(RECIPE)" || { echo "usage: make plan RECIPE=recipes/<...>.yaml" >&2; exit 2; }
	$(BIN)/python -m sftrecipes plan $(RECIPE) $(ARGS)

emit: $(STAMP)              ## regenerate configs/, scripts/ and docs/generated/setups/ from recipes/ (checked in; tests compare)
	$(BIN)/python -m sftrecipes emit

# The shipped setups. ARGS are passed to the launcher: ARGS=--dry-run prints the command, ARGS="--lora_r 16" overrides.
sft-70b-lora: $(STAMP)      ## Llama-2-70B LoRA, DeepSpeed ZeRO-3, 8 x 80 GB
	scripts/run_llama2-70b-lora.sh $(ARGS)
sft-70b-qlora: $(STAMP)     ## Llama-2-70B QLoRA, DeepSpeed ZeRO-3, 2 x 40 GB
	scripts/run_llama2-70b-qlora.sh $(ARGS)
sft-offload: $(STAMP)       ## Llama-2-7B full fine-tune, ZeRO-3 + CPU offload, 1 GPU
	scripts/run_llama2-7b-offload.sh $(ARGS)
sft-70b-fsdp: $(STAMP)      ## Llama-2-70B full fine-tune, FSDP, 2 nodes x 8 x 80 GB (this node's launcher; SLURM: sbatch scripts/slurm_llama2-70b-fsdp.sh)
	scripts/run_llama2-70b-fsdp.sh $(ARGS)
sft-70b-qlora-fsdp: $(STAMP) ## Llama-2-70B QLoRA, FSDP + offload, 2 x 24 GB
	scripts/run_llama2-70b-qlora-fsdp.sh $(ARGS)
sft-ddp: $(STAMP)           ## Llama-2-7B LoRA, DDP, 8 GPUs
	scripts/run_llama2-7b-ddp.sh $(ARGS)
sft-llama3-70b-lora: $(STAMP) ## Llama-3.1-70B-Instruct LoRA, DeepSpeed ZeRO-3, 8 x 80 GB
	scripts/run_llama3.1-70b-lora.sh $(ARGS)
sft-llama3-70b-qlora: $(STAMP) ## Llama-3.1-70B-Instruct QLoRA, DeepSpeed ZeRO-3 (4-bit partitioned as it loads), 8 x 24 GB
	scripts/run_llama3.1-70b-qlora.sh $(ARGS)
sft-llama3-405b-qlora: $(STAMP) ## Llama-3.1-405B-Instruct QLoRA, DeepSpeed ZeRO-3 (4-bit partitioned as it loads), 8 x 80 GB
	scripts/run_llama3.1-405b-qlora.sh $(ARGS)
sft-qwen3-32b-qlora: $(STAMP) ## Qwen3-32B QLoRA, FSDP2, 2 x 24 GB
	scripts/run_qwen3-32b-qlora-fsdp.sh $(ARGS)
sft-qwen3-moe-lora: $(STAMP) ## Qwen3-30B-A3B (MoE) LoRA, DeepSpeed ZeRO-3, 4 x 80 GB
	scripts/run_qwen3-30b-a3b-lora.sh $(ARGS)
dpo-llama3-70b-lora: $(STAMP) ## Llama-3.1-70B-Instruct DPO with LoRA, DeepSpeed ZeRO-3, 8 x 80 GB
	scripts/run_llama3.1-70b-dpo-lora.sh $(ARGS)
sft-dpo-llama3-70b-lora: $(STAMP) ## SFT then DPO: the Llama-3.1-70B LoRA SFT recipe, then DPO from its adapter (merged into the base once, beside it), 8 x 80 GB
	scripts/run_llama3.1-70b-lora.sh $(ARGS)
	scripts/run_llama3.1-70b-dpo-lora.sh --model_name_or_path outputs/llama3.1-70b-lora --output_dir outputs/llama3.1-70b-sft-dpo-lora $(ARGS)
dpo-qwen3-32b-qlora: $(STAMP) ## Qwen3-32B DPO with QLoRA, FSDP2, 2 x 24 GB
	scripts/run_qwen3-32b-dpo-qlora-fsdp.sh $(ARGS)
sft-llama3-8b-128k: $(STAMP) ## Llama-3.1-8B-Instruct full fine-tune at 128k tokens a row: Ulysses sequence parallelism over 8 GPUs, DeepSpeed ZeRO-3, 8 x 80 GB
	scripts/run_llama3.1-8b-sp-128k.sh $(ARGS)
sft-qwen3-32b-64k: $(STAMP) ## Qwen3-32B LoRA at 64k tokens a row (YaRN x2): Ulysses sequence parallelism over 8 GPUs, DeepSpeed ZeRO-3, 8 x 80 GB
	scripts/run_qwen3-32b-sp-64k-lora.sh $(ARGS)
grpo-qwen3-8b-lora: $(STAMP) ## Qwen3-8B GRPO with LoRA on GSM8K answers, vLLM colocate (vllm in the training environment), 1 x 80 GB
	scripts/run_qwen3-8b-grpo-lora.sh $(ARGS)
grpo-llama3-70b-lora: $(STAMP) ## Llama-3.1-70B-Instruct GRPO with LoRA on GSM8K answers: ZeRO-3 on 4 GPUs + a vLLM server (make vllm-env) on the other 4, 8 x 80 GB
	scripts/run_llama3.1-70b-grpo-lora.sh $(ARGS)
sft-grpo-llama3-70b-lora: $(STAMP) ## SFT then GRPO: the Llama-3.1-70B LoRA SFT recipe, then GRPO from its adapter (merged into the base once, beside it; the vLLM server serves the merged model), 8 x 80 GB
	scripts/run_llama3.1-70b-lora.sh $(ARGS)
	scripts/run_llama3.1-70b-grpo-lora.sh --model_name_or_path outputs/llama3.1-70b-lora --output_dir outputs/llama3.1-70b-sft-grpo-lora $(ARGS)

# The vLLM server's environment (launch.vllm_server_gpus starts `python -m trl.scripts.vllm_serve` with its python):
# vllm with its own pins (torch among them), which conflict with the training stack's, and the TRL release it serves for.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cksum requirements-vllm.txt | cut -d' ' -f1)
$(VLLM_STAMP): requirements-vllm.txt
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -r requirements-vllm.txt
	@rm -f $(VLLM_VENV)/.installed-*
	@touch $@

vllm-env: $(VLLM_STAMP)     ## .venv-vllm: vLLM + TRL for the GRPO recipes' vLLM server (launch.vllm_server_python's default; a GPU machine)

bench: $(STAMP)             ## training throughput grid (checkpointing x batch x packing x LoRA/full): train.py vs bare TRL, tiny model (~13 min); writes docs/benchmarks.md
	$(BIN)/python bench/bench_train.py $(ARGS)

bench-dpo: $(STAMP)         ## DPO throughput: train.py recipes/tiny/dpo.yaml vs a bare TRL DPOTrainer script, 4 rows (~7 min); writes docs/benchmarks.md
	$(BIN)/python bench/bench_train.py --dpo $(ARGS)

bench-grpo: $(STAMP)        ## GRPO time per step: train.py recipes/tiny/grpo.yaml vs a bare TRL GRPOTrainer script (bench/bare_grpo.py), 2 reward rows (~7 min); writes docs/benchmarks.md and bench/results/grpo-bench-<date>.{md,json}; exit 1 when train.py is over 1.03x
	$(BIN)/python bench/bench_grpo.py $(ARGS)

bench-overhead: $(STAMP)    ## what train.py adds per step over bare TRL, by counts: make bench-overhead [ARGS="--row 10 --steps 40"]
	$(BIN)/python bench/overhead_profile.py $(ARGS)

bench-data: $(STAMP)        ## data preparation rows/s: data.load_datasets vs TRL's SFTTrainer preparation, 50k and 200k synthetic chat rows, tokens compared; `prepare` of 100k and 1M rows: rows/s, peak RSS, disk (~25 min; ARGS=--only_scale: that table alone, ~5 min); writes docs/benchmarks.md
	$(BIN)/python bench/bench_data.py $(ARGS)

bench-loading: $(STAMP)     ## each rank's memory per phase (loading, wrapping, first steps) for every twin backend, 252M model, 2 ranks (~30 min); writes docs/loading.md
	$(BIN)/python bench/bench_loading.py $(ARGS)

bench-export: $(STAMP)      ## export memory/time: streaming merge/export vs peft and torch DCP (~12 min); writes docs/benchmarks.md
	$(BIN)/python bench/bench_export.py

sweep: $(STAMP)             ## every causal-LM architecture transformers maps: tiny model, LoRA 3 steps, merge --verify, plan vs run (~20 min at 2 jobs, goes on from outputs/sweep/; ARGS="--only a,b" reruns those, starting from the committed rows on a clone); writes docs/generated/architectures.md and .json
	$(BIN)/python bench/sweep.py $(ARGS)

sweep-two-ranks: $(STAMP)   ## the sweep's passing architectures launched on 2 ranks, ZeRO-3 LoRA and FSDP2 twins, only the model changed (~45 s each, goes on from outputs/sweep/ or the committed rows; ARGS="--only a,b --twins zero3"); the table's "2 ranks" column
	$(BIN)/python bench/sweep.py --two-ranks $(ARGS)

sweep-gguf: $(GGUF_STAMP)   ## the sweep's passing architectures exported with `export --to gguf --quant f32 --verify` in llama.cpp, one at a time (~15 s each, 180 s at most; goes on from outputs/sweep/ or the committed rows; ARGS="--only a,b"); the table's "GGUF" column, not part of "pass"
	$(BIN)/python bench/sweep.py --gguf $(ARGS)

docs: $(STAMP)              ## regenerate docs/generated/options.md from the schema (checked in; tests compare)
	$(BIN)/python -m sftrecipes schema --docs

clean:
	rm -rf outputs .assets
