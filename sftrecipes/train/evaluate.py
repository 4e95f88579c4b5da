"""An evaluation-only run (evalonly.eval_only: `do_train: false` or `max_steps: 0`) in each rank: the eval split
prepared as a training run prepares it (formats, template, cut, counts), the model loaded (an adapter on its base,
never merged into a copy), evaluated by SFTTrainer.evaluate, eval_loss and perplexity written to run_summary.json
(evalonly.summary_path) and said in the log's last line; nothing else is written (no checkpoint, no adapter or model,
no finished marker).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import datasets
from peft import PeftModel

from sftrecipes.core.errors import RecipeError
from sftrecipes.data.formats import check_template, detect_format
from sftrecipes.data.load import load_source, read_splits
from sftrecipes.data.tokenization import finish_split, log_bos, tokenize_split
from sftrecipes.data.tokenizer import load_tokenizer
from sftrecipes.facts import folders
from sftrecipes.facts.startmodel import adapter_of, base_of
from sftrecipes.model import load as models
from sftrecipes.model.attnchoice import choose_attention
from sftrecipes.model.wrapping import fsdp_wrap_classes, zero3_leaves
from sftrecipes.recipe.evalonly import eval_record, eval_sources, eval_words, summary_path, unused, why, without_engine
from sftrecipes.recipe.images import refuse_split
from sftrecipes.recipe.typed import Recipe
from sftrecipes.train import args as backends
from sftrecipes.train import methods

log = logging.getLogger("sftrecipes")


def eval_dataset(recipe: Recipe, tokenizer, eot: str):
    """(the eval rows prepared, their counts, the splits read in words): the splits evalonly.eval_sources names, each
    loaded, checked (images, format, template) and tokenized; the training split is read only for the rows
    val_set_size holds out of it, as training holds them out."""
    parts, formats, read, held = [], {}, [], None
    for src in eval_sources(recipe):
        if recipe.data.val_set_size is not None:  # the rows training holds out (the training split read, never trained)
            _, got, held = read_splits(recipe, src)
            raw, where = got.dataset, f"{src.key} {src.path} ({src.split}, held out by val_set_size)"
        else:
            raw = load_source(src, src.eval_split, required=src.eval_required)
            where = f"{src.key} {src.path} ({src.eval_split})"
        if raw is None:
            log.info("data: %s has no split '%s': nothing evaluated from it", src.key, src.eval_split)
            continue
        refuse_split(recipe, raw, where)  # image rows: refused before tokenizing
        fmt = detect_format(recipe, raw.column_names, where, src.format,
                            "dataset_format" if src.key == "dataset_name" or src.format == recipe.data.dataset_format else f"{src.key}.format")
        check_template(recipe, fmt, src.key, raw[0] if len(raw) else None)
        log.info("data: %s: %s, evaluated", where, fmt)
        parts.append(tokenize_split(recipe, tokenizer, eot, raw, "eval split", fmt, where))
        formats[fmt] = formats.get(fmt, 0) + len(raw)
        read.append(where)
    if not parts:
        raise RecipeError(f"splits: none of the splits to evaluate is in the data ({recipe.data.splits}); name one the "
                          "data has (splits: test, or a datasets entry's eval_split)")
    rows = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    evals, counts = finish_split(recipe, rows, "eval split", formats, is_eval=True)
    log_bos(tokenizer, counts["duplicate_bos_removed"])
    return evals, {**counts, **({"held_out": held.record} if held else {})}, read


def load_evaluated(recipe: Recipe, tokenizer, target: str):
    """(model, adapter folder or None, its base or None): the model named, or for an adapter folder its base loaded as
    the recipe loads models with the adapter applied on top by peft (no merged copy written)."""
    adapter = adapter_of(recipe.model.model_name_or_path)
    if adapter is None:
        return models.load_model(recipe, tokenizer, target), None, None
    base = base_of(adapter)
    on_base = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, model_name_or_path=base))
    model = models.load_model(on_base, tokenizer, target)
    return PeftModel.from_pretrained(model, str(adapter), is_trainable=False), adapter, base


def run(recipe: Recipe, target: str, life, warnings: list[str | None] = ()) -> tuple:
    """Evaluate as the recipe says, without training. Returns (trainer, summary); rank 0 writes the summary.
    life: the process's runlife.RunLife (a preemption signal ends an evaluation: nothing to save, run it again).
    warnings: train.py's lines for what this process runs otherwise (fallbacks.packing_fallback).
    Under DeepSpeed ZeRO-1/2 the ranks evaluate data-parallel without DeepSpeed's engine (evalonly.without_engine): the
    launcher's DeepSpeed variable is turned off in this process before the training arguments read it."""
    engine_free = without_engine(recipe)
    if engine_free:  # (preflight.in_run has checked the launcher's variables against the recipe already)
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"
    args = backends.training_args(recipe, target)
    life.started(args)  # every rank up: the lock is this run's
    main = args.process_index == 0
    where = summary_path(args.output_dir)  # before this run writes anything: a training run's results stay as they are
    if main:
        for line in filter(None, warnings):
            log.warning("%s", line)
        if engine_free:
            log.info("%s", engine_free)
        for alias, key in recipe.renamed.items():
            log.info("recipe: '%s' is read as '%s'", alias, key)
        skipped = unused(recipe)
        log.info("%s: evaluation only — nothing is trained, no checkpoint, adapter or model is written%s; the summary goes "
                 "to %s", why(recipe), f" ({', '.join(skipped)}: not used)" if skipped else "", where)
    folders.check_model_files(recipe.model)
    choose_attention(recipe, target)
    if recipe.launch.backend == "fsdp":
        fsdp_wrap_classes(recipe)
    tokenizer, end_of_turn, _ = load_tokenizer(recipe)
    eval_ds, counts, read = eval_dataset(recipe, tokenizer, end_of_turn)
    held_out = {"held_out": counts.pop("held_out")} if "held_out" in counts else {}  # val_set_size's record: data.held_out
    model, adapter, base = load_evaluated(recipe, tokenizer, target)
    zero3_leaves(model, recipe, main)
    # SFTTrainer refuses to be built without a train_dataset; evaluate() never reads it: one eval row stands in
    trainer = methods.trainer_class(recipe)(model=model, args=args, train_dataset=eval_ds.select(range(1)),
                                            eval_dataset=eval_ds, processing_class=tokenizer)
    backends.size_deepspeed_buckets(trainer)  # ZeRO-3: its gathers sized as in training
    start = time.time()
    metrics = trainer.evaluate()
    seconds = time.time() - start
    summary = {}
    if trainer.is_world_process_zero():
        what = f"the adapter {adapter} on its base {base}" if adapter else recipe.model.model_name_or_path
        record = eval_record(metrics)
        summary = {"evaluation_only": True, "why": why(recipe), "model": recipe.model.model_name_or_path,
                   "adapter": str(adapter) if adapter else None, "base": base, "evaluated": read, "eval": record,
                   "data": {"eval": counts, **held_out}, "seconds": round(seconds, 2), "output_dir": args.output_dir,
                   "processes": args.world_size, "distributed_type": str(trainer.accelerator.distributed_type.value),
                   "attention": trainer.accelerator.unwrap_model(trainer.model).config._attn_implementation,
                   "method": recipe.method}
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text(json.dumps(summary, indent=1))
        log.info("evaluated: %s on %s (%d rows): %s in %.1fs; summary in %s", what, ", ".join(read), counts["kept"],
                 eval_words(record), seconds, where)
    return trainer, summary
