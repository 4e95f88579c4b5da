"""Evaluation without training, torch-free: when a recipe asks for it (`do_train: false` or `max_steps: 0`), the rules
it must meet, the eval splits it reads, where its summary goes, and the eval metrics every run's run_summary.json
records (eval_loss and perplexity = exp(eval_loss); a training run's history of them too).

An evaluation-only run (evaluate.py runs it) trains nothing and writes nothing but its run_summary.json: no
checkpoint, no adapter or model, no merged copy of an adapter's base (a run from an adapter evaluates the adapter on
its base), no finished marker. In an output_dir that holds a training run's results it writes
<output_dir>/eval/run_summary.json, leaving the training run's files and its finished marker as they were; a finished
run there neither stops it (checkpoints.finished_run) nor is marked again.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.sources import EVAL_MARKERS, Source, sources

if TYPE_CHECKING:
    from sftrecipes.recipe.typed import Recipe

SUMMARY = "run_summary.json"
TRAINING_FILES = ("final.complete.json", "adapter_config.json", "config.json", "trainer_state.json")


def eval_only(r: Recipe) -> bool:
    """Whether the recipe evaluates without training: do_train: false, or max_steps: 0."""
    return r.trl_value("do_train") is False or r.trl_value("max_steps") == 0


def why(r: Recipe) -> str:
    """The key that made the run evaluation-only, as the recipe wrote it."""
    return "do_train: false" if r.trl_value("do_train") is False else "max_steps: 0"


def eval_sources(r: Recipe) -> list[Source]:
    """The datasets an evaluation-only run reads and the split of each it evaluates: `splits` may name the eval split
    alone (splits: test); it is the split named like test/val/eval, else the one not named like train. A datasets:
    entry's own eval_split wins, as in training (null: none from that entry). val_set_size: the source as training reads
    it, whose held-out rows are evaluated (evaluate.eval_dataset)."""
    if r.data.val_set_size is not None:
        return sources(r)
    names = [s.strip() for s in r.data.splits.split(",") if s.strip()]
    marked = [s for s in names if any(k in s for k in EVAL_MARKERS)]
    default = (marked or [s for s in names if "train" not in s] or [None])[0]
    d = r.data
    if not d.datasets:
        return [Source("dataset_name", d.dataset_name, "", default, True, format=d.dataset_format)]
    out = []
    for i, e in enumerate(d.datasets):
        explicit = "eval_split" in e
        split = e["eval_split"] if explicit else default
        if split:
            out.append(Source(f"datasets[{i}]", e["path"], "", split, explicit, e.get("name"),
                              columns=dict(e.get("columns") or {}), format=e.get("format", d.dataset_format)))
    return out


def check(r: Recipe) -> None:
    """The rules of an evaluation-only recipe, one line each, before torch loads."""
    do_train, steps = r.trl_value("do_train"), r.trl_value("max_steps")
    if steps == 0 and "do_train" in r.explicit and do_train:
        raise RecipeError("max_steps: 0 trains no step, but do_train is true; set max_steps (or num_train_epochs) to train, "
                          "or do_train: false to evaluate only")
    if not eval_only(r):
        return
    said = why(r)
    if r.trl.get("do_eval") is False:
        raise RecipeError(f"do_eval: false with {said}: nothing to do (no training, no evaluation); remove do_eval to "
                          "evaluate the eval split, or set do_train: true to train")
    if r.method != "sft":
        raise RecipeError(f"{said}: evaluation-only runs evaluate method sft (eval_loss and perplexity of the eval split); "
                          f"method {r.method}'s trainer evaluates during training: set eval_strategy: steps and train")
    resume = r.trl.get("resume_from_checkpoint")
    if resume not in (None, "auto"):
        raise RecipeError(f"resume_from_checkpoint: '{resume}': an evaluation-only run ({said}) resumes nothing; to "
                          f"evaluate that checkpoint set model_name_or_path: {resume}, and remove resume_from_checkpoint")
    if r.launch.backend == "fsdp" and r.launch.fsdp_version == 2:  # (accelerate 1.15's prepare() raises for a model
        # without an optimizer under FSDP2, and transformers' evaluation_loop prepares the model alone)
        raise RecipeError(f"launch.fsdp_version: 2 with {said}: accelerate prepares an FSDP2 model only together with "
                          "an optimizer, and an evaluation has none; set launch.fsdp_version: 1, or launch.backend: "
                          "deepspeed (zero_stage: 3) or ddp")
    if r.data.val_set_size is None and not any(src.eval_split for src in eval_sources(r)):
        entries = " or give a datasets entry an eval_split," if r.data.datasets else ""
        raise RecipeError(f"splits: '{r.data.splits}' names no split to evaluate, and {said} evaluates without training; "
                          f"name one (splits: train,test, or splits: test),{entries} or train (do_train: true)")


def without_engine(r: Recipe) -> str | None:
    """Under DeepSpeed ZeRO-1/2 an evaluation runs without DeepSpeed's engine, data-parallel as under DDP: those stages
    partition no weights (each rank holds the whole model anyway), and transformers evaluates under DeepSpeed only with
    ZeRO-3 (ZeRO inference). The log line saying so, or None where the backend evaluates as configured."""
    if r.launch.backend != "deepspeed" or r.launch.zero_stage == 3:
        return None
    return (f"launch.zero_stage: {r.launch.zero_stage}: evaluated without DeepSpeed's engine, data-parallel as under "
            "DDP (ZeRO-1/2 partition no weights: each rank holds the whole model; transformers evaluates under "
            "DeepSpeed only with ZeRO-3)")


def unused(r: Recipe) -> list[str]:
    """What the recipe sets that an evaluation-only run does not use, for its log line."""
    keys = [k for k in ("use_peft_lora", "resume_from_checkpoint", "streaming", "push_to_hub", "eval_strategy",
                        "eval_on_start", "save_strategy", "learning_rate") if k in r.explicit]
    lora = sorted(k for k in r.explicit if k.startswith("lora_") or k in r.peft)
    return keys + lora


# ----------------------------------------------------------------------------------------------- summaries


def summary_path(output_dir: str | Path) -> Path:
    """Where an evaluation-only run writes its summary: <output_dir>/run_summary.json, or <output_dir>/eval/ when
    output_dir holds a training run's results (its run_summary.json, finished marker, model, adapter or checkpoints)."""
    out = Path(output_dir)
    summary = out / SUMMARY
    trained = any((out / f).exists() for f in TRAINING_FILES) or any(out.glob("checkpoint-*"))
    if summary.is_file():
        try:
            trained = trained or not json.loads(summary.read_text()).get("evaluation_only")
        except (ValueError, AttributeError):
            trained = True
    return out / "eval" / SUMMARY if trained else summary


