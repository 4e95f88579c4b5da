"""Pre-flight inside a rank: the launcher's accelerate config must be the recipe's, key by key.

A bare `accelerate launch --config_file X train.py RECIPE` exports X's keys (FSDP_STATE_DICT_TYPE,
ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE, ...) and accelerate builds its plugin from them, so a config from
another recipe would silently change what runs and what gets saved. The environments here are the ones accelerate's
own launcher code computes from a rendered config file (accelerate/utils/launch.py), not hand-written.
"""

import os

import pytest
import yaml
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

from conftest import ROOT, free_port, run_cli
from sftrecipes.model import wrapping
from sftrecipes.model import meta
from sftrecipes.launch.accelerate import accelerate_config
from sftrecipes.core.errors import RecipeError
from sftrecipes.launch.preflight import check_launcher_matches
from sftrecipes.recipe.load import load_recipe


def launched_env(recipe, tmp_path) -> dict[str, str]:
    """What accelerate's launcher exports to each rank for the accelerate config rendered from `recipe`."""
    cfg = tmp_path / "accelerate.yaml"
    cfg.write_text(yaml.safe_dump(accelerate_config(recipe)))
    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(cfg), "train.py"]))
    if args.use_deepspeed:  # as accelerate's deepspeed_launcher sets it before computing the environment
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        return prepare_deepspeed_cmd_env(args)[1]
    return prepare_multi_gpu_env(args)


