"""Every recipe option, declared once: the project's own sections (dataclasses whose fields carry help, default and
type), what the project changes in TRL's defaults and accepts as aliases, and which of peft's LoraConfig fields are
recipe keys (peftkeys.py lists those that are not). TRL's ``SFTConfig`` and peft's ``LoraConfig`` are used as they are, never copied by hand: their fields
come from the snapshots snapshots.py reads (owner ``trl``; owner ``peft``, applied with ``use_peft_lora``, except
those in :data:`PEFT_NOT_EXPOSED`, each with the reason). ``all_options()`` is the one table of every key.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from sftrecipes.recipe.peftkeys import PEFT_NOT_EXPOSED, PEFT_NOTES
from sftrecipes.recipe.rewards import RewardOptions
from sftrecipes.recipe.seqpar import SequenceOptions
from sftrecipes.recipe.serverkeys import ServerOptions
from sftrecipes.recipe.snapshots import (
    METHOD_CONFIGS,
    Option,
    load_methods_snapshot,
    load_peft_snapshot,
    load_trl_snapshot,
    options_of,
)
from sftrecipes.recipe.valset import HELP as VAL_SET_SIZE_HELP

DTYPES = ("bfloat16", "float16", "float32")
# What a recipe trains with (its `method` key): the TRL trainer and the config class whose fields are its TRL keys
METHODS = ("sft", "dpo", "kto", "orpo", "cpo", "grpo", "rloo")
TRAINERS = {"sft": "SFTTrainer", "dpo": "DPOTrainer", "kto": "KTOTrainer", "orpo": "ORPOTrainer", "cpo": "CPOTrainer",
            "grpo": "GRPOTrainer", "rloo": "RLOOTrainer"}
CONFIGS = {"sft": "SFTConfig", **METHOD_CONFIGS}
PAIRED = ("dpo", "orpo", "cpo")  # the methods that compare a chosen and a rejected completion of one prompt
REFERENCE_FREE = ("orpo", "cpo")  # no reference model at all: no second copy, no adapter-disabled pass
ONLINE = ("grpo", "rloo")  # online RL: completions generated from prompts during training, scored by reward_funcs


def opt(default: Any, help: str, choices: tuple | None = None, aliases: tuple = (), kind: str | None = None) -> Any:
    meta: dict[str, Any] = {"help": help}
    if choices:
        meta["choices"] = tuple(choices)
    if aliases:
        meta["aliases"] = tuple(aliases)
    if kind:
        meta["kind"] = kind  # overrides the kind read from the annotation (e.g. 'mappings' for a list of dicts)
    return field(default=default, metadata=meta)


@dataclass
class ModelOptions:
    """How the tokenizer and model are built (model.py)."""

    model_name_or_path: str | None = opt(
        None, "Hub id (e.g. meta-llama/Llama-2-70b-hf) or local folder of the model to fine-tune. Required."
    )
    tokenizer_name_or_path: str | None = opt(None, "Tokenizer to load; defaults to model_name_or_path.")
    dtype: str = opt(
        "auto",
        "dtype the weights are loaded in. 'auto': the 4-bit quant-storage dtype when that is a float type, "
        "bf16/fp16 for LoRA/QLoRA or precision memory_constrained when the matching mixed precision is on, otherwise "
        "float32 (full fine-tuning keeps its trainable weights fp32).",
        choices=("auto",) + DTYPES,
        aliases=("torch_dtype",),
    )
    chat_template_format: str = opt(
        "none",
        "How conversational data (messages, ShareGPT conversations, conversational prompt/completion) becomes text: "
        "'chatml' or 'zephyr' set that template (adding its special tokens if missing), 'tokenizer' uses the "
        "tokenizer's own template, 'none' for text data only. The token that closes an assistant turn is read from the "
        "template (special, added or plain text), logged, made the eos token and written into the generation config.",
        choices=("chatml", "zephyr", "tokenizer", "none"),
    )
    attn_implementation: str = opt(
        "auto",
        "Attention kernel, chosen from what the model class the loader instantiates supports (its _supports_sdpa, "
        "_supports_flash_attn, _supports_flex_attn flags and its attention's sinks, soft-capping and sliding windows). "
        "'auto': flash_attention_2 where the flash-attn package, a GPU, 16-bit compute and the model allow it; "
        "otherwise, for packed batches (packing or padding_free), sft_varlen (this project's kernel: each packed sample "
        "attends within itself, with torch's varlen flash kernel on a GPU in bf16/fp16 and per-sample causal sdpa "
        "elsewhere, instead of sdpa's dense block-diagonal mask; padded batches run exactly as sdpa) unless the model's "
        "attention has sinks (GPT-OSS) or logit soft-capping (Gemma-2), which sft_varlen does not implement; otherwise "
        "sdpa; eager for models without sdpa support. An explicit kernel the model cannot run is refused in each rank "
        "before anything loads (one line naming the kernels it can run); flash_attention_2 without the flash-attn "
        "package or a GPU falls back to the auto choice, warned. The run logs the attention that really ran, and "
        "run_summary.json records it.",
        choices=("auto", "sdpa", "eager", "flash_attention_2", "flex_attention", "sft_varlen"),
    )
    use_flash_attn: bool = opt(
        False, "The PEFT guide's switch for attn_implementation: flash_attention_2 (a different explicit "
        "attn_implementation is an error). Where the model class has no flash attention (e.g. Gemma-3's multimodal "
        "Gemma3ForConditionalGeneration), or flash-attn or a GPU is missing, it falls back to the auto choice, warned."
    )
    use_peft_lora: bool = opt(False, "Train LoRA adapters instead of all weights.")
    lora_r: int = opt(64, "LoRA rank.")
    lora_alpha: int = opt(16, "LoRA alpha (scaling = alpha / r).")
    lora_dropout: float = opt(0.1, "Dropout on the LoRA path.")
    lora_target_modules: str = opt(
        "q_proj,k_proj,v_proj,o_proj,down_proj,up_proj,gate_proj",
        "Comma-separated module names that get LoRA adapters, or 'all-linear'.",
    )
    lora_target_router: bool = opt(
        False, "Mixture-of-experts models: also adapt the router (mlp.gate). Off by default: 'all-linear' then adapts "
        "attention and the expert weights, not the routing; the run logs what it adapted either way."
    )
    use_4bit_quantization: bool = opt(False, "Load the base weights in 4 bits with bitsandbytes (QLoRA).")
    use_8bit_quantization: bool = opt(False, "Load the base weights in 8 bits with bitsandbytes.")
    use_nested_quant: bool = opt(False, "4-bit only: also quantize the quantization constants (double quant).")
    bnb_4bit_compute_dtype: str = opt("float16", "4-bit only: dtype of the de-quantized matmuls.", choices=DTYPES)
    bnb_4bit_quant_type: str = opt("nf4", "4-bit only: quantization data type.", choices=("nf4", "fp4"))
    bnb_4bit_quant_storage_dtype: str = opt(
        "uint8",
        "4-bit only: dtype the packed 4-bit weights are stored in. FSDP and ZeRO-3 shard it like any tensor, so "
        "it must equal the model dtype (use bfloat16 with bf16).",
        choices=("uint8",) + DTYPES,
    )
    precision: str = opt(
        "fp32_trainable",
        "Mixed-precision policy. fp32_trainable: trainable parameters and optimizer states are fp32 on every backend "
        "(DeepSpeed's fp32 partitions; FSDP/DDP/single process keep the trainable parameters fp32 and compute in "
        "bf16/fp16), so a recipe gives the same curve on FSDP and DeepSpeed. memory_constrained: everything stays in "
        "the bf16/fp16 load dtype (no fp32 master copy): saves 2 bytes per trainable parameter and half the optimizer "
        "states, but small updates round away in bf16 and training can stall or diverge. Not for DeepSpeed, which "
        "always keeps fp32 partitions.",
        choices=("fp32_trainable", "memory_constrained"),
    )
    use_reentrant: bool = opt(
        False, "Gradient checkpointing: use the reentrant implementation (activation_checkpointing_kwargs)."
    )
    max_length_beyond_positions: bool = opt(
        False,
        "Train with a max_length above the positions the model's config.json declares (max_position_embeddings, or its "
        "text_config's) without scaling the rope: tokens past them sit at positions the model never saw. Off: such a "
        "max_length is refused when the recipe is read, unless model_init_kwargs scales the rope (rope_parameters or "
        "rope_scaling with a rope_type) or sets max_position_embeddings. The planner counts max_length either way.",
    )


@dataclass
class DataOptions:
    """Where the data comes from and how it becomes token ids (data.py)."""

    dataset_name: str | None = opt(
        None, "Hub dataset id, local folder (train.jsonl/test.jsonl, parquet, ...) or one json/jsonl/parquet file. "
        "Or use datasets (a mixture), not both."
    )
    datasets: list[dict] | None = opt(
        None,
        "A mixture instead of dataset_name: a list of mappings, one per dataset, with the keys "
        "path (required), name, split, eval_split, weight, samples, columns, format (see DATASET_ENTRY_KEYS in "
        "sftrecipes/recipe/schema.py and README 'Training'). Rows are drawn and shuffled under the recipe's seed. On the "
        "command line: a JSON list, e.g. --datasets '[{\"path\": \"data/a.jsonl\", \"weight\": 0.5}]'.",
        kind="mappings",
    )
    dataset_format: str = opt(
        "auto",
        "Shape of the data. auto reads it from the columns: 'messages' (role/content turns) -> messages; "
        "'conversations' (ShareGPT from/value turns) -> conversations; 'prompt' + 'completion' (TRL's "
        "prompt-completion, plain strings or lists of messages) -> prompt_completion; otherwise the "
        "dataset_text_field column -> text (with chat_template_format: none, a dataset_text_field set in the recipe wins). "
        "Conversational data needs a chat_template_format; text data (text, plain prompt/completion) does not use it. "
        "method dpo/kto: preference ('prompt' + 'chosen' + 'rejected', or 'chosen' + 'rejected' whose shared start is "
        "the prompt; text or lists of messages; kto makes each pair a desirable and an undesirable row) or "
        "unpaired_preference (kto: 'prompt' + 'completion' + 'label'); grpo/rloo: prompt_only ('prompt', text or a list "
        "of messages; the row's other columns reach the reward functions); auto reads them from the columns.",
        choices=("auto", "messages", "conversations", "prompt_completion", "text", "preference", "unpaired_preference",
                 "prompt_only"),
    )
    splits: str = opt(
        "train,test", "Comma-separated splits to load; the one named like 'train' trains, one like 'test' evaluates. "
        "With datasets: each entry's default split and eval_split."
    )
    val_set_size: float | None = opt(None, VAL_SET_SIZE_HELP)  # the rows held out as the eval split: recipe/valset.py
    add_special_tokens: bool = opt(
        False, "Let the tokenizer add its special tokens (e.g. Llama's BOS) when tokenizing each formatted sample. "
        "When the text already starts with BOS (templates that write {{ bos_token }}: Llama-3, Gemma, Mistral), the "
        "added duplicate is removed (logged)."
    )
    append_concat_token: bool = opt(
        False,
        "Append the EOS token to each sample (the separator between packed samples), unless the sample already "
        "ends with the end-of-turn token or EOS (compared on token ids, trailing whitespace aside). Plain "
        "prompt/completion samples always end with EOS, as in TRL.",
    )
    data_cache_dir: str | None = opt(
        None,
        "Where prepared (tokenized, cut, counted) data is kept, one folder per set of inputs that shape the rows (the "
        "data's content, splits, mixture, tokenizer and template, the keys that cut, mask and count): a run whose "
        "learning rate or output_dir changed reads it instead of tokenizing again (`python -m sftrecipes prepare` fills "
        "it before a job). One process prepares, the others wait on its files. None: <HF datasets cache>/sftrecipes-"
        "prepared (HF_DATASETS_CACHE). For runs on several nodes put it on a shared filesystem: then one process of the "
        "whole job prepares; on node-local disks each node prepares its own copy.",
    )
    streaming: bool = opt(
        False,
        "Read the training split as training goes instead of preparing it first (sets larger than memory or than a "
        "preparation's patience): datasets' streaming reader, streaming_buffer_rows rows at a time rendered, tokenized, "
        "cut and counted as a prepared split is, shuffled within the buffer under the seed (rows, then packed rows) and "
        "packed by TRL's packing within the buffer. The stream never ends: at its end the next data epoch starts, so "
        "max_steps is required. Each checkpoint records the position in the stream (stream_position.json): a resumed "
        "run continues with the very next row. Every rank reads the whole stream and trains on its share of each "
        "batch. One dataset_name (not a datasets: mixture), method sft; the eval split is prepared whole as usual. "
        "The counts (read, truncated, dropped, kept, packed rows) are logged per logging window.",
    )
    streaming_buffer_rows: int = opt(
        10000,
        "streaming: rows read, prepared, shuffled and packed together. Larger: better shuffling and packing, more "
        "memory and a longer wait for the first step (measured at 10,000 rows of ~160 tokens: ~0.2 ms a row, ~0.4 GB "
        "per process whatever the data's size: docs/benchmarks.md); a resumed run prepares at most one buffer again. "
        "A checkpoint is resumed with the buffer size it was streamed in.",
    )


# The keys of one `datasets:` entry (validated in validation.py, applied in data.py).
DATASET_ENTRY_KEYS: dict[str, str] = {
    "path": "Required. Hub id, local folder or one json/jsonl/parquet/csv file, as dataset_name takes.",
    "name": "The hub dataset's configuration name (load_dataset's `name`).",
    "split": "The split to train on. Default: the training split named in `splits`.",
    "eval_split": "The split this entry adds to the eval set (all of its rows). Default: the eval split named in "
                  "`splits`, if the source has it; null: none.",
    "weight": "Fraction of the entry's rows drawn into the mixture, > 0: 0.5 draws half of them (under the seed), "
              "2 every row twice. Default 1 (every row once). Not with samples.",
    "samples": "Exact number of rows drawn (under the seed; more than the source has repeats rows). Not with weight.",
    "columns": "Rename columns before the format is read: {column in the data: column the format needs}, e.g. "
               "{question: prompt, answer: completion}.",
    "format": "This entry's dataset_format (default: dataset_format).",
}


@dataclass
class RunOptions(RewardOptions):
    """How the run behaves around training (train.py); the reward functions of grpo/rloo (recipe/rewards.py)."""

    method: str = opt(
        "sft",
        "What the run trains: sft (supervised fine-tuning, TRL's SFTTrainer), dpo (preference pairs, TRL's DPOTrainer: "
        "every loss_type it offers), kto (unpaired desirable/undesirable completions, TRL's KTOTrainer), orpo and cpo "
        "(preference pairs without a reference model: TRL's experimental ORPOTrainer and CPOTrainer, whose loss_type "
        "simpo is SimPO), grpo and rloo (online RL: completions generated from prompt-only rows and scored by "
        "reward_funcs; TRL's GRPOTrainer, whose loss_type picks grpo, dr_grpo, dapo, bnpo, ..., and RLOOTrainer). The "
        "TRL keys are then those of its config class (SFTConfig, DPOConfig, KTOConfig, ORPOConfig, CPOConfig, "
        "GRPOConfig, RLOOConfig; a key of another method's class is refused), and the data is read in that method's "
        "shapes (dataset_format). With LoRA the reference model of dpo, kto and grpo/rloo with beta > 0 is the base "
        "with the adapter disabled (no second copy).",
        choices=METHODS,
    )

    eval_tasks: list[str] | None = opt(None, "After training, score the run on these lm-evaluation-harness tasks, as `python "
                                       "-m sftrecipes eval` does (the main process, once every rank is done): output_dir/"
                                       "lm_eval_results.json, and the figures in run_summary.json (`lm_eval`). Names checked before training.")
    eval_include_path: str | None = opt(None, "eval_tasks: a folder of task YAML files of your own (lm_eval's --include_path).")
    eval_limit: float | None = opt(None, "eval_tasks: at most this many documents a task (below 1: a fraction of each).")
    sample_max_new_tokens: int = opt(
        32,
        "After training, greedily generate this many tokens in reply to the first prompt of the eval split (else the "
        "train split) and log it with the run summary; every rank takes part (ZeRO-3/FSDP need that). 0 turns it off.",
    )
    nan_patience: int = opt(
        0,
        "Stop when the logged loss or gradient norm has been NaN/inf this many times in a row beyond the first (0: at "
        "the first). The final model is then not saved; the last good checkpoint stays, and the run exits 1 naming it.",
    )
    preempt_timeout: int = opt(
        1800,
        "Seconds a preempted run (SIGTERM or SIGUSR1 to `launch`) may take to finish its optimizer step and save a "
        "checkpoint before `launch` kills it (exit 1); also torch's TORCH_ELASTIC_SHUTDOWN_TIMEOUT, so its agent does not "
        "SIGKILL the ranks mid-save. Leave room for the slowest save: a 70B full fine-tune writes ~1 TB of optimizer state.",
    )
    heartbeat_timeout: int = opt(
        120,
        "Multi-process runs: every rank rewrites <output_dir>/.sftrecipes/heartbeat/rank-N.json from a thread every "
        "heartbeat_timeout/10 s (0.5 to 5 s); a rank whose file has not changed for this many seconds (stopped, dead, "
        "its host cut off) ends the run with exit 1 and a line naming its rank, host and pid, within heartbeat_timeout + "
        "2 beats instead of the collective timeout (ddp_timeout). 0 turns it off. Also the bound on the data preparation: "
        "processes waiting for another to prepare the data (data_cache_dir) fail with one line when its heartbeat has "
        "not changed for this long (120 s when 0).",
    )
    force_lock: bool = opt(
        False,
        "Take over the output_dir lock (.sftrecipes.lock) held by a run on another host (a shared filesystem), e.g. one "
        "that crashed there. A holder alive on this host is never overridden; a dead one is taken over without this.",
    )


@dataclass
class LaunchOptions(ServerOptions, SequenceOptions):
    """Where the recipe runs: the `launch:` section (launch/accelerate.py renders it; grpo's vLLM server: serverkeys.py;
    sequence and context parallelism: seqpar.py)."""

    backend: str = opt(
        "none", "Distribution: none (one process), ddp, deepspeed or fsdp.", choices=("none", "ddp", "deepspeed", "fsdp")
    )
    num_machines: int = opt(1, "Number of nodes. The run checks that it has num_machines x gpus_per_node processes.")
    gpus_per_node: int = opt(1, "Processes (one per GPU) on each node.")
    gpu_memory_gb: float | None = opt(None, "Memory of one GPU in GB (decimal), for the memory planner, e.g. 80.")
    cpu_ram_gb: float | None = opt(None, "CPU RAM of one node in GB, for the memory planner (loading, offload).")
    peak_tflops: float | None = opt(
        None, "Peak dense TFLOP/s of one device in the training dtype, for MFU. None: looked up by GPU name "
        "(sftrecipes.train.flops.PEAK_TFLOPS); on the cpu target MFU is reported only when this is set."
    )
    hardware: str = opt(
        "auto",
        "Target hardware. 'auto' picks 'cpu' when torch sees no GPU. The cpu target sets use_cpu, the gloo "
        "backend, DS_ACCELERATOR=cpu and cpu_threads threads per rank.",
        choices=("auto", "gpu", "cpu"),
    )
    cpu_threads: int | None = opt(
        None,
        "cpu target only: torch threads per process. None: the cores this process may use (its CPU affinity: what "
        "SLURM or taskset gave it) divided by the processes on its node, at least 1 — a single process uses the whole "
        "machine, 2 ranks on 2 cores one each. Set it to pin them.",
    )
    main_process_port: int = opt(
        29500, "Rendezvous port of machine rank 0. `launch` uses it when the recipe sets it and on multi-node runs; "
        "a single-node run left at the default takes a free port (MAIN_PROCESS_PORT overrides both)."
    )
    zero_stage: int = opt(3, "deepspeed only: ZeRO stage 0-3.", choices=(0, 1, 2, 3))
    offload_optimizer: bool = opt(False, "deepspeed only: keep optimizer states (and the step) on the CPU. Needs zero_stage 3.")
    offload_params: bool = opt(False, "deepspeed only: keep parameters on the CPU between uses. Needs zero_stage 3.")
    zero3_init: bool = opt(True, "deepspeed zero_stage 3 only: partition weights while loading (zero3_init_flag; 4-bit "
                              "weights: each decoder layer once quantized, sftrecipes/model/quantload.py).")
    fsdp_version: int = opt(2, "fsdp only: 1 (FlatParameter) or 2 (per-parameter DTensor shards).", choices=(1, 2))
    fsdp_sharding_strategy: str = opt(
        "FULL_SHARD", "fsdp only: what is sharded.", choices=("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
    )
    fsdp_state_dict_type: str = opt(
        "SHARDED_STATE_DICT",
        "fsdp only: checkpoint format during training. SHARDED writes one piece per rank (fast, no rank-0 gather); "
        "the final model is saved whole.",
        choices=("SHARDED_STATE_DICT", "FULL_STATE_DICT"),
    )
    fsdp_cpu_ram_efficient_loading: bool = opt(
        True, "fsdp only: rank 0 reads the weights, the other ranks start on the meta device and receive them."
    )
    fsdp_sync_module_states: bool = opt(True, "fsdp only: broadcast rank 0's weights at wrap time (needed by RAM-efficient loading).")
    fsdp_offload_params: bool = opt(False, "fsdp only: keep parameters and gradients on the CPU.")
    fsdp_transformer_layer_cls_to_wrap: list[str] | None = opt(
        None, "fsdp only: the module classes FSDP wraps as units (a list, or one comma-separated string), each a class of "
        "the model (checked in each rank before loading, against the model built on the meta device). None: the model's "
        "own, the classes its _no_split_modules declare (text and vision towers alike) that are present in it."
    )
    slurm_partition: str | None = opt(None, "Multi-node: SLURM partition for the emitted batch script.")
    slurm_time: str = opt("24:00:00", "Multi-node: SLURM time limit.")

    @property
    def world_size(self) -> int:
        """Processes the recipe launches: num_machines x gpus_per_node (one per GPU)."""
        return self.num_machines * self.gpus_per_node

    @property
    def wrap_classes(self) -> list[str] | None:
        """fsdp_transformer_layer_cls_to_wrap as class names: its items split at commas (YAML `A,B`, or
        `--launch.fsdp_transformer_layer_cls_to_wrap A,B` on the command line), blanks dropped; None when unset."""
        named = self.fsdp_transformer_layer_cls_to_wrap
        if named is None:
            return None
        return [c for item in named for c in (part.strip() for part in str(item).split(",")) if c]


SECTIONS: dict[str, type] = {"model": ModelOptions, "data": DataOptions, "run": RunOptions}
NESTED: dict[str, type] = {"launch": LaunchOptions}

# TRL/transformers keys whose default the project sets (key -> (default, why)); shown in --help and docs/generated/options.md.
TRL_DEFAULTS: dict[str, tuple[Any, str]] = {
    "do_train": (True, "sftrecipes' default: train (transformers leaves do_train to the script). do_train: false (or "
                 "max_steps: 0) evaluates the eval split without training: no checkpoint, no adapter or model written, "
                 "a run from an adapter evaluated as the adapter on its base; eval_loss and perplexity land in "
                 "run_summary.json (<output_dir>/eval/run_summary.json where output_dir holds a training run's)."),
    "ddp_timeout": (900, "sftrecipes' default: 15 minutes, not transformers' 30, so that a rank stuck outside a "
                    "collective ends the run sooner (a stopped or dead rank: heartbeat_timeout). Raise it when rank 0 "
                    "alone reads a 70B checkpoint from slow storage for longer. Data preparation is not bound by it: the other "
                    "processes wait on the preparer's files (data_cache_dir), in no collective."),
}

# Keys renamed upstream or spelled differently by the PEFT guide / older TRL. They are accepted and mapped;
# `Recipe.renamed` lists them so the run can say so.
ALIASES: dict[str, str] = {
    "max_seq_len": "max_length",
    "max_seq_length": "max_length",
    "evaluation_strategy": "eval_strategy",
    "torch_dtype": "dtype",
    "warmup_ratio": "warmup_steps",  # transformers 5 reads warmup_steps in [0, 1) as a ratio (checked in recipe.py)
}


# `key: null` (on the command line `--key null`) unsets the key: it takes its default, as if no recipe or base had set
# it (recipe.load_recipe). Except on these keys, where null is a value of its own, not the default; the default of
# one of them is given by writing it (max_length: 1024).
NULL_IS_A_VALUE: dict[str, str] = {
    "max_length": "null: no cut, samples keep their whole length",
    "pad_to_multiple_of": "null: no padding to a multiple; unset: the project pads packed batches under sdpa on a GPU",
}


_ALL: dict[str, dict[str, Option]] = {}


def dpo_loss_types() -> tuple[str, ...]:
    """The loss types DPOConfig's loss_type (a list without declared choices) takes, as its help lists them
    ("Possible values are: `'sigmoid'`, ..."); tests/recipe/test_methods.py holds them against the branches of DPOTrainer's loss."""
    help_ = all_options("dpo")["loss_type"].help
    listed = help_.split("Possible values are:", 1)[1].split(". ", 1)[0]
    return tuple(re.findall(r"`'(\w+)'`", listed))