def perplexity(loss: float | None) -> float | None:
    """exp(eval_loss): the mean per-token loss as a perplexity (None without a loss; inf past float range)."""
    if loss is None or not math.isfinite(loss):
        return None
    return math.exp(loss) if loss < 709 else math.inf


def eval_record(metrics: dict[str, Any], method: str = "sft") -> dict[str, Any]:
    """One evaluation as run_summary.json records it: eval_loss, perplexity (sft: the loss is the mean per-token
    negative log-likelihood; a preference method's loss is not), and transformers' other eval_* figures."""
    out = {k: v for k, v in metrics.items() if k.startswith("eval_") or k in ("step", "epoch")}
    if method == "sft":
        out["perplexity"] = perplexity(metrics.get("eval_loss"))
    return out


def eval_history(log_history: list[dict], method: str = "sft") -> dict[str, Any] | None:
    """A training run's evaluations (eval_strategy steps/epoch, eval_on_start): each, and the last; None when none ran."""
    evals = [eval_record(e, method) for e in log_history if "eval_loss" in e]
    return {"last": evals[-1], "history": evals} if evals else None


def eval_words(record: dict[str, Any]) -> str:
    """The last evaluation in the run's last line: its loss and perplexity (sft), its loss and reward (grpo, rloo)."""
    ppl, reward = record.get("perplexity"), record.get("eval_reward")
    if ppl is not None:
        return f"eval_loss {record['eval_loss']:.4g}, perplexity {ppl:.4g}"
    if reward is not None:
        return f"eval_loss {record['eval_loss']:.4g}, eval_reward {reward:.4g} (the generated completions' mean reward)"
    return f"eval_loss {record.get('eval_loss')}"
