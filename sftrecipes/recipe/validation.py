"""Validation: every cross-key rule of a recipe, torch-free, each failure one line naming the key(s) and the fix.

recipe.load_recipe calls adopt_model_init_kwargs on the coerced values and validate on the built Recipe, before
anything heavy is imported or anything is written.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sftrecipes.core.errors import RecipeError
from sftrecipes.facts.folders import start_from
from sftrecipes.recipe import evalonly, evaltasks, images, limits, online, seqpar, serverkeys, valset
from sftrecipes.recipe.coerce import coerce
from sftrecipes.recipe.lorarules import validate_lora
from sftrecipes.recipe.schema import CONFIGS, DATASET_ENTRY_KEYS, ONLINE, REFERENCE_FREE, TRAINERS, all_options, dpo_loss_types
from sftrecipes.recipe.sources import check_eval_split, check_trl_data_keys, sources

if TYPE_CHECKING:
    from sftrecipes.recipe.typed import Recipe


# model_init_kwargs keys the recipe owns under its own name (from_pretrained would otherwise get two values, and the
# project's would silently win): taken over as the recipe key, or refused when the recipe key says otherwise
MODEL_INIT_OWNED = {"attn_implementation": "attn_implementation", "dtype": "dtype", "torch_dtype": "dtype",
                    "trust_remote_code": "trust_remote_code"}
MODEL_INIT_REFUSED = {
    "quantization_config": "the recipe builds it from use_4bit_quantization / use_8bit_quantization and the bnb_4bit_* keys; set those",
    "device_map": "each rank holds the model on its own device and the launch section spreads the ranks; remove it",
}


def adopt_model_init_kwargs(values: dict[str, Any], renamed: dict[str, str]) -> None:
    """Nothing set in model_init_kwargs is overwritten without a word: keys the recipe owns become the recipe's key
    (an explicit recipe key that disagrees is an error), keys the project builds itself are refused with the fix."""
    mik = values.get("model_init_kwargs")
    if not isinstance(mik, dict):
        return
    mik = dict(mik)
    for k in list(mik):
        if k in MODEL_INIT_REFUSED:
            raise RecipeError(f"model_init_kwargs.{k}: not taken from model_init_kwargs: {MODEL_INIT_REFUSED[k]}")
        key = MODEL_INIT_OWNED.get(k)
        if key is None:
            continue
        raw = mik.pop(k)
        if raw is None:  # null: not set, as for a recipe key
            continue
        value = coerce(all_options()[key], raw, "model_init_kwargs")
        if key in values and values[key] != value:
            raise RecipeError(f"model_init_kwargs.{k} ({value}) and {key} ({values[key]}) disagree; keep one, as the recipe key {key}")
        values[key] = value
        renamed[f"model_init_kwargs.{k}"] = key
    values["model_init_kwargs"] = mik


def looks_local(s: str) -> bool:
    """Clearly a filesystem path (a hub id is `name` or `org/name`)."""
    return s.startswith((".", "/", "~")) or s.count("/") > 1 or s.endswith((".json", ".jsonl", ".parquet", ".csv"))


def setting(r: Recipe, key: str) -> Any:
    """The value the recipe gives `key` (a flat name, or launch.<name>), set or not."""
    section, _, name = key.rpartition(".")
    if section:
        return getattr(getattr(r, section), name)
    owner = all_options(r.method)[name].owner
    if owner in ("trl", "peft"):
        held = r.trl if owner == "trl" else r.peft
        return held[name] if name in held else all_options(r.method)[name].default
    return getattr(getattr(r, owner), name)


def changed(r: Recipe, keys: list[str]) -> list[str]:
    """Those of `keys` the recipe sets to something other than their default. A rule that a key only applies in some
    setting refuses these only: a default written out (use_nested_quant: false without 4-bit) has no effect to lose."""
    options = all_options(r.method)
    return [k for k in keys if k in r.explicit and setting(r, k) != options[k].default]


def _word(value: Any) -> str:
    """A value as a recipe writes it (true, not True)."""
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


def validate(r: Recipe) -> None:
    """Cross-key checks. Each failure is one line naming the key(s) and the fix."""
    m, d, L, ex = r.model, r.data, r.launch, r.explicit

    if not m.model_name_or_path:
        raise RecipeError("model_name_or_path: required; set a hub id (meta-llama/Llama-2-7b-hf) or a local model folder")
    for key, val in (("model_name_or_path", m.model_name_or_path), ("tokenizer_name_or_path", m.tokenizer_name_or_path),
                     ("dataset_name", d.dataset_name)):
        if val and looks_local(val) and not Path(val).expanduser().exists():
            raise RecipeError(f"{key}: local path '{val}' does not exist; fix the path (or build tiny assets: make assets)")
    start_from(Path(m.model_name_or_path).expanduser())  # a previous run's adapter or sharded checkpoint: merge/export it first
    if d.dataset_name and d.datasets:
        raise RecipeError("dataset_name and datasets are both set; keep one: put dataset_name into datasets as one more entry (- path: ...), or set dataset_name: null where a base recipe sets it")
    if not d.dataset_name and not d.datasets:
        raise RecipeError("dataset_name: required; set a hub dataset id, a local folder or a json/jsonl/parquet file (or datasets: a list for a mixture)")
    if d.datasets:
        _validate_datasets(d.datasets)
    _validate_method(r)
    valset.check(r)  # val_set_size: rows of the training split held out as the eval split
    evalonly.check(r)  # do_train: false / max_steps: 0: evaluation only (its rules, its eval split)
    evaltasks.check(r)  # eval_tasks: benchmark tasks after training (the keys with it, a save the harness loads)
    if not evalonly.eval_only(r):  # (an evaluation-only run reads no training split, streamed or not)
        _validate_streaming(r)

    # quantization
    if m.use_4bit_quantization and m.use_8bit_quantization:
        raise RecipeError("use_4bit_quantization and use_8bit_quantization are both true; keep one of them")
    quant = m.use_4bit_quantization or m.use_8bit_quantization
    four_bit_keys = ["use_nested_quant", "bnb_4bit_compute_dtype", "bnb_4bit_quant_type", "bnb_4bit_quant_storage_dtype"]
    stray = [] if m.use_4bit_quantization else changed(r, four_bit_keys)
    if stray:
        raise RecipeError(f"{stray[0]}: {_word(setting(r, stray[0]))} only applies to 4-bit loading; set use_4bit_quantization: true, "
                          f"or remove {stray[0]} ({stray[0]}: null where a base recipe sets it)")
    if quant and not m.use_peft_lora:
        raise RecipeError("use_4bit_quantization/use_8bit_quantization: quantized weights cannot be trained directly; set use_peft_lora: true (QLoRA)")
    if m.use_4bit_quantization and m.bnb_4bit_quant_storage_dtype != "uint8" and m.dtype not in ("auto", m.bnb_4bit_quant_storage_dtype):
        raise RecipeError(
            f"dtype: {m.dtype} differs from bnb_4bit_quant_storage_dtype {m.bnb_4bit_quant_storage_dtype}; "
            f"FSDP/ZeRO-3 need one dtype for all weights — set dtype: {m.bnb_4bit_quant_storage_dtype} (or auto)"
        )

    # LoRA keys without LoRA would be silently ignored
    lora_keys = ["lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_router", *r.peft]
    stray = [] if m.use_peft_lora else changed(r, lora_keys)
    if stray:
        raise RecipeError(f"{stray[0]}: only applies to LoRA; set use_peft_lora: true, or remove {stray[0]} "
                          f"({stray[0]}: null where a base recipe sets it)")
    if m.use_peft_lora:
        if m.lora_r < 1:
            raise RecipeError(f"lora_r: must be >= 1, got {m.lora_r}")
        if not 0.0 <= m.lora_dropout < 1.0:
            raise RecipeError(f"lora_dropout: must be in [0, 1), got {m.lora_dropout}")
        if not m.lora_target_modules.strip(", "):
            raise RecipeError("lora_target_modules: empty; use 'all-linear' or a comma-separated list like q_proj,v_proj")
        validate_lora(r)

    if m.use_flash_attn and m.attn_implementation not in ("auto", "flash_attention_2"):
        raise RecipeError(f"use_flash_attn: true asks for flash_attention_2 but attn_implementation is {m.attn_implementation}; keep one of them")

    # precision
    bf16, fp16 = r.trl_value("bf16"), r.trl_value("fp16")
    if bf16 and fp16:
        raise RecipeError("bf16 and fp16 are both true; keep one mixed-precision mode")

    if m.precision == "memory_constrained":
        if not (bf16 or fp16):
            raise RecipeError("precision: memory_constrained keeps weights in the bf16/fp16 load dtype; set bf16: true (or fp16: true)")
        if r.launch.backend == "deepspeed":
            raise RecipeError("precision: memory_constrained does not apply to DeepSpeed, which always keeps fp32 optimizer partitions; use fp32_trainable")
        if m.dtype not in ("auto", "bfloat16" if bf16 else "float16"):
            raise RecipeError(f"dtype: {m.dtype} contradicts precision: memory_constrained (everything in the {'bf16' if bf16 else 'fp16'} load dtype); set dtype: auto")

    # gradient checkpointing: two spellings upstream, one meaning
    gc_old, gc_new = r.trl.get("gradient_checkpointing"), r.trl.get("activation_checkpointing")
    if gc_old is not None and gc_new is not None and gc_old != gc_new:
        raise RecipeError(f"gradient_checkpointing ({gc_old}) and activation_checkpointing ({gc_new}) disagree; they are one option, keep activation_checkpointing")
    if changed(r, ["use_reentrant"]) and not r.gradient_checkpointing:
        raise RecipeError("use_reentrant: only applies with gradient checkpointing; set gradient_checkpointing: true, "
                          "or remove use_reentrant (use_reentrant: null where a base recipe sets it)")
    for kw_key in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        kwv = r.trl.get(kw_key)
        if "use_reentrant" in ex and isinstance(kwv, dict) and "use_reentrant" in kwv and kwv["use_reentrant"] != m.use_reentrant:
            raise RecipeError(f"use_reentrant ({m.use_reentrant}) and {kw_key}.use_reentrant ({kwv['use_reentrant']}) disagree; keep one")

    # data
    splits = [s.strip() for s in d.splits.split(",") if s.strip()]
    if evalonly.eval_only(r):
        images.check_sources(r, evalonly.eval_sources(r), eval_only=d.val_set_size is None)  # image rows: from local files
    else:
        if not splits or not any("train" in s for s in splits):
            raise RecipeError(f"splits: '{d.splits}' names no training split; include one with 'train' in its name, e.g. train,test")
        check_eval_split(r)
        images.check_sources(r, sources(r))
    limits.check(r)  # max_length within the model's positions; activation offloading where there is a GPU
    if r.trl_value("packing") and r.trl_value("max_length") is None:
        raise RecipeError("packing: true needs max_length (alias max_seq_len) to set the packed length; set max_length: 2048")
    if r.trl_value("max_length") is not None and r.trl_value("max_length") < 8:
        raise RecipeError(f"max_length: {r.trl_value('max_length')} is too short to hold a formatted sample; use at least 8")
    if m.chat_template_format == "none" and r.trl.get("assistant_only_loss"):
        raise RecipeError("assistant_only_loss: needs conversations; set chat_template_format (chatml/zephyr/tokenizer) or remove assistant_only_loss")
    formats = {e.get("format", d.dataset_format) for e in d.datasets} if d.datasets else {d.dataset_format}
    conversational = formats & {"messages", "conversations"}
    if m.chat_template_format == "none" and conversational:
        raise RecipeError(f"chat_template_format: none, but dataset_format {sorted(conversational)[0]} is conversational; set chat_template_format: tokenizer (the model's own template), chatml or zephyr")
    if r.trl.get("completion_only_loss") is not None and not formats & {"auto", "prompt_completion"}:
        raise RecipeError(f"completion_only_loss: applies to prompt/completion data, but dataset_format is {', '.join(sorted(formats))}; remove it (for conversations, assistant_only_loss: true trains on the assistant turns only)")
    if r.trl.get("assistant_only_loss") and formats == {"text"}:
        raise RecipeError("assistant_only_loss: text data has no assistant turns; remove it, or use conversational data (dataset_format: messages)")
    check_trl_data_keys(r)

    # resume
    resume = r.trl.get("resume_from_checkpoint")
    if resume not in (None, "auto") and not Path(resume).is_dir():
        raise RecipeError(f"resume_from_checkpoint: '{resume}' is not a folder; give a checkpoint folder or 'auto' (latest complete one in output_dir)")
    if not r.trl.get("output_dir"):
        raise RecipeError("output_dir: required; set the folder for checkpoints and the final model, e.g. output_dir: outputs/my-run")

    # integers that must be positive
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if r.trl_value(key) < 1:
            raise RecipeError(f"{key}: must be >= 1, got {r.trl_value(key)}")
    for key in ("sample_max_new_tokens", "nan_patience", "heartbeat_timeout"):
        if getattr(r.run, key) < 0:
            raise RecipeError(f"{key}: must be >= 0, got {getattr(r.run, key)}")
    if r.run.preempt_timeout < 1:
        raise RecipeError(f"preempt_timeout: must be >= 1 (seconds a preempted run may take to save), got {r.run.preempt_timeout}")
    template_path = r.trl.get("chat_template_path")
    if template_path:  # the project tokenizes the data itself: the template must be the one it tokenizes with
        if not str(template_path).endswith((".jinja", ".j2")):
            raise RecipeError(f"chat_template_path: '{template_path}' is not a .jinja/.j2 template file (copying a template "
                              "from another tokenizer also adds its tokens: set tokenizer_name_or_path to it instead)")
        if not Path(template_path).is_file():
            raise RecipeError(f"chat_template_path: file '{template_path}' does not exist; fix the path")
        if r.model.chat_template_format != "tokenizer":
            raise RecipeError(f"chat_template_path: the data is formatted with chat_template_format "
                              f"'{r.model.chat_template_format}'; set chat_template_format: tokenizer to use the file's template")
    if r.trl.get("enable_jit_checkpoint"):
        raise RecipeError("enable_jit_checkpoint: the run handles SIGTERM/SIGUSR1 itself (every rank stops after the same "
                          "step and saves a complete checkpoint; docs/reliability.md); remove the key")
    for key in ("num_machines", "gpus_per_node", "cpu_threads"):
        if getattr(L, key) is not None and getattr(L, key) < 1:
            raise RecipeError(f"launch.{key}: must be >= 1, got {getattr(L, key)}")
    for key in ("gpu_memory_gb", "cpu_ram_gb"):
        if getattr(L, key) is not None and getattr(L, key) <= 0:
            raise RecipeError(f"launch.{key}: must be > 0 GB, got {getattr(L, key)}")
    _validate_launch(r)
    serverkeys.check_server(r, r.method in ONLINE)  # launch.vllm_server_*: the vLLM server of grpo/rloo
    seqpar.check_sequence(r)  # launch.sequence_parallel_size / context_parallel_size


def _validate_method(r: Recipe) -> None:
    """The TRL keys a recipe sets belong to its method's config class: a key of another method's class would be
    dropped or refused deep inside the trainer. DPO's loss types: checked here, not at the first step's loss."""
    online.check_online(r)  # grpo/rloo: reward_funcs, the generation batch; reward_funcs refused elsewhere
    if r.method == "dpo" and "loss_type" in r.trl:
        known = dpo_loss_types()
        wrong = [t for t in r.trl["loss_type"] if t not in known]
        if wrong:
            raise RecipeError(f"loss_type: '{wrong[0]}' is not a loss DPOTrainer has; use one or more of {', '.join(known)}")
    if r.trl.get("generate_during_eval") and not any(importlib.util.find_spec(m) for m in ("wandb", "comet_ml")):
        raise RecipeError(f"generate_during_eval: {TRAINERS[r.method]} logs its generations to Weights & Biases or Comet, "
                          "and neither is installed; pip install wandb (or comet_ml), or remove generate_during_eval")
    if r.method in REFERENCE_FREE and r.trl_value("max_length") is None:
        raise RecipeError(f"max_length: null would not mean 'no cut' here: {TRAINERS[r.method]} then cuts at a length of "
                          "its own choosing; give the length every prompt + completion must fit (e.g. max_length: 1024)")
    sft_data = changed(r, ["add_special_tokens", "append_concat_token"]) if r.method != "sft" else []
    if sft_data:
        raise RecipeError(f"{sft_data[0]}: shapes SFT samples only; method {r.method}'s {TRAINERS[r.method]} tokenizes "
                          f"preference data itself (its chat template, eos): remove {sft_data[0]}")
    options = all_options(r.method)
    for key in sorted(r.explicit):
        o = options.get(key)
        if o is not None and o.methods and r.method not in o.methods:
            raise RecipeError(
                f"{key}: a key of {CONFIGS[o.methods[0]]} (method {', '.join(o.methods)}); method {r.method} trains with "
                f"{TRAINERS[r.method]}, whose {CONFIGS[r.method]} has no {key}: remove it, or set method: {o.methods[0]}"
            )


def _validate_streaming(r: Recipe) -> None:
    """streaming (stream.py): what an endless stream of one dataset needs, before anything loads."""
    d = r.data
    if d.streaming_buffer_rows < 1:
        raise RecipeError(f"streaming_buffer_rows: must be >= 1, got {d.streaming_buffer_rows}; 10000 is a good start")
    if not d.streaming:
        if "streaming_buffer_rows" in r.explicit:
            raise RecipeError("streaming_buffer_rows: only applies to streaming; set streaming: true, or remove streaming_buffer_rows")
        return
    if r.method != "sft":
        raise RecipeError(f"streaming: method {r.method} tokenizes its rows in TRL's trainer, which streams nothing here; "
                          "set streaming: false (method sft streams)")
    if d.datasets:
        raise RecipeError("streaming: a datasets: mixture draws rows by each source's size, which a stream does not "
                          "know; stream one dataset_name (mix the files beforehand), or set streaming: false")
    if r.trl_value("max_steps") is None or r.trl_value("max_steps") <= 0:
        raise RecipeError("streaming: needs max_steps (a stream has no length to count epochs in; at its end the next data "
                          "epoch starts); set max_steps, e.g. max_steps: 1000")
    if r.trl_value("dataloader_num_workers"):
        raise RecipeError(f"dataloader_num_workers: {r.trl_value('dataloader_num_workers')} loader processes would each "
                          "read the whole stream; set dataloader_num_workers: 0 with streaming (rows are prepared a buffer at a time)")


def _validate_datasets(entries: list[dict]) -> None:
    """Each `datasets:` entry on its own (torch-free); data.py reads the sources."""
    formats = all_options()["dataset_format"].choices
    for i, e in enumerate(entries):
        at = f"datasets[{i}]"
        for k in e:
            if k not in DATASET_ENTRY_KEYS:
                close = difflib.get_close_matches(str(k), list(DATASET_ENTRY_KEYS), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]}? " if close else ""
                raise RecipeError(f"{at}.{k}: unknown key; {hint}an entry takes {', '.join(DATASET_ENTRY_KEYS)}")
        path = e.get("path")
        if not isinstance(path, str) or not path.strip():
            raise RecipeError(f"{at}.path: required; give the dataset's hub id, local folder or json/jsonl/parquet/csv file")
        if looks_local(path) and not Path(path).expanduser().exists():
            raise RecipeError(f"{at}.path: local path '{path}' does not exist; fix the path")
        for k in ("name", "split", "eval_split"):
            v = e.get(k)
            if k in e and not (isinstance(v, str) and v.strip()) and not (k == "eval_split" and v is None):
                hint = "; YAML reads bare yes/no/on/off as booleans — quote it" if isinstance(v, bool) else ""
                null = " (or null: no eval rows from this entry)" if k == "eval_split" else ""
                raise RecipeError(f"{at}.{k}: expected a split/config name, got {v!r}{hint}; write a string{null}")
        if "weight" in e and "samples" in e:
            raise RecipeError(f"{at}.weight and {at}.samples are both set; keep one (weight: a fraction of its rows, samples: a row count)")
        w = e.get("weight")
        if "weight" in e and (isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0):
            raise RecipeError(f"{at}.weight: must be a number > 0 (the fraction of its rows drawn: 0.5 half, 2 twice), got {w!r}; to leave the dataset out, remove the entry")
        n = e.get("samples")
        if "samples" in e and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise RecipeError(f"{at}.samples: must be a whole number >= 1 (rows drawn), got {n!r}")
        cols = e.get("columns")
        if "columns" in e:
            if not isinstance(cols, dict) or not all(isinstance(a, str) and isinstance(b, str) for a, b in cols.items()):
                raise RecipeError(f"{at}.columns: expected a mapping {{column in the data: column the format needs}}, e.g. {{question: prompt, answer: completion}}, got {cols!r}")
            if len(set(cols.values())) != len(cols):
                raise RecipeError(f"{at}.columns: two columns renamed to the same name ({cols}); map each target once")
        if "format" in e and e["format"] not in formats:
            raise RecipeError(f"{at}.format: {e['format']!r} is not a format; use one of {', '.join(formats)} (ShareGPT from/value data is conversations)")


DEEPSPEED_KEYS = ("zero_stage", "offload_optimizer", "offload_params", "zero3_init")
FSDP_KEYS = ("fsdp_version", "fsdp_sharding_strategy", "fsdp_state_dict_type", "fsdp_cpu_ram_efficient_loading",
             "fsdp_sync_module_states", "fsdp_offload_params", "fsdp_transformer_layer_cls_to_wrap")


def _validate_launch(r: Recipe) -> None:
    L, m = r.launch, r.model
    if L.backend != "none":  # the launch section renders the accelerate config; transformers' own switches would fight it
        for key in ("fsdp", "fsdp_config", "deepspeed"):
            if r.trl.get(key):
                raise RecipeError(f"{key}: set with launch.backend {L.backend}, whose accelerate config decides the distribution; use the launch: keys (e.g. gradient_checkpointing: true instead of fsdp_config.activation_checkpointing) and remove {key}")
    # these two land in #SBATCH directive lines, which no shell quoting protects: only plain values pass
    if L.slurm_partition is not None and not re.fullmatch(r"[A-Za-z0-9_.,-]+", L.slurm_partition):
        raise RecipeError(f"launch.slurm_partition: {L.slurm_partition!r} is not a partition name (letters, digits, _ . , -)")
    if not re.fullmatch(r"(\d+-)?\d{1,3}(:\d{2}){0,2}", L.slurm_time):
        raise RecipeError(f"launch.slurm_time: {L.slurm_time!r} is not a SLURM time; write HH:MM:SS or D-HH:MM:SS")
    world = L.world_size
    if L.backend == "none" and world > 1:
        raise RecipeError(f"launch.backend: none runs one process, but num_machines x gpus_per_node = {world}; set backend: ddp, deepspeed or fsdp")
    for backend, keys in (("deepspeed", DEEPSPEED_KEYS), ("fsdp", FSDP_KEYS)):
        stray = [] if L.backend == backend else changed(r, [f"launch.{k}" for k in keys])
        if stray:
            raise RecipeError(f"{stray[0]}: only applies to backend {backend}, but backend is {L.backend}; set launch.backend: "
                              f"{backend}, or remove it ({stray[0].split('.', 1)[1]}: null under launch: where a base recipe sets it)")
    if L.backend == "deepspeed" and L.zero_stage != 3:
        for key in ("offload_optimizer", "offload_params"):
            if getattr(L, key):
                raise RecipeError(f"launch.{key}: offload needs ZeRO-3 here, but zero_stage is {L.zero_stage}; set launch.zero_stage: 3")
        # zero3_init below stage 3 is not refused: true is its default there too, and the rendered config turns it off
    if L.backend == "fsdp":
        wrap = L.wrap_classes
        if wrap is not None:  # (whether the model has them is checked in each rank, on the model built on the meta device)
            bad = [c for c in wrap if not c.isidentifier()]
            if not wrap or bad:
                raise RecipeError(f"launch.fsdp_transformer_layer_cls_to_wrap: {bad[0]!r} is not a class name; give module class "
                                  "names, e.g. LlamaDecoderLayer (a list or one comma-separated string)" if bad else
                                  "launch.fsdp_transformer_layer_cls_to_wrap: empty; name module classes (e.g. "
                                  "LlamaDecoderLayer), or remove the key to wrap the model's own (_no_split_modules)")
        if L.fsdp_version == 2 and L.fsdp_sharding_strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"):
            raise RecipeError(f"launch.fsdp_sharding_strategy: {L.fsdp_sharding_strategy} needs fsdp_version: 1 (FSDP2 has FULL_SHARD and SHARD_GRAD_OP)")
        if L.hardware == "cpu" and L.fsdp_offload_params:
            raise RecipeError("launch.fsdp_offload_params: offloading to CPU needs a GPU to offload from (it pins memory); set it false on the cpu target")
        if L.hardware == "cpu" and L.fsdp_version == 1:
            # torch 2.13's FSDP1 cannot unshard on a CPU compute device (segfault / "setStorage ... size 0") and its
            # plugin refuses sync_module_states without a GPU: keep to what works on CPU
            if L.fsdp_sync_module_states or L.fsdp_cpu_ram_efficient_loading:
                raise RecipeError("launch.fsdp_sync_module_states: FSDP1 cannot broadcast module states on the cpu target; set fsdp_sync_module_states and fsdp_cpu_ram_efficient_loading to false (or use fsdp_version: 2)")
            if L.fsdp_state_dict_type == "FULL_STATE_DICT" or m.use_peft_lora:
                raise RecipeError("launch.fsdp_version: FSDP1 cannot gather a full state dict on the cpu target (needed for FULL_STATE_DICT and LoRA adapters); use fsdp_version: 2")
        if L.fsdp_cpu_ram_efficient_loading and not L.fsdp_sync_module_states:
            raise RecipeError("launch.fsdp_cpu_ram_efficient_loading: needs fsdp_sync_module_states: true (ranks other than 0 start empty); set it or turn loading off")
    if L.backend in ("fsdp", "deepspeed") and m.use_4bit_quantization and m.bnb_4bit_quant_storage_dtype == "uint8":
        raise RecipeError(
            f"bnb_4bit_quant_storage_dtype: uint8 4-bit weights cannot be sharded with the float weights by {L.backend}; "
            "set bnb_4bit_quant_storage_dtype: bfloat16 (and bf16: true)"
        )
    if L.backend in ("fsdp", "deepspeed") and m.use_8bit_quantization:
        raise RecipeError(f"use_8bit_quantization: 8-bit weights cannot be sharded by {L.backend}; use 4-bit QLoRA with bnb_4bit_quant_storage_dtype: bfloat16")
