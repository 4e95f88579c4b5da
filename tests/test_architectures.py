"""Any architecture transformers builds, beyond the hand-held families: a tiny random-init model of each (built
offline from its config class by sftrecipes.tiny.tiny_config, with the tiny Llama's tokenizer) is planned from the
model transformers builds on the meta device (sftrecipes/meta.py) -- its parameters, and LoRA's trainable count through
the run's own LoraConfig -- and a representative few train LoRA in one process and merge with --verify, their plan's
count equal to what the run trained. `make sweep` does the same for every decoder-only text architecture.
"""

import json

import pytest
import torch

import train
from conftest import run_cli
from sftrecipes import meta
from sftrecipes.export import merge_lora
from sftrecipes.errors import RecipeError
from sftrecipes.lora import moe_layout
from sftrecipes.plan import plan_recipe
from sftrecipes.recipe import load_recipe
from sftrecipes.shape import model_shape
from sftrecipes.tiny import tiny_config

# the families people bring that shape.py's table does not hold (plus Qwen2-MoE, which it does), and the multimodal
# Gemma-3 config as gemma-3-4b-it ships it (text + SigLIP vision tower)
ARCHS = ["granite", "olmo2", "smollm3", "cohere2", "glm4", "qwen2_moe", "deepseek_v3", "gpt_oss", "qwen3_5",
         "qwen3_next", "llama4_text", "gemma3"]
TRAINED = ["deepseek_v3", "gpt_oss", "qwen3_5", "llama4_text", "gemma3"]  # MLA + dense/sparse MoE, sinks, linear attention, MoE + shared expert, multimodal


