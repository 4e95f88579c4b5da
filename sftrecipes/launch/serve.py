"""The vLLM serve script a recipe emits (scripts/serve_<name>.sh): what vLLM serves -- the run's LoRA adapter on its
base (--enable-lora, --lora-modules, --max-lora-rank), or the export folder where the run trains every weight or vLLM
cannot serve its adapter as a LoRA (facts/servable.py) -- on how many GPUs, and the checks before vLLM starts.

The script runs from any directory (it works from the repository root, as run_*.sh and export_*.sh do), stops in one
line (exit 2) where `vllm` is not on PATH or the folder it serves is not there yet, checks a LoRA adapter's
adapter_config.json before vLLM reads it, and passes its own arguments on to `vllm serve` after the ones it sets (for
vLLM's parser the later flag wins). Recipe values reach the script quoted (shlex.quote), never as shell code, and
reach its comments on one line.
"""

from __future__ import annotations

import shlex
import textwrap
from dataclasses import dataclass

from sftrecipes.facts.config import model_shape
from sftrecipes.facts.servable import VLLM_LORA_RANKS, max_lora_rank, obstacles
from sftrecipes.facts.shape import Shape
from sftrecipes.facts.startmodel import weights_dir
from sftrecipes.recipe.target import mixed_dtype
from sftrecipes.recipe.typed import Recipe

WEIGHTS_SHARE = 0.5  # the most of one GPU's memory the served weights may take; vLLM's KV cache gets the rest
SERVED_BYTES = 2  # vLLM serves in 16 bits (its dtype auto turns a float32 config into a 16-bit one on a GPU)
# vLLM 0.19.1 is the first release on transformers 5, which wrote the run's tokenizer and config files
INSTALL = ("install it in an environment of its own (its pins conflict with the training stack): python3 -m venv "
           "~/vllm && ~/vllm/bin/pip install 'vllm>=0.19.1', then put ~/vllm/bin on PATH")


@dataclass(frozen=True)
class ServePlan:
    """What a recipe's serve script serves and how."""

    form: str  # "lora": the adapter in output_dir on `base`; "export": the folder export_<name>.sh writes
    base: str  # the model vLLM loads under a LoRA adapter ("" for the export form)
    output_dir: str
    obstacles: tuple[str, ...]  # why a LoRA run's adapter is served merged, each naming its key and targets
    rank: int | None  # --max-lora-rank (the LoRA form)
    dtype: str  # --dtype
    max_len: int | None  # --max-model-len: the run's max_length
    tp: int  # --tensor-parallel-size
    tp_why: str


def planned_adapter(recipe: Recipe, shape: Shape) -> dict:
    """The adapter_config.json a LoRA run of this recipe writes, as far as vLLM reads it, torch-free: rank and alpha,
    the peft keys the recipe sets, and the parameters (fused experts, a router) its targets reach in this model, which
    peft adapts as target_parameters. The rows of tokens a chat template adds are not known before the tokenizer loads:
    the script checks the adapter_config.json the run wrote for those."""
    m = recipe.model
    cfg = {**recipe.peft, "r": m.lora_r, "lora_alpha": m.lora_alpha, "target_modules": m.lora_target_modules}
    reached = [w.name for layer in shape.lora_targets(m.lora_target_modules, m.lora_target_router)
               for w, _ in layer if w.kind in ("experts", "router")]
    params = list(dict.fromkeys([*(recipe.peft.get("target_parameters") or []), *reached]))
    if params:
        cfg["target_parameters"] = params
    return cfg


