"""The `method` key: each method's TRL keys read from its config class (stored, drift-tested), keys of another method
refused where the recipe sets them and left out where a base written for another method set them, DPO's loss types
read from TRL and checked before torch loads."""

import inspect
import json
import re
import textwrap

import pytest

from conftest import ROOT, run_cli
from sftrecipes.recipe import schema
from sftrecipes.recipe import snapshots
from sftrecipes.train import options
from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.load import load_recipe

TINY = ROOT / ".assets/tiny-llama"


def recipe(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(f"model_name_or_path: {TINY}\ndataset_name: {ROOT / 'data/tiny_chat'}\noutput_dir: {tmp_path / 'out'}\n"
                 + textwrap.dedent(text))
    return p


def test_methods_snapshot_matches_installed_trl():
    import trl

    stored = snapshots.load_methods_snapshot()
    assert stored.pop("trl_version") == trl.__version__, "run: make schema"
    assert stored == options.methods_snapshot(), "sftrecipes/recipe/trl_methods.json is stale; run: make schema"


def test_dpo_loss_types_are_the_branches_of_dpo_trainers_loss():
    """The loss types read from DPOConfig's help are exactly those DPOTrainer's loss computes."""
    from trl import DPOTrainer

    branches = set(re.findall(r'loss_type == "(\w+)"', inspect.getsource(DPOTrainer)))
    assert branches and set(schema.dpo_loss_types()) == branches


def test_each_method_reads_its_config_class(tmp_path):
    r = load_recipe([str(recipe(tmp_path, "method: dpo\nbeta: 0.25\n")), "--loss_type", "ipo", "hinge"])
    assert (r.method, r.trl["beta"], r.trl["loss_type"]) == ("dpo", 0.25, ["ipo", "hinge"])
    assert r.trl_value("learning_rate") == 1e-6  # DPOConfig's default, not SFTConfig's 2e-5
    k = load_recipe([str(recipe(tmp_path, "desirable_weight: 1.5\n")), "--method", "kto", "--loss_type", "apo_zero_unpaired"])
    assert (k.method, k.trl["desirable_weight"], k.trl["loss_type"]) == ("kto", 1.5, "apo_zero_unpaired")
    s = load_recipe([str(recipe(tmp_path, "loss_type: dft\n"))])
    assert (s.method, s.trl["loss_type"], s.trl_value("learning_rate")) == ("sft", "dft", 2e-5)


@pytest.mark.parametrize("text,flags,message", [
    ("beta: 0.2\n", [], "beta: a key of DPOConfig (method dpo, kto, orpo, cpo, grpo, rloo); method sft trains with SFTTrainer, whose "
                        "SFTConfig has no beta: remove it, or set method: dpo"),
    ("method: dpo\npacking: true\n", [], "packing: a key of SFTConfig (method sft); method dpo trains with DPOTrainer"),
    ("method: kto\n", ["--packing", "true"], "packing: a key of SFTConfig (method sft); method kto"),
    ("method: kto\n", ["--loss_type", "sigmoid"], "'sigmoid' is not one of kto, apo_zero_unpaired"),
    ("method: dpo\nloss_type: [sigmoid, ipx]\n", [], "loss_type: 'ipx' is not a loss DPOTrainer has; use one or more of sigmoid,"),
    ("method: simpo\n", [], "'simpo' is not one of sft, dpo, kto, orpo, cpo, grpo, rloo"),
    ("method: dpo\n", ["--num_generations", "4"], "num_generations: a key of GRPOConfig (method grpo, rloo); method dpo"),
    ("method: orpo\n", ["--precompute_ref_log_probs", "true"], "precompute_ref_log_probs: a key of DPOConfig (method dpo, "
                                                               "kto); method orpo trains with ORPOTrainer, whose ORPOConfig has no"),
    ("method: cpo\n", ["--loss_type", "kto"], "'kto' is not one of sigmoid, hinge, ipo, simpo, alphapo"),
    ("method: orpo\n", ["--generate_during_eval", "true"], "generate_during_eval: ORPOTrainer logs its generations to "
                                                           "Weights & Biases or Comet, and neither is installed"),
    ("method: cpo\n", ["--max_length", "null"], "max_length: null would not mean 'no cut' here: CPOTrainer then cuts at"),
    ("method: dpo\nappend_concat_token: true\n", [], "append_concat_token: shapes SFT samples only; method dpo's "
                                                       "DPOTrainer tokenizes preference data itself"),
])
def test_keys_of_another_method_are_refused(tmp_path, text, flags, message):
    with pytest.raises(RecipeError, match=re.escape(message)):
        load_recipe([str(recipe(tmp_path, text)), *flags])


def test_a_base_written_for_sft_extends_to_dpo(tmp_path):
    """A copy of a tiny SFT recipe with method: dpo: the SFT keys its base set are listed as not used, not refused;
    the SFT keys keep working for the SFT recipe itself."""
    base = recipe(tmp_path, "packing: true\ndataset_text_field: body\nlearning_rate: 0.01\n", "base.yaml")
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {base.name}\nmethod: dpo\n")
    r = load_recipe([str(child)])
    assert set(r.ignored) == {"packing", "dataset_text_field"} and "packing" not in r.trl
    assert r.ignored["packing"] == "true from base.yaml is a key of SFTConfig; method dpo has none: not used"
    assert r.trl["learning_rate"] == 0.01  # a key both classes have is kept
    assert load_recipe([str(base)]).trl["packing"] is True


def test_help_marks_the_keys_of_one_method():
    res = run_cli(["train.py", "--help"])
    assert res.returncode == 0
    beta = next(ln for ln in res.stdout.splitlines() if ln.startswith("  --beta "))
    assert "(method dpo, kto, orpo, cpo, grpo, rloo only)" in beta
    assert "GRPOConfig (method grpo): float, default 0.0; RLOOConfig (method rloo): float, default 0.05" in beta
    method = next(ln for ln in res.stdout.splitlines() if ln.startswith("  --method "))
    assert "one of sft, dpo, kto, orpo, cpo, grpo, rloo" in method
    generations = next(ln for ln in res.stdout.splitlines() if ln.startswith("  --num_generations "))
    assert "(method grpo, rloo only)" in generations


@pytest.mark.parametrize("layout,message", [
    # an adapter is a start (merged into its base at start: test_preference_train), refused only where it cannot be
    ({"adapter_config.json": '{"peft_type": "LORA"}', "adapter_model.safetensors": ""},
     "names no base model (adapter_config.json has no base_model_name_or_path); set it there, or merge it yourself"),
    ({"adapter_config.json": '{"peft_type": "LORA", "base_model_name_or_path": "meta-llama/Llama-3.1-8B"}',
      "adapter_model.safetensors": "", "../sft-out-merged/config.json": "{}"},
     "-merged', which exists and was not merged there by a run (start_merge.json is missing); move it away"),
    ({"pytorch_model_fsdp_0/.metadata": ""}, "is an FSDP sharded checkpoint, not a model; export it to full safetensors first "
                                             "(python -m sftrecipes export "),
    ({"global_step6/mp_rank_00_model_states.pt": "", "global_step6/zero_pp_rank_0_mp_rank_00_optim_states.pt": ""},
     "is a DeepSpeed ZeRO checkpoint, not a model; export it"),
    ({"checkpoint-3/trainer_state.json": "", "checkpoint-12/trainer_state.json": ""},
     "holds no final save but checkpoint-3, checkpoint-12; export one (python -m sftrecipes export "),
])
def test_a_previous_runs_output_that_is_not_a_model_is_refused_with_the_command(tmp_path, layout, message):
    """A preference recipe (or any) started from an SFT run's output folder: a merged model, an exported checkpoint or
    an adapter loads; a sharded checkpoint is refused before torch, naming export, and an adapter that names no base
    or whose merged folder's place is taken by another folder, naming the fix."""
    run = tmp_path / "sft-out"
    for name, text in layout.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    with pytest.raises(RecipeError, match="^model_name_or_path: .*" + re.escape(message)):
        load_recipe([str(recipe(tmp_path, "method: dpo\n")), "--model_name_or_path", str(run)])


def test_a_run_from_an_sft_adapter_plans_as_its_base(tmp_path, capsys):
    """The second stage of the shipped pipeline (make sft-dpo-llama3-70b-lora): the DPO recipe from an SFT run's
    adapter plans torch-free from the base the adapter names (no merged folder needed yet): every figure is the base's,
    and the first line says what the run starts from."""
    from sftrecipes import cli

    adapter = tmp_path / "llama3.1-70b-lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": "meta-llama/Llama-3.1-70B-Instruct", "r": 16, "lora_alpha": 32}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    assert cli.main(["plan", "recipes/llama3.1-70b/dpo-lora.yaml"]) == 0
    base = capsys.readouterr().out.splitlines()
    assert cli.main(["plan", "recipes/llama3.1-70b/dpo-lora.yaml", "--model_name_or_path", str(adapter)]) == 0
    started = capsys.readouterr().out.splitlines()
    assert started[0] == base[0].replace("meta-llama/Llama-3.1-70B-Instruct:", f"{adapter} (a LoRA adapter of "
                                         "meta-llama/Llama-3.1-70B-Instruct, merged into it at start):")
    assert started[1:] == base[1:] and len(base) > 10
    assert not (tmp_path / "llama3.1-70b-lora-merged").exists()  # planning merges nothing


def test_a_shipped_recipes_reward_file_is_found_from_any_folder(tmp_path, monkeypatch):
    """recipes/tiny/grpo.yaml names recipes/tiny/rewards.py:brevity, relative to the repository root like its other
    paths: read from another folder, the entry is that file (checked there: it defines brevity); built-ins unchanged."""
    monkeypatch.chdir(tmp_path)
    r = load_recipe([str(ROOT / "recipes" / "tiny" / "grpo.yaml")])
    assert r.run.reward_funcs == [f"{ROOT}/recipes/tiny/rewards.py:brevity", "exact_answer"]
