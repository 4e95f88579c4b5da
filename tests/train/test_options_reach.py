"""No key is ever silently ignored: change each option and see it arrive where it acts.

* Every TRL/transformers option (all of SFTConfig, read from the live class) is set to a non-default value and
  must come out of the SFTConfig the trainer is built with.
* Every project option has an observer below that finds its effect on the tokenizer, model, datasets or
  trainer arguments. A new option without an observer fails `test_every_project_option_has_an_observer`.
"""

import json
import os
import shutil
from types import SimpleNamespace
from unittest import mock

import datasets
import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file
from conftest import free_port, run_cli
from test_data import first_batch, trainer_for
from test_lifecycle import fake_agent_preemption
from transformers import AutoModelForCausalLM, TrainerControl, TrainerState

import train
from sftrecipes import plan
from sftrecipes.train import args as backends
from sftrecipes.train import devices
from sftrecipes.recipe.target import cpu_env
from sftrecipes.launch.accelerate import accelerate_config
from sftrecipes.data import load as data
from sftrecipes.launch import emit
from sftrecipes.run import heartbeats
from sftrecipes.train import methods
from sftrecipes.model import load as models
from sftrecipes.model import attnchoice
from sftrecipes.model import wrapping
from sftrecipes.train import nonfinite
from sftrecipes.launch import preflight
from sftrecipes.run import runlock
from sftrecipes.data import stream as streams
from sftrecipes.data import tokenization
from sftrecipes.core.errors import RecipeError
from sftrecipes.model.lora import lora_config
from sftrecipes.recipe.load import load_recipe
from sftrecipes.recipe.schema import CONFIGS, METHODS, ONLINE
from sftrecipes.recipe.schema import all_options
from sftrecipes.tiny import ensure_family
from sftrecipes.data.tokenizer import load_tokenizer


BASE = ["--model_name_or_path", ".assets/tiny-llama", "--dataset_name", "data/tiny_chat", "--output_dir", "outputs/reach"]

# Options whose probe needs a companion setting or whose effect is checked differently (key -> (value, extras, check)).
SPECIAL = {
    "output_dir": ("outputs/elsewhere", {}, lambda a: a.output_dir == "outputs/elsewhere"),
    "fp16": (True, {}, lambda a: a.bf16 and not a.fp16),  # cpu target: fp16 autocast runs as bf16 (warned)
    "tf32": (True, {}, lambda a: a.tf32 is None),  # cpu target: a GPU matmul mode, dropped with a warning
    "ddp_backend": ("nccl", {}, lambda a: a.ddp_backend is None),  # single process: no process group (logged)
    "activation_checkpointing_kwargs": ({"probe": 1}, {}, lambda a: a.activation_checkpointing_kwargs == {"probe": 1, "use_reentrant": False}),
    "gradient_checkpointing_kwargs": ({"probe": 1}, {}, lambda a: a.activation_checkpointing_kwargs == {"probe": 1, "use_reentrant": False}),
    "load_best_model_at_end": (True, {"eval_strategy": "steps", "save_strategy": "steps"}, lambda a: a.load_best_model_at_end),
    "accelerator_config": ({"split_batches": True}, {}, lambda a: a.accelerator_config.split_batches),
    "dataloader_prefetch_factor": (4, {"dataloader_num_workers": 1}, lambda a: a.dataloader_prefetch_factor == 4),
    "fsdp": ("full_shard auto_wrap", {}, lambda a: a.fsdp is True and a.fsdp_config["reshard_after_forward"]),
    "deepspeed": ({"zero_optimization": {"stage": 2}}, {}, lambda a: a.hf_deepspeed_config.config["zero_optimization"]["stage"] == 2),
    "use_liger_kernel": (True, {"bf16": False}, lambda a: a.use_liger_kernel is True),  # gpu target (GPU_ONLY) on a CPU machine
    "padding_free": (True, {"packing": True}, lambda a: a.padding_free is True),  # without packing: refused (sources.TRL_DATA_KEYS)
    "activation_offloading": (True, {"bf16": False}, None),  # gpu target (GPU_ONLY) on a CPU machine
    "max_length": (1000, {}, None),  # within the tiny model's 1024 positions (past them: refused, limits.check_positions)
}
# Applied by the data pipeline, not by SFTConfig: observed in tests/data/test_data.py and tests/train/test_train.py.
PIPELINE = {
    "assistant_only_loss": "test_data.py::test_assistant_only_loss_masks_everything_but_assistant_turns",
    "completion_only_loss": "test_data.py::test_prompt_completion_trains_the_completion_only_as_trl_does",
    "resume_from_checkpoint": "test_train.py::test_resume_auto_continues_to_the_same_weights",
    "chat_template_path": "test_data.py::test_chat_template_path_is_the_template_the_data_is_tokenized_with",
}


def probe_value(o):
    d = o.default
    if o.choices:
        return next(c for c in o.choices if c != d)
    make = {
        "bool": lambda: (not d) if d is not None else True,
        "int": lambda: (d or 0) + 2,
        "float": lambda: round((d or 0) * 0.5 + 0.25, 4) if (d or 0) <= 1 else d + 1,
        "str": lambda: "probe-value",
        "list": lambda: ["probe"],
        "dict": lambda: {"probe": 1},
        "int|str": lambda: 16,
        "bool|str": lambda: "non_padding",
    }
    return make[o.kind]()


# Refused with a one-line error (test_recipe.py), so they cannot be silently ignored either.
# generate_during_eval (orpo, cpo) logs to W&B or Comet, not installed here: refused (test_methods.py)
REFUSED_BY_METHOD = {"generate_during_eval": "test_methods.py::test_keys_of_another_method_are_refused"}
REFUSED = {"enable_jit_checkpoint": "the run handles SIGTERM/SIGUSR1 itself (lifecycle.py); test_recipe.py::test_bad_recipe_is_one_line_error",
           "dataset_kwargs": "sources.TRL_DATA_KEYS; test_data.py::test_refused_data_keys_are_one_line_errors_and_the_fix_loads"}