def tensor_parallel(recipe: Recipe, shape: Shape) -> tuple[int, str]:
    """--tensor-parallel-size and why: the fewest of a node's GPUs (a split every layer's attention heads allow, as
    vLLM requires) that hold the 16-bit weights in WEIGHTS_SHARE of each GPU; all that the node allows where none
    does, or where launch.gpu_memory_gb is not set; 1 on the cpu target."""
    L = recipe.launch
    if L.hardware == "cpu":
        return 1, "tensor parallel 1: the recipe's target is the CPU"
    heads = {lay.heads for lay in shape.decoder if lay.heads}
    kv = {lay.kv_heads for lay in shape.decoder if lay.kv_heads}
    splits = [d for d in range(1, L.gpus_per_node + 1) if L.gpus_per_node % d == 0 and all(h % d == 0 for h in heads)
              and all(k % d == 0 or d % k == 0 for k in kv)]
    count = ", ".join(str(h) for h in sorted(heads)) or "?"
    split = f"(a split of the {count} attention heads)"
    if not L.gpu_memory_gb:
        return splits[-1], (f"tensor parallel {splits[-1]}: launch.gpu_memory_gb is not set, so the most of the node's "
                            f"{L.gpus_per_node} GPU(s) {split}")
    gb = shape.params * SERVED_BYTES / 1e9
    fits = [d for d in splits if gb / d <= WEIGHTS_SHARE * L.gpu_memory_gb]
    if fits:
        return fits[0], (f"tensor parallel {fits[0]}: the fewest of the node's {L.gpus_per_node} GPU(s) {split} that hold "
                         f"the 16-bit weights ({gb:.1f} GB) in half of each {L.gpu_memory_gb:g} GB GPU, the other half "
                         "left to vLLM's KV cache")
    return splits[-1], (f"tensor parallel {splits[-1]}: the most of the node's {L.gpus_per_node} GPU(s) {split}, yet the "
                        f"16-bit weights ({gb:.1f} GB) take more than half of {splits[-1]} x {L.gpu_memory_gb:g} GB; serve "
                        "on more or larger GPUs (--tensor-parallel-size, --pipeline-parallel-size)")


def serve_plan(recipe: Recipe) -> ServePlan:
    m = recipe.model
    shape = model_shape(m.model_name_or_path)
    tp, tp_why = tensor_parallel(recipe, shape)
    found, rank = (), None
    if m.use_peft_lora:
        cfg = planned_adapter(recipe, shape)
        found, rank = tuple(obstacles(cfg)), max_lora_rank(cfg)
    form = "lora" if m.use_peft_lora and not found else "export"
    max_len = recipe.trl_value("max_length")
    return ServePlan(form, weights_dir(m.model_name_or_path) if form == "lora" else "", recipe.trl["output_dir"], found,
                     rank, mixed_dtype(recipe) or "auto", int(max_len) if max_len else None, tp, tp_why)


def _common(plan: ServePlan) -> list[str]:
    return ["--dtype", plan.dtype, *(["--max-model-len", str(plan.max_len)] if plan.max_len else []),
            "--tensor-parallel-size", str(plan.tp)]


def export_args(plan: ServePlan, name: str, folder: str) -> list[str]:
    """`vllm serve` arguments for a model folder (an export) served as `name`."""
    return [folder, *_named(plan, name)]


def _named(plan: ServePlan, name: str) -> list[str]:
    return ["--served-model-name", name, *_common(plan)]


def lora_args(plan: ServePlan, name: str, adapter: str) -> list[str]:
    """`vllm serve` arguments for the base with the run's adapter as the model `name`; the run's tokenizer (its chat
    template, its end of turn as eos; the same vocabulary as the base's where no rows were added) with it."""
    return [plan.base, "--tokenizer", adapter, "--enable-lora", "--lora-modules", f"{name}={adapter}",
            "--max-lora-rank", str(plan.rank), *_common(plan)]


def _comment(text: str, wrap: bool = True) -> str:
    """Comment lines of `text` (a recipe value's line breaks shown as \\n, never ending the comment), wrapped."""
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    lines = textwrap.wrap(text, 116, break_long_words=False, break_on_hyphens=False) if wrap else [text]
    return "\n".join("# " + line for line in lines)


def _words(args: list[str]) -> str:
    """Shell words: a word naming $ADAPTER double-quoted (the rest of it is a recipe name: letters, digits, _ . -),
    every other word shlex-quoted."""
    return " ".join(f'"{a}"' if "$ADAPTER" in a else shlex.quote(a) for a in args)