def trl_rows(method: str) -> list[dict]:
    """The stored fields of a method's TRL config class (CONFIGS)."""
    return load_trl_snapshot()["options"] if method == "sft" else load_methods_snapshot()[method]


def all_options(method: str = "sft") -> dict[str, Option]:
    """name -> Option for every flat key (project + TRL). Launch keys are under 'launch.<name>'. TRL keys are defined
    as `method`'s config class defines them (DPOConfig's loss_type is a list, SFTConfig's a string); the keys of the
    other methods' classes are in the table too, their `methods` naming where they belong (validation refuses them)."""
    if method not in _ALL:
        _ALL[method] = _build_table(method)
    return _ALL[method]


def _build_table(method: str) -> dict[str, Option]:
    table: dict[str, Option] = {}
    by_method = {m: {row["name"]: row for row in trl_rows(m)} for m in METHODS}
    names = list(by_method[method]) + [n for m in METHODS for n in by_method[m] if n not in by_method[method]]
    for name in dict.fromkeys(names):
        owners = tuple(m for m in METHODS if name in by_method[m])
        row = by_method[method].get(name) or by_method[owners[0]][name]
        default, help_ = TRL_DEFAULTS.get(row["name"], (row["default"], None))
        table[row["name"]] = Option(row["name"], row["kind"], default, " ".join(filter(None, [row["help"], help_])),
                                    tuple(row["choices"]) if row["choices"] else None, row["nullable"], "trl",
                                    None if len(owners) == len(METHODS) else owners)
    for row in load_peft_snapshot()["options"]:
        if row["name"] in PEFT_NOT_EXPOSED:
            continue
        if row["name"] in table:
            raise RuntimeError(f"option {row['name']} declared by both TRL and peft's LoraConfig")
        help_ = " ".join(filter(None, [row["help"], PEFT_NOTES.get(row["name"])]))
        table[row["name"]] = Option(row["name"], row["kind"], row["default"], help_,
                                    tuple(row["choices"]) if row["choices"] else None, row["nullable"], "peft")
    for owner, cls in SECTIONS.items():
        for o in options_of(cls, owner):
            if o.name in table:
                raise RuntimeError(f"option {o.name} declared by both TRL and {cls.__name__}")
            table[o.name] = o
    for section, cls in NESTED.items():
        for o in options_of(cls, section):
            table[f"{section}.{o.name}"] = dataclasses.replace(o, name=f"{section}.{o.name}")
    return table
