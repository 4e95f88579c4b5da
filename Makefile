# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cksum requirements.txt | cut -d' ' -f1)
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export PYTHONDONTWRITEBYTECODE ?= 1

.PHONY: venv assets demo test data schema docs clean

$(STAMP): requirements.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	@rm -f $(VENV)/.installed-*
	@touch $@

venv: $(STAMP)

assets: $(STAMP)            ## tiny model + tokenizer into .assets/ (deterministic)
	$(BIN)/python -m sftrecipes tiny

demo: $(STAMP)              ## tiny LoRA fine-tune -> merge -> reload -> generate, on CPU
	$(BIN)/python -m sftrecipes demo

test: $(STAMP)              ## the test suite (CPU)
	$(BIN)/python -m pytest -q tests

data: $(STAMP)              ## rewrite data/tiny_chat (checked in; tests compare)
	$(BIN)/python -m sftrecipes tiny --data

schema: $(STAMP)            ## refresh sftrecipes/trl_options.json after upgrading TRL/transformers
	$(BIN)/python -m sftrecipes schema --refresh

docs: $(STAMP)              ## regenerate docs/options.md from the schema
	$(BIN)/python -m sftrecipes schema --docs

clean:
	rm -rf outputs .assets