def serve_script(recipe: Recipe, name: str, header: str) -> str:
    plan = serve_plan(recipe)
    me = f"serve_{name}.sh"
    merged = "vllm serve " + _words(export_args(plan, name, plan.output_dir + "-export"))
    lines = ["#!/usr/bin/env bash", header,
             f"#   scripts/{me} [--port 8000] [vllm serve flags ...]   (later flags override the ones below)"]
    if plan.form == "lora":
        lines += [
            _comment(f"vLLM's OpenAI-compatible server: the base {plan.base} with the run's LoRA adapter "
                     f"({plan.output_dir}) as the model \"{name}\" (requests name it in \"model\"), with the run's "
                     "tokenizer and chat template; the base alone answers under its own name."),
            _comment(plan.tp_why + "."),
            f"# Merged instead (one folder, no adapter): scripts/export_{name}.sh, then",
            _comment("  " + merged, wrap=False),
            _comment("The adapter's adapter_config.json is checked first (sftrecipes/facts/servable.py): what vLLM "
                     "cannot serve as a LoRA (DoRA, modules_to_save, the rows of tokens the run added, expert parameters, "
                     f"a rank above {VLLM_LORA_RANKS[-1]}) is one line naming it and the merged command, exit 2."),
        ]
    else:
        lines += [_comment(f"vLLM's OpenAI-compatible server on the run's export ({plan.output_dir}-export, written by "
                           f"scripts/export_{name}.sh) as the model \"{name}\"."),
                  *([_comment(f"The run's LoRA adapter is served merged: vLLM cannot serve it as a LoRA "
                              f"({'; '.join(plan.obstacles)}).")] if plan.obstacles else []),
                  _comment(plan.tp_why + ".")]
    lines += ["# vLLM pins its own torch: install it in an environment of its own (python3 -m venv ~/vllm &&",
              "# ~/vllm/bin/pip install 'vllm>=0.19.1': the first on transformers 5, which wrote the run's files) and",
              "# put that environment's bin/ on PATH.",
              "set -euo pipefail",
              'cd "$(dirname "$0")/.."',
              "if ! command -v vllm >/dev/null 2>&1; then",
              f'  echo "{me}: vllm is not on PATH; {INSTALL}" >&2',
              "  exit 2",
              "fi",
              f"OUTPUT_DIR={shlex.quote(plan.output_dir)}"]
    if plan.form == "lora":
        lines += [
            'if [ ! -f "$OUTPUT_DIR/adapter_config.json" ]; then',
            f'  echo "{me}: no LoRA adapter in $OUTPUT_DIR yet; train it first: scripts/run_{name}.sh" >&2',
            "  exit 2",
            "fi",
            'PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"',
            f'WHY="$("$PY" -m sftrecipes.facts.servable "$OUTPUT_DIR" {plan.rank} {me} -- "$@")"',
            'if [ -n "$WHY" ]; then',
            f"  MERGED={shlex.quote(merged)}",
            f'  echo "{me}: vLLM cannot serve $OUTPUT_DIR as a LoRA: $WHY; serve the merged export instead: '
            f'scripts/export_{name}.sh, then $MERGED" >&2',
            "  exit 2",
            "fi",
            "# absolute: a relative adapter path vLLM does not find is a hub id to it",
            'ADAPTER="$(cd -- "$OUTPUT_DIR" >/dev/null && pwd)"',
            f'exec vllm serve {_words(lora_args(plan, name, "$ADAPTER"))} "$@"',
        ]
    else:
        why = f" (vLLM cannot serve the run's adapter as a LoRA: {'; '.join(plan.obstacles)})" if plan.obstacles else ""
        lines += [
            'SERVED="$OUTPUT_DIR-export"',
            'if [ ! -d "$SERVED" ]; then',
            f"  WHY={shlex.quote(why)}",
            f'  echo "{me}: $SERVED does not exist yet; make it: scripts/export_{name}.sh$WHY" >&2',
            "  exit 2",
            "fi",
            'SERVED="$(cd -- "$SERVED" >/dev/null && pwd)"',
            f'exec vllm serve "$SERVED" {_words(_named(plan, name))} "$@"',
        ]
    return "\n".join(lines) + "\n"