# Refused on the cpu target or without the package by preflight.in_run (test_train.py::test_liger_is_refused_without_a_gpu_or_its_package):
# probed on the gpu target.
GPU_ONLY = {"use_liger_kernel", "activation_offloading"}  # (activation_offloading: refused on the cpu target, limits.py)
# (method, key): every SFTConfig key under sft; under the preference methods the keys of their config class that
# SFTConfig lacks or defines differently (the keys they all share reach it alike)
TRL_KEYS = sorted([("sft", n) for n, o in all_options().items() if o.owner == "trl" and not o.methods
                   and n not in PIPELINE and n not in REFUSED and o.kind != "object"]
                  + [(m, n) for m in METHODS[1:] for n, o in all_options(m).items() if o.owner == "trl"
                     and n not in REFUSED_BY_METHOD and ((o.methods and m in o.methods) or (o.kind, o.default) != (all_options()[n].kind, all_options()[n].default))])
SPECIAL_BY_METHOD = {("dpo", "loss_type"): (["ipo", "hinge"], {}, None),  # a list of DPOTrainer's loss types
                     ("dpo", "loss_weights"): ([0.5], {}, None),
                     ("dpo", "padding_free"): (True, {}, None),  # (SFT's needs packing, a key DPOConfig lacks)
                     # grpo/rloo: a generation batch of whole groups (the base's batch of 8 per step), a list of weights
                     **{(m, "generation_batch_size"): (16, {}, None) for m in ONLINE},
                     **{(m, "reward_weights"): ([0.5], {}, None) for m in ONLINE},
                     ("grpo", "num_generations"): (4, {}, None),
                     ("grpo", "log_completions_hub_repo"): ("me/completions", {"log_completions": True}, None),
                     ("rloo", "reward_clip_range"): ([-1.0, 1.0], {}, None)}


@pytest.mark.parametrize("method,key", TRL_KEYS)
def test_trl_option_reaches_training_args(tiny_model, method, key):
    o = all_options(method)[key]
    value, extras, check = SPECIAL_BY_METHOD.get((method, key)) or SPECIAL.get(key, (probe_value(o), {}, None))
    argv = [a for a in BASE if key != "output_dir" or a not in ("--output_dir", "outputs/reach")]
    online = {"reward_funcs": ["exact_answer"]} if method in ONLINE else {}  # (grpo/rloo need one)
    r = load_recipe(argv, overrides={"method": method, **online, key: value, **extras})
    args = backends.training_args(r, "gpu" if key in GPU_ONLY else "cpu")
    assert type(args).__name__ == CONFIGS[method]
    if check is not None:
        assert check(args), key
    else:
        got = getattr(args, key)
        assert getattr(got, "value", got) == value, f"{key}: set {value!r}, trainer sees {got!r}"


def test_object_options_are_refused():
    objects = [n for n, o in all_options().items() if o.kind == "object"]
    assert objects == ["parallelism_config"]  # refused with a one-line error: see test_recipe.py


# ------------------------------------------------------------------------------------------ project options


def recipe(*flags):
    return load_recipe(BASE + [str(f) for f in flags])


def tokenized(r):
    tok, eot, _ = load_tokenizer(r)
    train, _ = data.load_raw(r)
    return tok, tokenization.prepare(r, tok, eot, train.select(range(min(3, len(train)))), "train")


def obs_method(tiny_model, tmp_path):
    """The trainer and its config class; that each method trains: tests/train/test_preference_train.py."""
    import trl
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    for method, trainer in (("sft", trl.SFTTrainer), ("dpo", trl.DPOTrainer), ("kto", trl.KTOTrainer),
                            ("orpo", ORPOTrainer), ("cpo", CPOTrainer)):
        r = recipe("--method", method)
        assert methods.trainer_class(r) is trainer and type(backends.training_args(r, "cpu")).__name__ == CONFIGS[method]


def obs_model_name(tiny_model, tmp_path):
    other = tmp_path / "copy"
    shutil.copytree(tiny_model, other)
    r = recipe("--model_name_or_path", other)
    tok, _, _ = load_tokenizer(r)
    assert models.load_model(r, tok, "cpu").name_or_path == str(other) and tok.name_or_path == str(other)


def obs_tokenizer_name(tiny_model, tmp_path):
    other = tmp_path / "tok"
    shutil.copytree(tiny_model, other)
    tok, _, _ = load_tokenizer(recipe("--tokenizer_name_or_path", other))
    assert tok.name_or_path == str(other)


def obs_dtype(tiny_model, tmp_path):
    r = recipe("--dtype", "bfloat16")
    tok, _, _ = load_tokenizer(r)
    assert models.load_model(r, tok, "cpu").dtype == torch.bfloat16
    assert models.load_dtype(recipe()) == torch.float32


def obs_chat_template_format(tiny_model, tmp_path):
    tok, ds = tokenized(recipe("--chat_template_format", "zephyr"))
    assert "<|assistant|>" in tok.decode(ds[0]["input_ids"])


def obs_use_flash_attn(tiny_model, tmp_path, caplog=None):
    r = recipe("--use_flash_attn", "True")
    assert attnchoice.attn_implementation(recipe(), "gpu") == "sdpa"
    assert attnchoice.attn_implementation(r, "cpu") == "sdpa"  # asked, but no GPU: the warned fallback

    with mock.patch.object(attnchoice, "flash_attn_installed", return_value=True):
        assert attnchoice.attn_implementation(recipe("--use_flash_attn", "True", "--bf16", "True"), "gpu") == "flash_attention_2"
        with pytest.raises(RecipeError, match="flash_attention_2 computes in bf16/fp16 only"):  # fp32 without autocast
            attnchoice.attn_implementation(r, "gpu")


