#!/usr/bin/env python
"""Fine-tuning of a causal LM with TRL, driven by a recipe: SFTTrainer, or the trainer of another `method` (DPO, KTO,
ORPO, CPO; GRPO and RLOO generate and score completions with reward_funcs).

    python train.py recipes/tiny/lora.yaml                      # a recipe
    python train.py recipes/tiny/lora.yaml --lora_r 16          # ... with CLI overrides (CLI wins)
    python train.py --model_name_or_path ... --use_peft_lora True ...   # the PEFT SFT guide's flags, verbatim
    python train.py --help                                      # every option, its default and help

Flow: parse -> hardware target -> tokenizer -> datasets -> model -> the method's trainer -> train (resume) -> save + check.
Around it (sftrecipes/train/runlife.py, run/runlock.py, run/heartbeats.py): the output_dir lock, preemption signals (SIGTERM/SIGUSR1: save, exit 75), death
with the launcher, heartbeats. The logic lives in the `sftrecipes` package; this file only wires it up.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

if __name__ == "__main__" and os.environ.get("SFTRECIPES_FORK_SERVER"):  # the test suite, the sweep: this process
    from sftrecipes.core import forks  # is a fork of one that has imported torch & co. already (core/forks.py)

    forks.exit_in_fork(sys.argv)  # (returns where no server answered: this process runs it)

from sftrecipes.recipe import evalonly, valset  # noqa: E402
from sftrecipes.train import runlife  # noqa: E402 - torch waits inside it until a rank trains

if __name__ == "__main__":  # first thing: a SIGTERM/SIGUSR1 while this process starts waits for RunLife (no sudden death)
    runlife.hold_signals()

from sftrecipes.core.errors import RecipeError, say_error
from sftrecipes.data.prepcache import PreparationFailed  # noqa: E402
from sftrecipes.recipe.load import load_recipe  # noqa: E402
from sftrecipes.recipe.options_doc import help_text  # noqa: E402
from sftrecipes.run import lifecycle  # noqa: E402
from sftrecipes.run.checkpoints import TrainingStopped  # noqa: E402

log = logging.getLogger("sftrecipes")


def run(recipe, life=None):
    """Train as the recipe says. Returns (trainer, summary); the summary is also written to output_dir. `life`: the
    process's runlife.RunLife (main() enters it: lock, signals, heartbeats); callers without one get a plain run."""
    # torch and the training modules load here, not at the top: `--help` and a recipe that fails validation answer
    # (exit 2) before torch is imported
    from sftrecipes.data import load as data
    from sftrecipes.data import preference
    from sftrecipes.data import stream as streams
    from sftrecipes.data import vision as visions
    from sftrecipes.data.tokenizer import load_tokenizer
    from sftrecipes.export import startfrom
    from sftrecipes.facts import folders
    from sftrecipes.launch import preflight
    from sftrecipes.model import attention, attnchoice, fallbacks, lora, quantload, wrapping
    from sftrecipes.model import load as models
    from sftrecipes.plan.pitfalls import pitfalls
    from sftrecipes.recipe.schema import ONLINE
    from sftrecipes.run import checkpoints
    from sftrecipes.train import args as backends
    from sftrecipes.train import (
        devices,
        finalsave,
        hub,
        methods,
        metrics,
        nonfinite,
        online,
        precision,
        probes,
        rewards,
        saving,
        seqpar,
        streamtrain,
    )

    # 1. where we run: the cpu target sets use_cpu/gloo/threads so GPU command lines work as written
    target = devices.hardware(recipe)
    preflight.in_run(recipe, target)  # its process count, the launcher's config, what the target cannot run
    backends.apply_process_env(recipe, target)
    unpacked = fallbacks.packing_fallback(recipe)  # packed batches a kernel cannot keep apart here: padded rows instead
    unckpt = fallbacks.checkpointing_fallback(recipe)  # checkpointing on a class without it: the run goes without
    life = life or runlife.RunLife(recipe)
    if evalonly.eval_only(recipe):  # do_train: false / max_steps: 0: the eval split evaluated, nothing trained or saved
        from sftrecipes.train import evaluate

        return evaluate.run(recipe, target, life, [unpacked])  # (its own training arguments: ZeRO-1/2 without the engine)
    args = backends.training_args(recipe, target)
    seqpar.setup(recipe, target)  # launch.sequence_parallel_size: Ulysses' loss, batches and process groups mended
    life.started(args)  # every rank up: the lock is this run's
    resume = checkpoints.resolve_resume(recipe.trl.get("resume_from_checkpoint"), args.output_dir)
    checkpoints.match_resume(resume, recipe, args)  # its backend and global batch at this process count, or one line why not
    if resume and recipe.method == "sft" and recipe.data.streaming:
        streams.read_position(resume)  # a checkpoint without the stream's position: one line, before anything loads
    folders.check_model_files(recipe.model)  # tokenizer files present, safetensors whole: named here, not deep in a loader
    startfrom.ensure(recipe.model.model_name_or_path, recipe.run.heartbeat_timeout)  # an adapter: merged into its base once
    attnchoice.choose_attention(recipe, target)  # a kernel the model cannot run: refused here, before anything loads
    if recipe.launch.backend == "fsdp":
        wrapping.fsdp_wrap_classes(recipe)  # the layer classes FSDP wraps: named for accelerate before the trainer builds its plugin
    push_later = hub.prepare_hub(args)  # token out of saved files; no push attempt when the hub is unreachable
    if args.process_index == 0:
        for line in (unpacked, unckpt):
            if line:
                log.warning("%s", line)
        for key, why in recipe.ignored.items():  # what a base written for another method set
            log.info("recipe: %s: %s", key, why)
        for line in pitfalls(recipe):  # the global batch first, then any warning
            (log.warning if line.startswith("WARNING") else log.info)("%s", line)
    for alias, key in recipe.renamed.items():
        log.info("recipe: '%s' is read as '%s'", alias, key)
    if args.trust_remote_code:
        log.warning("trust_remote_code: on — the model's own Python code from %s will run", recipe.model.model_name_or_path)

    # 2. tokenizer (chat template, special tokens) and data: prepared once per set of inputs that shape the rows
    #    (sftrecipes/data/prepcache.py); one process prepares, the others wait on its files: no collective, so no
    #    ddp_timeout, however long it takes
    tokenizer, end_of_turn, added_tokens = load_tokenizer(recipe)
    stream, data_callbacks, vision, collator, processing, sample_images = None, [], None, None, tokenizer, []
    if recipe.method == "sft" and recipe.data.streaming:  # read as training goes; the position is in each checkpoint
        stream, eval_ds, prompt, data_counts = streams.streamed_datasets(recipe, tokenizer, end_of_turn, resume)
        train_ds = stream.dataset(streams.rows_per_step(args))
        data_callbacks = [streamtrain.StreamCallback(stream)]
    elif recipe.method == "sft" and (vision := visions.vision_datasets(recipe, tokenizer)):  # images: the processor's
        train_ds, eval_ds, data_counts, collator, processing, (prompt, sample_images) = vision  # batches: data/vision.py
        args.dataset_kwargs, args.remove_unused_columns = {"skip_prepare_dataset": True}, False
    elif recipe.method == "sft":
        train_ds, eval_ds, prompt, data_counts = data.prepared_datasets(recipe, tokenizer, end_of_turn)
        args.dataset_kwargs = {"skip_prepare_dataset": True}  # packed and shuffled as TRL would, once (trainrows.py)
    else:  # pairs (dpo) or labelled completions (kto) in TRL's shapes, tokenized by its trainer (preference.py)
        train_ds, eval_ds, prompt, data_counts = preference.preference_datasets(recipe, tokenizer)
    reward_funcs = rewards.reward_functions(recipe) if recipe.method in ONLINE else None  # grpo/rloo, imported here
    if reward_funcs is not None:
        rewards.check_columns(recipe, reward_funcs, train_ds.column_names)  # what each reads is in the rows

    # 3. model: dtype, attention, 4/8-bit loading; LoRA is applied by the trainer from peft_config
    memory = probes.PhaseMemory()  # each phase's peak RSS on this rank, the kernel's high-water mark reset at its start
    memory.start("loading")
    model = models.load_model(recipe, tokenizer, target, images=vision is not None)
    fallbacks.no_aux_loss_without_experts(model, args)  # a dense model whose config still declares router logits
    wrapping.zero3_leaves(model, recipe, args.process_index == 0)  # modules whose submodule calls the data decides: one fetch each
    completions = rewards.CompletionLog() if recipe.method in ONLINE else None  # grpo/rloo: a few completions each log
    memory.start("wrapping")  # to train()'s first callback: peft, accelerate's prepare (sharding, partitioning, broadcast)
    trainer = methods.trainer_class(recipe)(  # SFTTrainer, DPOTrainer or KTOTrainer
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=processing,  # a vision run's processor: saved with every checkpoint and the final model
        **({"data_collator": collator} if collator else {}),
        peft_config=lora.lora_config(recipe, added_tokens, model),
        callbacks=[memory, dtypes := precision.precision_probe(recipe),
                   throughput := metrics.ThroughputCallback(peak_tflops=recipe.launch.peak_tflops),
                   guard := nonfinite.nonfinite_guard(recipe.run.nan_patience), life.callback(),
                   quantload.kept_rows_check(), *data_callbacks, *([completions] if completions else [])],
        **methods.trainer_kwargs(recipe, lambda **kw: models.load_model(recipe, tokenizer, target, **kw), reward_funcs),
    )
    if recipe.method != "sft":
        data_counts = methods.tokenized_counts(recipe, trainer, data_counts)  # what TRL's tokenizing cut, logged
    if completions is not None:
        completions.trainer = trainer
    dtypes.trainer = trainer
    for callback in data_callbacks:
        callback.trainer = trainer
    if recipe.method == "sft" or not recipe.trl_value("disable_dropout"):  # (dpo/kto turn every dropout off by default)
        lora.module_dropout(trainer.model, recipe)  # lora_dropout on the modules of an adapter that also adapts parameters
    if recipe.model.use_peft_lora and args.process_index == 0:
        log.info("%s", lora.describe_adapter(trainer.model, recipe))  # what LoRA adapted: modules, experts, router
    backends.size_deepspeed_buckets(trainer)  # reduce / prefetch buckets by the hidden size, as the planner counts
    if recipe.launch.sequence_parallel_size > 1:
        seqpar.attach(trainer)  # the accumulation window's tokens counted from the sliced labels
    if recipe.method in ONLINE:  # grpo/rloo: each rank's generation buffer in every checkpoint, back on resume
        online.save_generation_state(trainer)
        online.restore_generation_state(trainer, resume)
    saving.make_checkpoints_atomic(  # a marker written last; rotation never drops the last complete one
        trainer, stream and (lambda folder: stream.save(folder, trainer.state.global_step, args)))  # where the stream goes on
    precision.apply_precision_policy(trainer, recipe)  # trainable params fp32 under mixed precision (logged)
    precision.autocast_under_fsdp2(trainer, recipe)  # the autocast accelerate gives DDP and FSDP1 but not FSDP2

    # 4. train, resuming from the checkpoint chosen above ('auto' = the latest complete one in output_dir); a
    #    preemption signal stops every rank after the same step with a complete checkpoint
    start = time.time()
    life.train(trainer, resume)
    seconds = time.time() - start
    if guard.stopped:  # nothing trained after this point is trustworthy: no final save
        last = checkpoints.latest_checkpoint(args.output_dir)
        raise checkpoints.TrainingStopped(
            f"training stopped: {guard.stopped}; the last good checkpoint is {last or 'none (no checkpoint was saved)'}; {guard.advice}"
        )
    if stream is not None:  # it could not read on (a row it cannot parse): the steps trained saved, one line, exit 2
        streamtrain.stop_if_unreadable(data_callbacks[0], trainer)
    life.stop_if_preempted(trainer)  # rank 0 writes preempted.json; main() exits 75
    if valset.final_eval_due(recipe, trainer.state.log_history, trainer.state.global_step):
        trainer.evaluate()  # val_set_size: the held-out rows after the last step (every rank), into run_summary.json's eval
    backend = probes.describe_backend(trainer)  # before save/generate, which gather shards
    memory_phases = memory.gather(trainer.accelerator)
    if stream is not None:
        data_counts = streamtrain.summary_counts(stream, data_counts)

    # 5. final save (adapter for LoRA, full weights otherwise), then check it holds every expected tensor
    trainer.accelerator.unwrap_model(trainer.model).config.use_cache = True  # off for training only (model.load_model)
    n_tensors = finalsave.save_final(trainer, recipe)

    # 6. a sample reply from the trained model (all ranks together: ZeRO-3/FSDP gather weights in each forward;
    #    after the save: bitsandbytes' CPU kernels repack 4-bit weights for inference)
    sample = probes.sample_reply(trainer, tokenizer, prompt, recipe.run.sample_max_new_tokens,
                                 **({"processor": processing, "images": visions.open_images(sample_images)} if vision else {})) \
        if recipe.run.sample_max_new_tokens and prompt is not None else {}

    if trainer.args.push_to_hub and trainer.is_world_process_zero():
        try:
            trainer.push_to_hub()
        except Exception as e:  # noqa: BLE001 - any hub failure: the local result stays, say how to push it
            push_later = f"hf upload {trainer.hub_model_id} {args.output_dir}"
            log.error("push_to_hub: failed (%s); the local result in %s is complete; push later with: %s",
                      type(e).__name__, args.output_dir, push_later)

    summary = {}
    if trainer.is_world_process_zero():
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        summary = {
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "losses": losses,
            "train_loss": final_train_loss(trainer.state.log_history),
            "steps": trainer.state.global_step,
            "seconds": round(seconds, 2),
            "saved_tensors": n_tensors,
            "output_dir": args.output_dir,
            "adapter": recipe.model.use_peft_lora,
            "packed": bool(getattr(trainer.args, "packing", False) or getattr(trainer.args, "padding_free", False)),  # False: fell back (logged)
            "resumed_from": resume,
            "backend": backend,
            "memory": memory_phases,  # per rank: baseline, then each phase's start/peak/end RSS and growth (MB)
            "precision": dtypes.table,
            "throughput": throughput.summary,  # tokens/s/device, step time, MFU, memory per rank (also metrics.json/png)
            "attention": attention.kernel_of(model),
            "sample": {"prompt": prompt, "reply": sample.get("reply"), "stopped_on": sample.get("stopped_on"),
                       "new_tokens": sample.get("new_tokens"),
                       **({"images": [v if isinstance(v, str) else "(bytes)" for v in sample_images]} if vision else {})},
            "data": data_counts,  # per split: read, truncated, dropped after the cut, fully masked, kept (data.py);
            # preparation: built, waited or reused, seconds, rows, rows/s, the cache entry (prepcache.py)
            "method": recipe.method,
            "preference": methods.preference_log(trainer.state.log_history, recipe.method),  # dpo/kto: margins; grpo: rewards, KL
            "completions": completions.last if completions else None,  # grpo/rloo: the last logged completions, rewarded
            "eval": evalonly.eval_history(trainer.state.log_history, recipe.method),  # eval_strategy steps/epoch: each evaluation, the last
            "push_later": push_later,
        }
        with open(f"{args.output_dir}/run_summary.json", "w") as f:
            json.dump(summary, f, indent=1)
        if sample:
            stop = (f"stopped on {sample['stopped_on']}" if sample["stopped_on"] else
                    f"no end of turn within {sample['new_tokens']} tokens (sample_max_new_tokens)")
            said = prompt[-1]["content"] if isinstance(prompt, list) else prompt
            if not isinstance(said, str):  # content parts (a vision row): its text, its images named
                said = " ".join(p.get("text", "") for p in said if p.get("type") == "text") + \
                    "".join(f" [image {v if isinstance(v, str) else '(bytes)'}]" for v in sample_images)
            log.info("sample: %r -> %r (%s)", said, sample["reply"], stop)
        evaluated = f", last eval (step {summary['eval']['last'].get('step')}): {evalonly.eval_words(summary['eval']['last'])}" if summary["eval"] else ""
        log.info("done: %d steps in %.1fs, %s%s, %d tensors saved to %s", summary["steps"], seconds,
                 loss_words(losses, summary["train_loss"], args.logging_steps, summary["steps"]), evaluated, n_tensors, args.output_dir)
    life.finish(trainer.state.global_step)  # final.complete.json: resume 'auto' on this folder has nothing to do
    return trainer, summary