@pytest.fixture(scope="session")
def arch_models(tiny_model, tmp_path_factory):
    """architecture -> a saved tiny random-init model with the tiny Llama's tokenizer (built on first use)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    root, built = tmp_path_factory.mktemp("archs"), {}

    def get(mt: str):
        if mt not in built:
            c = tiny_config(mt, vocab_size=len(tok), token_ids=(tok.bos_token_id, tok.eos_token_id, tok.pad_token_id))
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**c))
            model.save_pretrained(root / mt)
            tok.save_pretrained(root / mt)
            built[mt] = root / mt
        return built[mt]

    return get


def lora_recipe(folder, *extra):
    return load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path", str(folder), *extra])


@pytest.mark.parametrize("mt", ARCHS)
def test_planned_from_the_model_transformers_builds(mt, arch_models):
    """Every parameter counted (the meta model's sum), and the plan's trainable count is peft's on the run's own
    LoraConfig; an MoE's experts are its experts module's tensors only."""
    folder = arch_models(mt)
    s = model_shape(str(folder))
    model = meta.meta_model(json.loads((folder / "config.json").read_text()))
    assert s.params == sum(p.numel() for p in model.parameters())
    recipe = lora_recipe(folder)
    plan = plan_recipe(recipe, _alternatives=False)
    layout = meta.lora_layout(recipe, s)
    assert plan.params == s.params and plan.trainable == layout.trainable > 0
    experts, _ = moe_layout(model)
    assert all(".experts." in n for n in experts)  # never SigLIP's probe [1, 1, h] nor a conv kernel
    assert bool(experts) == s.moe


def test_deepseek_dense_mlps_and_shared_experts_get_lora(arch_models):
    """peft's v4->v5 conversion would take gate/up/down_proj for the expert tensors only: the dense layer's MLP and the
    shared experts would get no LoRA (compat.keep_dense_linears_in_moe_conversion keeps them)."""
    s = model_shape(str(arch_models("deepseek_v3")))
    layout = meta.lora_layout(lora_recipe(arch_models("deepseek_v3")), s)
    dense, sparse = ({w.name for w, _ in layer} for layer in layout.adapted)
    assert {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"} <= dense
    assert {"mlp.shared_experts.gate_proj", "mlp.shared_experts.down_proj", "mlp.experts.gate_up_proj"} <= sparse
    assert not any(w.kind == "router" for w, _ in layout.adapted[1])  # the router stays off


def test_multimodal_plan_says_what_is_trained_and_frozen(arch_models):
    plan = plan_recipe(lora_recipe(arch_models("gemma3")), _alternatives=False)
    note = next(n for n in plan.notes if n.startswith("besides the text decoder"))
    assert "model.vision_tower" in note and "LoRA adapts its linear layers" in note and "multi_modal_projector" in note


def test_not_a_causal_lm_is_one_line_before_any_rank(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(RecipeError) as e:
        model_shape(str(tmp_path))
    assert "\n" not in str(e.value) and "no causal-LM head" in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    res = run_cli(["-m", "sftrecipes", "launch", "recipes/tiny/zero3.yaml", "--model_name_or_path", str(tmp_path),
                   "--output_dir", str(tmp_path / "out")])
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("error: model_name_or_path:"), res.stderr[-800:]
    assert "'no-such-model'" in res.stderr and not (tmp_path / "out").exists()
    forced = run_cli(["-m", "sftrecipes", "preflight", "recipes/tiny/zero3.yaml", "--model_name_or_path", str(tmp_path), "--force"])
    assert forced.returncode == 0 and "no memory plan" in forced.stdout and "launching anyway (--force)" in forced.stdout


@pytest.mark.parametrize("twin", ["zero3", "fsdp"])
def test_launch_plans_two_ranks_of_any_architecture(twin, arch_models):
    """A copy of a 2-rank twin with only the model swapped passes pre-flight (what launch runs before any rank)."""
    res = run_cli(["-m", "sftrecipes", "preflight", f"recipes/tiny/{twin}.yaml", "--model_name_or_path", str(arch_models("glm4"))])
    assert res.returncode == 0, res.stderr[-1500:]
    assert "VERDICT" in res.stdout and "2 process(es)" in res.stdout


@pytest.mark.parametrize("mt", TRAINED)
def test_lora_trains_merges_and_verifies(mt, arch_models, tmp_path):
    """Single-process LoRA with only the model swapped: trains 3 steps, the run's trainable count is the plan's, and
    the merge verifies against peft's unmerged adapter."""
    folder, out = arch_models(mt), tmp_path / "lora"
    args = ["--output_dir", str(out), "--max_steps", "3", "--logging_steps", "1", "--sample_max_new_tokens", "0"]
    if mt == "qwen3_5":  # linear attention: packed batches need causal-conv1d (refused in one line, below)
        with pytest.raises(RecipeError, match=r"^packing: Qwen3_5ForCausalLM's causal_conv1d_\w+ cannot keep packed samples apart"):
            train.run(lora_recipe(folder, *args))
        args += ["--packing", "false"]
    recipe = lora_recipe(folder, *args)
    planned = plan_recipe(recipe, _alternatives=False).trainable
    _, summary = train.run(recipe)
    assert summary["backend"]["trainable_elements_full"] == planned
    assert summary["backend"]["param_elements_full"] == model_shape(str(folder)).params + planned
    merge_lora(out, tmp_path / "merged", verify=True)


def test_a_refusal_in_every_rank_is_exit_2_under_launch(arch_models, tmp_path):
    """A check only the ranks can make (packed batches on Qwen3.5's linear attention) stops every rank with the same
    one line before anything loads; launch then exits 2, like bad input it finds itself, and output_dir stays empty."""
    out = tmp_path / "out"
    res = run_cli(["-m", "sftrecipes", "launch", "recipes/tiny/ddp.yaml", "--model_name_or_path", str(arch_models("qwen3_5")),
                   "--output_dir", str(out), "--max_steps", "2"])
    assert res.returncode == 2, res.stderr[-2000:]
    refusals = [x for x in res.stderr.splitlines() if x.startswith("error: packing: Qwen3_5ForCausalLM's")]
    assert len(refusals) == 2 and "launch: every rank refused the recipe (exit 2): packing:" in res.stderr
    written = {p.name for p in out.rglob("*") if p.is_file()} if out.exists() else set()
    assert written <= {"accelerate_config.yaml"}, written  # launch's own config; nothing of the run