def obs_attn_implementation(tiny_model, tmp_path):
    r = recipe("--attn_implementation", "eager")
    tok, _, _ = load_tokenizer(r)
    assert models.load_model(r, tok, "cpu").config._attn_implementation == "eager"
    assert models.load_model(recipe(), tok, "cpu").config._attn_implementation == "sdpa"  # auto, for a Llama
    assert models.load_model(recipe("--attn_implementation", "sft_varlen"), tok, "cpu").config._attn_implementation == "sft_varlen"
    assert models.load_model(recipe("--packing", "true"), tok, "cpu").config._attn_implementation == "sft_varlen"  # auto, packed


def lora(*flags):
    return lora_config(recipe("--use_peft_lora", "True", *flags), [])


def obs_use_peft_lora(tiny_model, tmp_path):
    assert lora_config(recipe(), []) is None and lora() is not None


def obs_lora_r(tiny_model, tmp_path):
    assert lora("--lora_r", 4).r == 4


def obs_lora_alpha(tiny_model, tmp_path):
    assert lora("--lora_alpha", 7).lora_alpha == 7


def obs_lora_dropout(tiny_model, tmp_path):
    assert lora("--lora_dropout", 0.3).lora_dropout == 0.3


def obs_lora_target_modules(tiny_model, tmp_path):
    assert lora("--lora_target_modules", "q_proj,v_proj").target_modules == {"q_proj", "v_proj"}
    assert lora("--lora_target_modules", "all-linear").target_modules == "all-linear"


def obs_lora_target_router(tiny_model, tmp_path):
    """The router of an MoE model gets LoRA only with the key (the MoE runs in test_lora.py see it in the adapter)."""

    moe = str(ensure_family("qwen3_moe"))

    def router_adapted(*flags):
        r = load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path", moe, *flags])
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(moe), lora_config(r, [], AutoModelForCausalLM.from_pretrained(moe)))
        return any(".mlp.gate.lora_A" in n for n, p in model.named_parameters() if p.requires_grad)

    assert router_adapted("--lora_target_router", "true") and not router_adapted()


def qc(*flags):
    return models.quantization_config(recipe("--use_peft_lora", "True", "--use_4bit_quantization", "True", *flags))


def obs_use_4bit_quantization(tiny_model, tmp_path):
    assert qc().load_in_4bit and models.quantization_config(recipe()) is None


def obs_use_8bit_quantization(tiny_model, tmp_path):
    assert models.quantization_config(recipe("--use_peft_lora", "True", "--use_8bit_quantization", "True")).load_in_8bit


def obs_use_nested_quant(tiny_model, tmp_path):
    assert qc("--use_nested_quant", "True").bnb_4bit_use_double_quant and not qc().bnb_4bit_use_double_quant


def obs_bnb_4bit_compute_dtype(tiny_model, tmp_path):
    assert qc("--bnb_4bit_compute_dtype", "bfloat16").bnb_4bit_compute_dtype == torch.bfloat16


def obs_bnb_4bit_quant_type(tiny_model, tmp_path):
    assert qc("--bnb_4bit_quant_type", "fp4").bnb_4bit_quant_type == "fp4"


def obs_bnb_4bit_quant_storage_dtype(tiny_model, tmp_path):
    r = recipe("--use_peft_lora", "True", "--use_4bit_quantization", "True", "--bnb_4bit_quant_storage_dtype", "bfloat16")
    assert models.quantization_config(r).bnb_4bit_quant_storage == torch.bfloat16
    assert models.load_dtype(r) == torch.bfloat16  # the model dtype follows the storage dtype


def obs_use_reentrant(tiny_model, tmp_path):
    args = backends.training_args(recipe("--gradient_checkpointing", "True", "--use_reentrant", "True"), "cpu")
    assert args.activation_checkpointing_kwargs["use_reentrant"] is True


def obs_max_length_beyond_positions(tiny_model, tmp_path):
    """A max_length past the model's 1024 positions is taken as asked, and planned at that length."""
    from sftrecipes.plan import plan_recipe

    with pytest.raises(RecipeError, match="max_length_beyond_positions: true"):
        recipe("--max_length", 2048)
    plan = plan_recipe(recipe("--max_length", 2048, "--max_length_beyond_positions", "true"), _alternatives=False)
    assert any("x 2048 tokens" in i.note for i in plan.live[plan.peak_phase])


def obs_dataset_name(tiny_model, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "zebra"}]}) + "\n")
    tok, ds = tokenized(recipe("--dataset_name", f, "--splits", "train", "--chat_template_format", "chatml"))
    assert "zebra" in tok.decode(ds[0]["input_ids"])


def obs_dataset_format(tiny_model, tmp_path):
    f = tmp_path / "both.jsonl"
    f.write_text(json.dumps({"prompt": "Question?", "completion": " Answer.", "text": "Other words."}) + "\n")
    tok, ds = tokenized(recipe("--dataset_name", f, "--splits", "train"))  # auto: prompt/completion, completion trained
    assert -100 in ds[0]["labels"] and "Question?" in tok.decode(ds[0]["input_ids"])
    tok, ds = tokenized(recipe("--dataset_name", f, "--splits", "train", "--dataset_format", "text"))
    assert tok.decode(ds[0]["input_ids"]) == "Other words." and ds[0]["labels"] == ds[0]["input_ids"]


def obs_datasets(tiny_model, tmp_path):
    entries = [{"path": "data/tiny_chat", "samples": 7}, {"path": "data/tiny_chat", "split": "test", "weight": 0.5}]
    r = load_recipe(["--model_name_or_path", ".assets/tiny-llama", "--output_dir", "outputs/reach", "--chat_template_format",
                     "chatml", "--datasets", json.dumps(entries)])
    tok, eot, _ = load_tokenizer(r)
    train, _, _, counts = data.load_datasets(r, tok, eot)
    assert len(train) == 7 + 20 and [s["rows"] for s in counts["mixture"]["sources"]] == [7, 20]