def final_train_loss(log_history: list[dict]) -> float | None:
    """The train_loss transformers logs when train() ends (the mean loss over the steps this call trained), or None
    when training did not run (a resumed checkpoint already at max_steps)."""
    return next((e["train_loss"] for e in reversed(log_history) if "train_loss" in e), None)


def loss_words(losses: list[float], train_loss: float | None, logging_steps, steps: int) -> str:
    """The loss part of the run's last log line: the first and last logged loss, and the trainer's train_loss; what
    it is when no step was logged (logging_steps above the steps run), or that no step was trained."""
    mean = f"train_loss {train_loss:.4g} (the trainer's mean over the steps trained)" if train_loss is not None else None
    if losses:
        return f"loss {losses[0]:.4g} -> {losses[-1]:.4g}" + (f", {mean}" if mean else "")
    if mean:
        return f"no loss logged (logging_steps {logging_steps}, {steps} steps), {mean}"
    return "no step trained in this run, no loss logged"


def leave_process_group(code: int = 0, after=None) -> int:
    """Ranks that exit with the process group alive can abort in teardown ("terminate called without an active
    exception", seen on a QLoRA+FSDP twin), failing a run that had finished. Called by main(), not run(): callers of
    run() may still need the group (an in-run merge under ZeRO-3). `after`: what this process does once the group is
    gone (eval_tasks on the main process), its exit code the process's when the run's was 0."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        if after is not None:
            code = after() or code
        # the abort still happened in C++ static teardown (DeepSpeed/gloo threads) after a clean destroy; every file
        # is written and closed by now, so a distributed rank ends without running those destructors
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if after is not None:
        code = after() or code
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        recipe = load_recipe(argv)
        if recipe.run.eval_tasks:  # the tasks scored after training exist, before anything is written or trained
            from sftrecipes.use import lmeval

            lmeval.check_tasks(recipe.run.eval_tasks, recipe.run.eval_include_path, ("eval_tasks", "eval_include_path"))
        with runlife.RunLife(recipe) as life:  # dies with its launcher; main process: lock, or a finished run's no-op
            if life.finished:
                return 0
            run(recipe, life)
    except RecipeError as e:
        say_error(e)
        stopped = getattr(e, "every_rank", False)  # streamtrain.DataStopped: every rank, after training
        lifecycle.note_refusal(str(e), "stopped" if stopped else "refused")  # under launch: it exits 2 too, saying which
        return leave_process_group(2) if stopped else 2
    except PreparationFailed as e:  # the process preparing the data failed or went silent: one line, every rank
        say_error(e)
        return 1
    except TrainingStopped as e:
        if not e.every_rank or os.environ.get("RANK", "0") == "0":  # a verdict of every rank: said once
            say_error(e)
        return leave_process_group(1) if e.every_rank else 1
    except runlife.Preempted as e:
        if os.environ.get("RANK", "0") == "0":
            log.warning("%s", e)
        return leave_process_group(lifecycle.preempted_exit_code())
    return leave_process_group(0, after=_eval_tasks(recipe))


def _eval_tasks(recipe):
    """eval_tasks: the benchmark run on the saved model by the main process once every rank is done (None: none)."""
    if not recipe.run.eval_tasks or os.environ.get("RANK", "0") != "0":
        return None
    from sftrecipes.use import lmeval

    return lambda: lmeval.after_training(recipe)


if __name__ == "__main__":
    sys.exit(main())