FSDP = ["recipes/tiny/fsdp.yaml"]
FSDP1 = ["recipes/tiny/fsdp1.yaml"]
ZERO3 = ["recipes/tiny/zero3.yaml"]
# (the recipe, the launcher's config rendered with one key changed, the key the error must name)
CASES = {
    "fsdp_state_dict_type": (FSDP, ["--launch.fsdp_state_dict_type", "FULL_STATE_DICT"], "launch.fsdp_state_dict_type"),
    "fsdp_offload_params": (FSDP + ["--launch.hardware", "gpu"], ["--launch.fsdp_offload_params", "true"], "launch.fsdp_offload_params"),
    "fsdp_reshard_after_forward": (FSDP, ["--launch.fsdp_sharding_strategy", "SHARD_GRAD_OP"], "launch.fsdp_sharding_strategy"),
    "fsdp_version": (FSDP1, ["--launch.fsdp_version", "2"], "launch.fsdp_version"),
    "fsdp_sharding_strategy": (FSDP1, ["--launch.fsdp_sharding_strategy", "SHARD_GRAD_OP"], "launch.fsdp_sharding_strategy"),
    "fsdp_cpu_ram_efficient_loading": (FSDP, ["--launch.fsdp_cpu_ram_efficient_loading", "false"], "launch.fsdp_cpu_ram_efficient_loading"),
    "zero_stage": (["recipes/tiny/zero2.yaml"], ["--launch.zero_stage", "3"], "launch.zero_stage"),
    "offload_optimizer": (ZERO3, ["--launch.offload_optimizer", "true"], "launch.offload_optimizer"),
    "offload_params": (ZERO3, ["--launch.offload_params", "true"], "launch.offload_params"),
    "zero3_init": (ZERO3, ["--launch.zero3_init", "false"], "launch.zero3_init"),
    "gradient_clipping": (ZERO3, ["--max_grad_norm", "0.5"], "max_grad_norm"),
    "backend": (["recipes/tiny/ddp.yaml"], ["--launch.backend", "fsdp"], "launch.backend"),
    # exported as FSDP_TRANSFORMER_CLS_TO_WRAP (not FSDP_<KEY>)
    "fsdp_transformer_layer_cls_to_wrap": (FSDP + ["--launch.fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer"],
                                           ["--launch.fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer,LlamaMLP"],
                                           "launch.fsdp_transformer_layer_cls_to_wrap"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_launcher_config_that_differs_from_the_recipe_is_refused(case, tmp_path, monkeypatch):
    argv, changed, key = CASES[case]
    recipe = load_recipe(argv)
    for name, value in launched_env(recipe, tmp_path).items():  # the recipe's own config: agrees
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WORLD_SIZE", str(recipe.launch.world_size))
    check_launcher_matches(recipe)
    other = launched_env(load_recipe(argv + changed), tmp_path)
    for name in [n for n in list(os.environ) if n.startswith(("FSDP_", "ACCELERATE_"))]:
        monkeypatch.delenv(name)
    for name, value in other.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RecipeError) as e:
        check_launcher_matches(recipe)
    msg = str(e.value)
    assert msg.startswith(f"{key}:") and "\n" not in msg and "python -m sftrecipes launch" in msg, msg


def test_bare_accelerate_launch_with_another_config_stops_before_anything_is_written(tmp_path):
    """The issue's case: `accelerate launch --config_file X train.py RECIPE` with X saying FULL_STATE_DICT for a
    recipe that checkpoints SHARDED_STATE_DICT: every rank exits 2 with one line naming the key, nothing saved."""
    cfg = tmp_path / "full.yaml"
    cfg.write_text(yaml.safe_dump(accelerate_config(load_recipe(FSDP + ["--launch.fsdp_state_dict_type", "FULL_STATE_DICT"]))))
    out = tmp_path / "out"
    res = run_cli(["-m", "accelerate.commands.launch", "--config_file", str(cfg), "--main_process_port", str(free_port()),
                   str(ROOT / "train.py"), *FSDP, "--max_steps", "1", "--output_dir", str(out)], timeout=300,
                  env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert res.returncode != 0, res.stdout[-2000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert errors and all(ln.startswith("error: launch.fsdp_state_dict_type:") and "FULL_STATE_DICT" in ln for ln in errors), res.stderr[-3000:]
    assert not out.exists() or not any(out.rglob("*.safetensors")), sorted(out.rglob("*"))


# ----------------------------------------------------------------------- the layer classes FSDP wraps (issue 18)

WRAP_KEY = "launch.fsdp_transformer_layer_cls_to_wrap"
GEMMA3_LAYERS = ["SiglipVisionEmbeddings", "SiglipEncoderLayer", "Gemma3DecoderLayer"]


def test_fsdp_wraps_the_layer_classes_the_model_has(gemma3_multimodal_model, monkeypatch):
    """The union of _no_split_modules over the model's PreTrainedModel classes (text and vision towers), those present
    in the model built from the config: what accelerate is told (FSDP_TRANSFORMER_CLS_TO_WRAP). accelerate's own
    default, model._no_split_modules, names SigLIP's pooling head, which Gemma-3's tower leaves out, and fails."""
    from accelerate.utils.dataclasses import get_module_class_from_name

    monkeypatch.setenv(wrapping.FSDP_WRAP_ENV, "")  # recorded, so what the test sets is undone after it
    monkeypatch.delenv(wrapping.FSDP_WRAP_ENV)
    monkeypatch.setattr(wrapping, "_wrap_set_here", {})
    argv = FSDP + ["--model_name_or_path", str(gemma3_multimodal_model)]
    model = meta.recipe_model(load_recipe(argv))[1]
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    absent = [c for c in model._no_split_modules if get_module_class_from_name(model, c) is None]
    assert "SiglipMultiheadAttentionPoolingHead" in absent  # what stopped accelerate's auto-wrap
    assert wrapping.fsdp_wrap_classes(load_recipe(argv)) == GEMMA3_LAYERS
    assert os.environ[wrapping.FSDP_WRAP_ENV] == ",".join(GEMMA3_LAYERS)
    assert all(get_module_class_from_name(model, c) is not None for c in GEMMA3_LAYERS)
    # named in the recipe: used as named, on every rank the same
    assert wrapping.fsdp_wrap_classes(load_recipe(argv + ["--" + WRAP_KEY, "Gemma3DecoderLayer"])) == ["Gemma3DecoderLayer"]
    assert os.environ[wrapping.FSDP_WRAP_ENV] == "Gemma3DecoderLayer"


def test_a_named_class_the_model_lacks_is_one_line_naming_the_key_and_the_classes(gemma3_multimodal_model, monkeypatch):
    monkeypatch.setenv(wrapping.FSDP_WRAP_ENV, "")  # recorded, so what the test sets is undone after it
    monkeypatch.delenv(wrapping.FSDP_WRAP_ENV)
    monkeypatch.setattr(wrapping, "_wrap_set_here", {})
    argv = FSDP + ["--model_name_or_path", str(gemma3_multimodal_model)]
    with pytest.raises(RecipeError) as e:
        wrapping.fsdp_wrap_classes(load_recipe(argv + ["--" + WRAP_KEY, "Gemma3DecoderLayer,SiglipMultiheadAttentionPoolingHead"]))
    msg = str(e.value)
    assert msg.startswith(f"{WRAP_KEY}: SiglipMultiheadAttentionPoolingHead is not a module class of "
                          "Gemma3ForConditionalGeneration (its classes: ") and "\n" not in msg, msg
    assert all(c in msg for c in GEMMA3_LAYERS + ["SiglipAttention", "Gemma3Attention"])
    assert wrapping.FSDP_WRAP_ENV not in os.environ  # nothing told to accelerate
    # a launcher's accelerate config naming other classes than the recipe leaves to the model: refused too
    monkeypatch.setenv(wrapping.FSDP_WRAP_ENV, "Gemma3DecoderLayer")
    with pytest.raises(RecipeError, match=f"^{WRAP_KEY}: the recipe wraps SiglipVisionEmbeddings, SiglipEncoderLayer, "
                                          "Gemma3DecoderLayer but the launcher's accelerate config says Gemma3DecoderLayer"):
        wrapping.fsdp_wrap_classes(load_recipe(argv))
    # names that cannot be classes, or the key with another backend: refused while the recipe loads (no torch needed)
    for flags, start in ((["--" + WRAP_KEY, "Gemma3-DecoderLayer"], f"{WRAP_KEY}: 'Gemma3-DecoderLayer' is not a class name"),
                         (["--" + WRAP_KEY, ","], f"{WRAP_KEY}: empty")):
        with pytest.raises(RecipeError, match=f"^{start}"):
            load_recipe(argv + flags)
    with pytest.raises(RecipeError, match=f"^{WRAP_KEY}: only applies to backend fsdp"):
        load_recipe(["recipes/tiny/ddp.yaml", "--" + WRAP_KEY, "LlamaDecoderLayer"])