def obs_splits(tiny_model, tmp_path):
    assert data.load_raw(recipe("--splits", "train"))[1] is None and len(data.load_raw(recipe())[1]) == 40


def obs_val_set_size(tiny_model, tmp_path):  # (the rows themselves: tests/data/test_held_out_rows.py)
    train, evals = data.load_raw(recipe("--splits", "train", "--val_set_size", "0.25"))
    assert (len(train), len(evals)) == (240, 80)  # a quarter of the 320 training rows held out as the eval split


def obs_data_cache_dir(tiny_model, tmp_path):
    r = recipe("--chat_template_format", "chatml", "--splits", "train", "--data_cache_dir", tmp_path / "prepared")
    tok, eot, _ = load_tokenizer(r)
    entry = data.prepared_datasets(r, tok, eot)[3]["preparation"]["path"]  # (tests/data/test_prepcache.py: the cache itself)
    assert os.path.dirname(entry) == str(tmp_path / "prepared") and os.path.isfile(os.path.join(entry, "complete"))


def obs_streaming(tiny_model, tmp_path):
    """The training rows come from the stream (an endless IterableDataset of prepared, packed rows; stream.py) and
    SFTTrainer neither prepares them again nor skips batches on a resume (tests/data/test_stream.py: the rows themselves)."""
    r = recipe("--chat_template_format", "chatml", "--streaming", "True", "--max_steps", "3", "--packing", "True", "--max_length", "128")
    tok, eot, _ = load_tokenizer(r)
    ds = streams.streamed_datasets(r, tok, eot)[0].dataset(8)
    assert isinstance(ds, datasets.IterableDataset) and set(next(iter(ds))) == {"input_ids", "labels", "seq_lengths"}
    kw = backends.training_kwargs(r, "cpu")
    assert kw["dataset_kwargs"] == {"skip_prepare_dataset": True} and kw["ignore_data_skip"] is True
    assert "dataset_kwargs" not in backends.training_kwargs(recipe(), "cpu")


def obs_streaming_buffer_rows(tiny_model, tmp_path):
    r = recipe("--chat_template_format", "chatml", "--streaming", "True", "--max_steps", "3", "--streaming_buffer_rows", "7")
    tok, eot, _ = load_tokenizer(r)
    stream = streams.streamed_datasets(r, tok, eot)[0]
    next(stream.rows())
    assert stream.counts["read"] == 7 and stream.history[0].rows == stream.counts["kept"] == 7  # (unpacked here)


def obs_add_special_tokens(tiny_model, tmp_path):
    tok, ds = tokenized(recipe("--chat_template_format", "chatml", "--add_special_tokens", "True"))
    assert ds[0]["input_ids"][0] == tok.bos_token_id


def obs_append_concat_token(tiny_model, tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"text": "plain text"}) + "\n")
    tok, ds = tokenized(recipe("--dataset_name", f, "--splits", "train", "--append_concat_token", "True"))
    assert ds[0]["input_ids"][-1] == tok.eos_token_id


def obs_launch_hardware(tiny_model, tmp_path):
    assert devices.hardware(recipe("--launch.hardware", "gpu")) == "gpu" and devices.hardware(recipe()) == "cpu"


def obs_launch_cpu_threads(tiny_model, tmp_path):
    """Pinned: the launcher's environment and the rank's torch threads; unset: the cores this process may use over
    the processes on its node (2 ranks on this 2-core machine: one each)."""
    import torch

    assert cpu_env(recipe("--launch.cpu_threads", 3))["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in cpu_env(recipe())
    before, env = torch.get_num_threads(), dict(os.environ)
    cores = len(os.sched_getaffinity(0))
    try:
        for flags, local, want in ((["--launch.cpu_threads", 3], "1", 3), ([], "1", cores), ([], "2", max(1, cores // 2))):
            os.environ["LOCAL_WORLD_SIZE"] = local
            backends.apply_process_env(recipe(*flags), "cpu")
            assert torch.get_num_threads() == want and os.environ["OMP_NUM_THREADS"] == str(want), (flags, local, want)
    finally:
        torch.set_num_threads(before)
        os.environ.clear()
        os.environ.update(env)


def obs_launch_num_machines(tiny_model, tmp_path):
    with pytest.raises(RecipeError, match="describes 2 processes"):
        preflight.check_world_size(recipe("--launch.backend", "ddp", "--launch.num_machines", 2))


def obs_launch_gpus_per_node(tiny_model, tmp_path):
    with pytest.raises(RecipeError, match="describes 4 processes"):
        preflight.check_world_size(recipe("--launch.backend", "ddp", "--launch.gpus_per_node", 4))
    assert preflight.check_world_size(recipe()) == 1


def acc(*flags):
    return accelerate_config(recipe(*flags))


def obs_launch_backend(tiny_model, tmp_path):
    assert acc("--launch.backend", "deepspeed", "--launch.gpus_per_node", 2)["distributed_type"] == "DEEPSPEED"
    assert acc("--launch.backend", "ddp", "--launch.gpus_per_node", 2)["distributed_type"] == "MULTI_GPU"
    assert acc("--launch.backend", "fsdp", "--launch.gpus_per_node", 2)["distributed_type"] == "FSDP"


def obs_launch_gpu_memory_gb(tiny_model, tmp_path):
    with pytest.raises(RecipeError, match="needs 2 GPU\\(s\\) of 41 GB per node"):
        preflight.before_launch(recipe("--launch.backend", "ddp", "--launch.gpus_per_node", 2, "--launch.gpu_memory_gb", 41))


def obs_launch_main_process_port(tiny_model, tmp_path):
    port = free_port()  # rendered only, never bound; still not a number another test could hold
    assert acc("--launch.main_process_port", port)["main_process_port"] == port


def ds(*flags):
    return acc("--launch.backend", "deepspeed", "--launch.gpus_per_node", 2, *flags)["deepspeed_config"]


def obs_launch_zero_stage(tiny_model, tmp_path):
    assert ds("--launch.zero_stage", 2)["zero_stage"] == 2 and ds()["zero_stage"] == 3


def obs_launch_offload_optimizer(tiny_model, tmp_path):
    assert ds("--launch.offload_optimizer", "True")["offload_optimizer_device"] == "cpu"


def obs_launch_offload_params(tiny_model, tmp_path):
    assert ds("--launch.offload_params", "True")["offload_param_device"] == "cpu"


def obs_launch_zero3_init(tiny_model, tmp_path):
    assert ds("--launch.zero3_init", "False")["zero3_init_flag"] is False and ds()["zero3_init_flag"] is True


def fsdp(*flags):
    return acc("--launch.backend", "fsdp", "--launch.gpus_per_node", 2, *flags)["fsdp_config"]


def obs_launch_fsdp_version(tiny_model, tmp_path):
    assert fsdp("--launch.fsdp_version", 1)["fsdp_version"] == 1


def obs_launch_fsdp_sharding_strategy(tiny_model, tmp_path):
    assert fsdp("--launch.fsdp_sharding_strategy", "SHARD_GRAD_OP")["fsdp_reshard_after_forward"] is False
    assert fsdp("--launch.fsdp_version", 1, "--launch.fsdp_sharding_strategy", "HYBRID_SHARD")["fsdp_sharding_strategy"] == "HYBRID_SHARD"


def obs_launch_fsdp_state_dict_type(tiny_model, tmp_path):
    assert fsdp("--launch.fsdp_state_dict_type", "FULL_STATE_DICT")["fsdp_state_dict_type"] == "FULL_STATE_DICT"


def obs_launch_fsdp_cpu_ram_efficient_loading(tiny_model, tmp_path):
    assert fsdp("--launch.fsdp_cpu_ram_efficient_loading", "False")["fsdp_cpu_ram_efficient_loading"] is False


def obs_launch_fsdp_sync_module_states(tiny_model, tmp_path):
    flags = ("--launch.fsdp_version", 1, "--launch.fsdp_cpu_ram_efficient_loading", "False", "--launch.fsdp_sync_module_states", "False")
    assert fsdp(*flags)["fsdp_sync_module_states"] is False


def obs_launch_fsdp_offload_params(tiny_model, tmp_path):
    assert fsdp("--launch.fsdp_offload_params", "True")["fsdp_offload_params"] is True


def obs_launch_fsdp_transformer_layer_cls_to_wrap(tiny_model, tmp_path):
    flags = ("--launch.fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer,LlamaMLP")
    assert fsdp(*flags)["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer,LlamaMLP"  # the launcher exports it
    assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp()  # unset: each rank names the model's own
    with mock.patch.dict("os.environ"), mock.patch.object(wrapping, "_wrap_set_here", {}):  # what the rank tells accelerate
        os.environ.pop(wrapping.FSDP_WRAP_ENV, None)
        r = recipe("--launch.backend", "fsdp", "--launch.gpus_per_node", 2, *flags)
        assert wrapping.fsdp_wrap_classes(r) == ["LlamaDecoderLayer", "LlamaMLP"]
        assert os.environ[wrapping.FSDP_WRAP_ENV] == "LlamaDecoderLayer,LlamaMLP"


def slurm_text(*flags):
    r = recipe("--launch.backend", "ddp", "--launch.num_machines", 2, *flags)
    return emit.slurm_script(r, "recipes/x.yaml", "x")


def obs_launch_slurm_partition(tiny_model, tmp_path):
    assert "#SBATCH --partition=gpu-long\n" in slurm_text("--launch.slurm_partition", "gpu-long")


def obs_launch_slurm_time(tiny_model, tmp_path):
    assert "#SBATCH --time=2-00:00:00\n" in slurm_text("--launch.slurm_time", "2-00:00:00")


def obs_launch_cpu_ram_gb(tiny_model, tmp_path):
    flags = ("--launch.backend", "ddp", "--launch.gpus_per_node", 2)
    assert plan.plan_recipe(recipe(*flags, "--launch.cpu_ram_gb", 0.001)).cpu_fits is False
    assert plan.plan_recipe(recipe(*flags, "--launch.cpu_ram_gb", 1000)).cpu_fits is True


def obs_sample_max_new_tokens(tiny_model, tmp_path):
    common = ["--max_steps", 1, "--output_dir", tmp_path, "--launch.hardware", "cpu"]
    _, summary = train.run(recipe("--chat_template_format", "chatml", "--sample_max_new_tokens", 3, *common))
    assert 0 < len(summary["sample"]["reply"]) and summary["sample"]["prompt"][-1]["role"] == "user"
    _, summary = train.run(recipe("--chat_template_format", "chatml", "--sample_max_new_tokens", 0, *common))
    assert summary["sample"]["reply"] is None


def obs_launch_peak_tflops(tiny_model, tmp_path):
    _, summary = train.run(recipe("--chat_template_format", "chatml", "--max_steps", 3, "--output_dir", tmp_path, "--launch.peak_tflops", 0.5,
                                  "--sample_max_new_tokens", 0))
    t = summary["throughput"]
    assert t["peak_tflops"] == 0.5 and t["mfu"] == pytest.approx(t["model_tflops_per_device"] / 0.5)


def obs_precision(tiny_model, tmp_path):
    base = ("--bf16", "True")
    r = recipe(*base, "--precision", "memory_constrained")
    args = backends.training_args(r, "cpu")
    assert models.load_dtype(r) == torch.bfloat16 and not args.bf16  # the weights themselves are bf16, no autocast
    assert models.load_dtype(recipe(*base)) == torch.float32 and backends.training_args(recipe(*base), "cpu").bf16


def obs_nan_patience(tiny_model, tmp_path):
    guard = nonfinite.nonfinite_guard(recipe("--nan_patience", 2).run.nan_patience)
    control, state = TrainerControl(), TrainerState()
    for _ in range(3):
        assert not control.should_training_stop
        guard.on_log(SimpleNamespace(logging_steps=1), state, control, logs={"loss": 1.0, "grad_norm": float("nan")})
    assert control.should_training_stop and "nan_patience 2" in guard.stopped


def obs_preempt_timeout(tiny_model, tmp_path):
    code, waited, agent_sees = fake_agent_preemption(tmp_path, preempt_timeout=2)  # a save that never comes
    assert code == 1 and 2 <= waited < 4 and agent_sees == "2"


def obs_heartbeat_timeout(tiny_model, tmp_path):
    heartbeats.Heartbeat(tmp_path, rank=1)
    watch = heartbeats.Watch(tmp_path, recipe("--heartbeat_timeout", 5).run.heartbeat_timeout)
    assert watch.stale(now=0) == [] and watch.stale(now=4.9) == [] and watch.stale(now=5)[0]["rank"] == 1


def obs_force_lock(tiny_model, tmp_path):
    (tmp_path / runlock.LOCK).write_text(json.dumps({"host": "another-host", "pid": 1, "since": "then", "token": "t"}))
    with pytest.raises(RecipeError, match="another host"):
        runlock.take_lock(tmp_path, recipe().run.force_lock)
    runlock.take_lock(tmp_path, recipe("--force_lock", True).run.force_lock)
    assert json.loads((tmp_path / runlock.LOCK).read_text())["host"] != "another-host"


_EVAL: dict = {}


def _eval_run(tmp_path):
    """One 2-step run of train.py, as users start it, with eval_tasks (tinymc, a local task of 20 questions, from
    eval_include_path) limited to 5 documents: its output_dir, shared by the three eval_* observers."""
    if "out" not in _EVAL:
        out = tmp_path / "eval-tasks"
        res = run_cli(["train.py", *BASE, "--chat_template_format", "chatml", "--max_steps", "2", "--sample_max_new_tokens",
                       "0", "--eval_tasks", "tinymc", "--eval_include_path", "tests/use/tasks", "--eval_limit", "5",
                       "--output_dir", str(out)])
        assert res.returncode == 0, res.stderr[-3000:]
        _EVAL["out"] = out
    out = _EVAL["out"]
    return json.loads((out / "lm_eval_results.json").read_text()), json.loads((out / "run_summary.json").read_text()), out


def _grpo_rewards(*flags):
    from sftrecipes.train.rewards import reward_functions

    return reward_functions(load_recipe(["recipes/tiny/grpo.yaml", *flags]))


def obs_reward_funcs(tiny_model, tmp_path):
    """Each entry becomes the function TRL calls, in order: a built-in, and the user's own from its file."""
    fmt, brevity = _grpo_rewards("--reward_funcs", "format", "recipes/tiny/rewards.py:brevity", "--reward_weights", "1", "1")
    assert fmt.__name__ == "format" and brevity.__module__.startswith("sftrecipes_reward_")
    assert brevity(prompts=["q"], completions=["a"], completion_ids=[[1, 2, 3]]) == [0.75]


def obs_reward_answer_column(tiny_model, tmp_path):
    exact = _grpo_rewards("--reward_answer_column", "solution")[1]
    assert exact(prompts=["q", "q"], completions=["7", "7"], solution=["7", "8"]) == [1.0, 0.0]


def obs_reward_format_regex(tiny_model, tmp_path):
    fmt = _grpo_rewards("--reward_funcs", "format", "--reward_weights", "1", "--reward_format_regex", "x+")[0]
    assert fmt(prompts=["q", "q"], completions=["xxx", "xy"]) == [1.0, 0.0]


def obs_reward_length_cache(tiny_model, tmp_path):
    length = _grpo_rewards("--reward_funcs", "length", "--reward_weights", "1", "--reward_length_cache", "2",
                           "--max_completion_length", "10")[0]
    assert length(prompts=["q"] * 2, completions=["a"] * 2, completion_ids=[[1] * 8, [1] * 9]) == [0.0, -0.5]


def _server(*flags):
    from sftrecipes.launch import genserver

    r = load_recipe(["recipes/llama3.1-70b/grpo-lora.yaml", *flags])
    return genserver.plan(r, {}, 0, lambda: 8123)


def obs_launch_vllm_server_gpus(tiny_model, tmp_path):
    """The server gets the GPUs after the ranks' (its tensor-parallel size of them), the ranks keep theirs."""
    g = _server("--launch.gpus_per_node", "6", "--launch.vllm_server_gpus", "2", "--vllm_tensor_parallel_size", "2")
    assert g.server.env == {"CUDA_VISIBLE_DEVICES": "6,7"} and g.rank_env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}
    assert g.server.argv[g.server.argv.index("--tensor_parallel_size") + 1] == "2"


def obs_launch_vllm_server_python(tiny_model, tmp_path):
    g = _server("--launch.vllm_server_python", "/opt/vllm-env/bin/python")
    assert g.server.argv[:3] == ["/opt/vllm-env/bin/python", "-m", "trl.scripts.vllm_serve"]


def obs_launch_sequence_parallel_size(tiny_model, tmp_path):
    """Rendered for accelerate, and each rank's ParallelismConfig: 4 ranks in 2 groups of 2, the batch's length a
    multiple of 2 (what it trains like: tests/train/test_seqpar.py)."""
    from sftrecipes.train import args as backends, seqpar

    flags = ("--launch.backend", "deepspeed", "--launch.zero_stage", 2, "--launch.gpus_per_node", 4,
             "--launch.sequence_parallel_size", 2)
    assert acc(*flags)["parallelism_config"] == {"parallelism_config_sp_size": 2, "parallelism_config_sp_backend": "deepspeed",
                                                 "parallelism_config_sp_seq_length_is_variable": True}
    assert "parallelism_config" not in acc("--launch.backend", "deepspeed", "--launch.gpus_per_node", 4)
    pc = seqpar.parallelism_config(recipe(*flags), "sft_varlen")
    assert (pc.sp_size, pc.sp_backend, pc.dp_replicate_size, pc.sp_handler.sp_attn_implementation) == (2, "deepspeed", 2, "sdpa")
    assert backends.training_kwargs(recipe(*flags, "--pad_to_multiple_of", 8), "cpu")["pad_to_multiple_of"] == 8
    assert backends.training_kwargs(recipe(*flags), "cpu")["pad_to_multiple_of"] == 2


def obs_launch_context_parallel_size(tiny_model, tmp_path):
    """Rendered for accelerate and each rank (FSDP2 on GPUs; refused on the cpu target: bad_inputs' cp_on_cpu)."""
    from sftrecipes.train import seqpar

    flags = ("--launch.backend", "fsdp", "--launch.hardware", "gpu", "--launch.gpus_per_node", 4, "--packing", "false",
             "--launch.context_parallel_size", 2)
    assert acc(*flags)["parallelism_config"] == {"parallelism_config_cp_size": 2, "parallelism_config_cp_backend": "torch",
                                                 "parallelism_config_dp_shard_size": 2}
    pc = seqpar.parallelism_config(recipe(*flags), "sdpa")
    assert (pc.cp_size, pc.cp_backend, pc.dp_shard_size, pc.sp_size) == (2, "torch", 2, 1)


def obs_eval_tasks(tiny_model, tmp_path):
    """The trained model is scored after training, from output_dir, and its figures reach run_summary.json."""
    record, summary, out = _eval_run(tmp_path)
    assert record["tasks"] == ["tinymc"] and record["model_args"] == {"pretrained": str(out)}
    assert summary["lm_eval"]["tinymc"]["acc,none"] == record["results"]["tinymc"]["acc,none"]


def obs_eval_include_path(tiny_model, tmp_path):
    record, _, _ = _eval_run(tmp_path)  # tinymc exists only in that folder
    assert record["include_path"] == "tests/use/tasks" and "tinymc" in record["results"]


def obs_eval_limit(tiny_model, tmp_path):
    record, _, _ = _eval_run(tmp_path)
    assert record["limit"] == 5 and record["n_samples"]["tinymc"] == {"original": 20, "effective": 5}


OBSERVERS = {name[4:].replace("launch_", "launch."): fn for name, fn in globals().items() if name.startswith("obs_")}
OBSERVERS["model_name_or_path"] = OBSERVERS.pop("model_name")
OBSERVERS["tokenizer_name_or_path"] = OBSERVERS.pop("tokenizer_name")


def test_every_project_option_has_an_observer():
    project = {n for n, o in all_options().items() if o.owner not in ("trl", "peft")}  # peft's: test_lora.py EFFECTS
    assert project == set(OBSERVERS)


@pytest.mark.parametrize("key", sorted(OBSERVERS))
def test_project_option_reaches_its_target(tiny_model, tmp_path, key):
    OBSERVERS[key](tiny_model, tmp_path)


# ------------------------------------------------------------------------------------------ effects inside the trainer
# The reach test above shows a TRL key arrives in SFTConfig; for the keys that act inside the trainer these show the
# effect in what a run produces: its logged losses and learning rates, its loss on a batch. The collator, padding and
# data-order keys: test_data.py (TRL's data-preparation keys).

# one 6-step run: a warmed-up linear schedule, logged every 2 steps and at the first, 2 micro-batches of 2 per step,
# a checkpoint every 2 steps of which the last 2 are kept
SCHEDULED = ("--chat_template_format", "chatml", "--max_steps", 6, "--sample_max_new_tokens", 0, "--per_device_train_batch_size", 2,
             "--gradient_accumulation_steps", 2, "--logging_steps", 2, "--logging_first_step", True, "--learning_rate", 0.004,
             "--lr_scheduler_type", "linear", "--warmup_steps", 3, "--save_strategy", "steps", "--save_steps", 2,
             "--save_total_limit", 2, "--seed", 11)


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory):
    out = tmp_path_factory.mktemp("scheduled")
    trainer, summary = train.run(recipe(*SCHEDULED, "--output_dir", out))
    return trainer.state.log_history, summary, out


def test_logging_steps_and_the_lr_schedule_shape_the_log(scheduled):
    """logging_steps 2 of 6 steps and logging_first_step: losses logged at steps 1, 2, 4, 6; learning_rate 0.004 with
    linear decay after 3 warm-up steps: the rate each logged step used, from the schedule's formula."""
    history, summary, _ = scheduled
    logged = [(e["step"], e["learning_rate"]) for e in history if "loss" in e]
    assert [s for s, _ in logged] == [1, 2, 4, 6] and len(summary["losses"]) == 4

    def linear(step, peak=0.004, warmup=3, total=6):
        return peak * (step / warmup if step < warmup else (total - step) / (total - warmup))

    assert [lr for _, lr in logged] == pytest.approx([linear(s - 1) for s, _ in logged])  # the rate step s trained with


def test_gradient_accumulation_sets_the_samples_per_step(scheduled):
    """Each optimizer step takes gradient_accumulation_steps x per_device_train_batch_size samples: 4, so the epoch
    logged at step s is 4s / the train split's size."""
    history, summary, _ = scheduled
    rows = summary["data"]["train"]["kept"]
    assert [e["epoch"] for e in history if "loss" in e] == pytest.approx([4 * e["step"] / rows for e in history if "loss" in e], rel=0.02)


def test_save_steps_and_save_total_limit_leave_the_last_checkpoints(scheduled):
    _, _, out = scheduled
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]


def test_seed_decides_the_run(scheduled, tmp_path):
    """The same seed gives the same losses (data order, initialisation of anything new); another seed does not."""
    _, first, _ = scheduled
    same = train.run(recipe(*SCHEDULED, "--output_dir", tmp_path / "same"))[1]
    other = train.run(recipe(*SCHEDULED, "--seed", 12, "--output_dir", tmp_path / "other"))[1]
    assert same["losses"] == first["losses"] and other["losses"] != first["losses"]


def test_optim_lr_and_max_grad_norm_set_the_update(tiny_model, tmp_path):
    """One plain-SGD step at a constant learning rate 2 with gradients clipped to norm 0.001 moves the weights by
    exactly 2 x 0.001 (the gradient was larger: logged grad_norm), whatever the gradient was."""
    out = tmp_path / "sgd"
    trainer, summary = train.run(recipe("--chat_template_format", "chatml", "--output_dir", out, "--max_steps", 1, "--optim", "sgd",
                                        "--learning_rate", 2.0, "--lr_scheduler_type", "constant", "--max_grad_norm", 0.001,
                                        "--logging_steps", 1, "--sample_max_new_tokens", 0))
    before, after = load_file(str(tiny_model / "model.safetensors")), load_file(str(out / "model.safetensors"))
    moved = torch.sqrt(sum(((after[k].float() - before[k].float()) ** 2).sum() for k in before))
    assert moved.item() == pytest.approx(2 * 0.001, rel=1e-3)
    assert next(e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e) > 0.001


@pytest.mark.parametrize("flags, expect", [
    ((), "nll"), (("--loss_type", "dft"), "dft"), (("--label_smoothing_factor", 0.2), "smoothed")])
def test_loss_keys_set_the_loss_of_a_batch(tiny_model, tmp_path, flags, expect):
    """The loss SFTTrainer computes for one batch equals the formula the key names, from the model's own logits."""

    trainer, _, _ = trainer_for(tmp_path, "--splits", "train", *[str(f) for f in flags])
    trainer.model.eval()
    batch = first_batch(trainer)
    with torch.no_grad():
        got = trainer.compute_loss(trainer.model, dict(batch))
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    target = batch["labels"][:, 1:]
    mask = target != -100
    nll = -logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)[mask]
    want = {"nll": nll.mean(), "dft": (nll * torch.exp(-nll)).mean(),
            "smoothed": 0.8 * nll.mean() + 0.2 * (-logp.sum(-1)[mask] / logp.shape[-1]).mean()}
    torch.testing.assert_close(got, want[expect], atol=1e-4, rtol=1e-4)
    assert all(not torch.allclose(got, v, atol=1e-4) for k, v in want.items() if k != expect)


def test_weight_decay_shrinks_the_decayed_weights_only(tiny_model, tmp_path):
    """One AdamW step with weight_decay 0.5 against the same step without: AdamW decays decoupled from the gradient,
    so the two runs differ by exactly learning_rate x weight_decay x the starting weight on every decayed weight, and
    not at all on the norms and biases transformers leaves undecayed."""
    lr, wd = 0.01, 0.5
    common = ("--chat_template_format", "chatml", "--max_steps", 1, "--optim", "adamw_torch", "--learning_rate", lr,
              "--lr_scheduler_type", "constant", "--sample_max_new_tokens", 0, "--save_strategy", "no")
    plain, decayed = tmp_path / "plain", tmp_path / "decayed"
    train.run(recipe(*common, "--output_dir", plain))
    train.run(recipe(*common, "--weight_decay", wd, "--output_dir", decayed))
    start, a, b = (load_file(str(p / "model.safetensors")) for p in (tiny_model, plain, decayed))
    assert a.keys() == b.keys() == start.keys()
    norms = [k for k in start if "norm" in k or k.endswith("bias")]
    assert norms and all(torch.equal(a[k], b[k]) for k in norms)
    for k in set(start) - set(norms):
        torch.testing.assert_close(b[k] - a[k], -lr * wd * start[k], atol=1e-6, rtol=0)


def test_num_train_epochs_and_a_warmup_ratio_set_the_steps_and_the_schedule(tiny_model, tmp_path):
    """Without max_steps, num_train_epochs 2 runs two passes over the kept samples (ceil(rows / 32) steps each at batch
    32); warmup_steps 0.5 (a float below 1 is a ratio) warms up over half of them, then the rate decays linearly."""
    trainer, summary = train.run(recipe(
        "--chat_template_format", "chatml", "--max_steps", -1, "--num_train_epochs", 2, "--per_device_train_batch_size", 32,
        "--splits", "train", "--eval_strategy", "no", "--learning_rate", 0.004, "--lr_scheduler_type", "linear",
        "--warmup_steps", 0.5, "--logging_steps", 1, "--save_strategy", "no", "--sample_max_new_tokens", 0,
        "--output_dir", tmp_path / "epochs"))
    per_epoch = -(-summary["data"]["train"]["kept"] // 32)
    total, warmup = 2 * per_epoch, -(-2 * per_epoch // 2)
    assert trainer.state.global_step == total
    logged = [(e["step"], e["learning_rate"]) for e in trainer.state.log_history if "loss" in e]
    assert [s for s, _ in logged] == list(range(1, total + 1))
    want = [0.004 * ((s - 1) / warmup if s - 1 < warmup else (total - s + 1) / (total - warmup)) for s, _ in logged]
    assert [lr for _, lr in logged] == pytest.approx(want)
