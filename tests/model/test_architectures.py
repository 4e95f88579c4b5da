"""Any architecture transformers builds, beyond the hand-held families: a tiny random-init model of each (built
offline from its config class by sftrecipes.tiny.tiny_config, with the tiny Llama's tokenizer) is planned from the
model transformers builds on the meta device (sftrecipes/model/meta.py) -- its parameters, and LoRA's trainable count through
the run's own LoraConfig -- and a representative few train LoRA in one process and merge with --verify, their plan's
count equal to what the run trained. `make sweep` does the same for every decoder-only text architecture.
"""

import json
import re

import pytest

import train
from conftest import free_port, run_cli
from sftrecipes.model import meta
from sftrecipes.export import merge_lora
from sftrecipes.core.errors import RecipeError
from sftrecipes.model.lora import moe_layout
from sftrecipes.plan import plan_recipe
from sftrecipes.plan.activations import planned_attention
from sftrecipes.recipe.load import load_recipe
from sftrecipes.facts.config import model_shape

# the families people bring that shape.py's table does not hold (plus Qwen2-MoE, which it does), the multimodal
# Gemma-3 config as gemma-3-4b-it ships it (text + SigLIP vision tower), and sizes that vary by layer (Gemma-4's head
# sizes, dots3's heads: per_layer_config)
ARCHS = ["granite", "olmo2", "smollm3", "cohere2", "glm4", "qwen2_moe", "deepseek_v3", "gpt_oss", "qwen3_5",
         "qwen3_next", "llama4_text", "gemma4_text", "gemma3", "dots3_note_text"]
# trained in one process: MLA with dense and sparse layers, sinks, linear attention, MoE with a shared expert,
# multimodal, and the dense and MoE families of the issue
TRAINED = ["granite", "olmo2", "cohere2", "glm4", "qwen2_moe", "deepseek_v3", "gpt_oss", "qwen3_5", "llama4_text",
           "gemma4_text", "gemma3"]


# configs whose defaults make a tiny model only if every layout key is read: hybrids whose layer kinds sit in several
# per-layer lists (layer_types, mlp_layer_types, no_rope_layers, layer-index lists), Mamba heads tied to the width,
# GPT-2-style names behind attribute_map (n_embd), sub-configs of a byte-level model (BLT), a size per layer
# (Gemma-3n), derived sizes the class recomputes (Zamba2), KV sharing (Gemma-3n), per-layer vocabularies and head
# sizes (Gemma-4), heads per layer (dots3); the layers: the first period of each pattern (Beam's 5 sliding : 1 full)
TINY_LAYOUTS = {"beam": 6, "bailing_hybrid": 6, "bamba": 2, "zamba2": 7, "falcon_h1": 2, "codegen": 2, "blt": None,
                "gemma3n_text": 9, "gemma4_text": 6, "smollm3": 4, "axk2": 2, "jamba": 2, "mamba2": 2, "dots3_note_text": 3}


@pytest.mark.parametrize("mt", TINY_LAYOUTS)
def test_tiny_config_builds_a_tiny_model_of_every_layer_kind(mt):
    """tiny.tiny_config keeps one layer of each kind the per-layer settings tell apart (and their lists cut to match),
    every size key small: the model builds, has under 2M parameters, and holds each kind the full config has."""
    import torch
    from transformers import AutoConfig

    from sftrecipes.tiny_archs import tiny_config

    full = AutoConfig.for_model(mt).get_text_config()
    cfg = AutoConfig.for_model(**tiny_config(mt))
    model = meta.build(cfg)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    text = cfg.get_text_config()
    if TINY_LAYOUTS[mt]:
        assert text.num_hidden_layers == TINY_LAYOUTS[mt]
    for key in ("layer_types", "mlp_layer_types", "layers_block_type"):
        kinds = getattr(full, key, None)
        if isinstance(kinds, list):
            assert set(kinds) <= set(getattr(text, key)) and len(getattr(text, key)) == text.num_hidden_layers, key
    assert all(not isinstance(v, torch.Tensor) for v in vars(text).values())


def test_tiny_configs_keep_what_releases_vary_by_layer():
    """tiny_config keeps a release's per-layer sizes in the proportion of the class defaults (Gemma-4's full-attention
    layers: twice the sliding layers' head size; dots3's sliding layers: half the heads) and the first period of its
    layer pattern (Gemma-3's and Gemma-4's 5 sliding : 1 full, Qwen3-Next's 3 linear : 1 full), so the models the
    suite and the sweep build meet them."""
    from transformers import AutoConfig

    from sftrecipes.tiny_archs import tiny_config

    for mt, n in (("gemma4_text", 6), ("gemma3_text", 6), ("qwen3_next", 4)):
        assert AutoConfig.for_model(**tiny_config(mt)).layer_types == AutoConfig.for_model(mt).layer_types[:n], mt
    gemma4 = meta.build(AutoConfig.for_model(**tiny_config("gemma4_text")))
    assert [layer.self_attn.head_dim for layer in gemma4.model.layers] == [16] * 5 + [32]
    dots = AutoConfig.for_model(**tiny_config("dots3_note_text"))
    assert [c.num_attention_heads for c in dots.per_layer_config] == [4, 4, 2]  # indexed, indexed, sliding


def lora_recipe(folder, *extra):
    return load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path", str(folder), *extra])


@pytest.mark.parametrize("mt", [*ARCHS, "mllama"])  # (Mllama: its head has 8 rows fewer than its embedding)
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
    """all-linear adapts the language model only (issue 42: never a vision tower or projector); lora_target_modules
    naming the tower's layers (SigLIP's fc1) adapts them, and the plan says so."""
    plan = plan_recipe(lora_recipe(arch_models("gemma3")), _alternatives=False)
    note = next(n for n in plan.notes if n.startswith("besides the text decoder"))
    assert "model.vision_tower" in note and "multi_modal_projector" in note and note.count("frozen, no LoRA") == 2, note
    plan = plan_recipe(lora_recipe(arch_models("gemma3"), "--lora_target_modules", "q_proj,fc1"), _alternatives=False)
    note = next(n for n in plan.notes if n.startswith("besides the text decoder"))
    assert "model.vision_tower 0.02M params: frozen, LoRA adapts its linear layers" in note, note


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
def test_lora_trains_merges_and_verifies(mt, arch_models, tmp_path, caplog):
    """Single-process LoRA with only the model swapped: trains 3 steps, the run's trainable count is the plan's, and
    the merge verifies against peft's unmerged adapter. Qwen3.5's linear attention cannot keep packed samples apart
    without causal-conv1d: the recipe's packing falls back to padded rows, with a warning."""
    folder, out = arch_models(mt), tmp_path / "lora"
    args = ["--output_dir", str(out), "--max_steps", "3", "--logging_steps", "1", "--sample_max_new_tokens", "0"]
    recipe = lora_recipe(folder, *args)
    plan = plan_recipe(recipe, _alternatives=False)
    planned, attention = plan.trainable, planned_attention(recipe, model_shape(str(folder)), gpu=False)
    with caplog.at_level("WARNING", logger="sftrecipes"):
        _, summary = train.run(recipe)
    assert summary["attention"] == attention, (summary["attention"], attention)  # the kernel the plan sized
    fell_back = [r.getMessage() for r in caplog.records if "rows are padded instead" in r.getMessage()]
    assert summary["packed"] is (mt != "qwen3_5"), summary
    if mt == "qwen3_5":
        assert any(n.startswith("packing: the run pads its rows instead (Qwen3_5ForCausalLM's") for n in plan.notes), plan.notes
        assert len(fell_back) == 1 and re.match(r"WARNING packing: off for this run, rows are padded instead: "
                                                r"Qwen3_5ForCausalLM's causal_conv1d_\w+ cannot keep packed samples apart", fell_back[0])
        assert fell_back[0].endswith("; install the package (GPU) to pack, or set packing: false to silence this")
    else:
        assert not fell_back
    assert summary["backend"]["trainable_elements_full"] == planned
    assert summary["backend"]["param_elements_full"] == model_shape(str(folder)).params + planned
    merge_lora(out, tmp_path / "merged", verify=True)


def test_padding_free_fallback_names_the_key_set(arch_models):
    """The fallback's line names the keys it turned off, and the one to set to silence it."""
    from sftrecipes.model.fallbacks import packing_fallback

    recipe = lora_recipe(arch_models("qwen3_5"), "--packing", "false", "--padding_free", "true", "--max_length", "null")
    line = packing_fallback(recipe)
    assert line.startswith("WARNING padding_free: off for this run") and line.endswith("set padding_free: false to silence this")
    assert recipe.trl_value("padding_free") is False


def test_a_refusal_in_every_rank_is_exit_2_under_launch(arch_models, tmp_path):
    """A check only the ranks can make (a layer class to wrap that the model lacks: it takes the model's classes, so
    torch) stops every rank with the same one line before anything loads; launch then exits 2, like bad input it
    finds itself, and output_dir holds nothing of the run. A check whose facts are in the files (the weights whole: a
    copy that did not finish) is launch's own: one line, exit 2, before any rank starts and before anything is
    written, --force included (it skips the memory verdict, not the files)."""
    import shutil

    out = tmp_path / "out"
    key = "launch.fsdp_transformer_layer_cls_to_wrap"
    res = run_cli(["-m", "sftrecipes", "launch", "recipes/tiny/fsdp.yaml", "--model_name_or_path", str(arch_models("qwen3_5")),
                   "--output_dir", str(out), "--max_steps", "2", f"--{key}", "NoSuchLayer"],
                  env={"MAIN_PROCESS_PORT": str(free_port())})
    assert res.returncode == 2, res.stderr[-2000:]
    start = f"{key}: NoSuchLayer is not a module class of Qwen3_5ForCausalLM (its classes: "
    refusals = [x for x in res.stderr.splitlines() if x.startswith(f"error: {start}")]
    # launch says "every rank" from each rank's refusal record; a rank's own stderr line can be cut when the agent
    # ends it as the other exits, so at least one of the two is printed (and launch says "1 of 2" when the agent
    # stopped the other before it refused: launch.outcome)
    said = re.search(r"launch: (every rank|1 of 2 ranks) refused the recipe.* \(exit 2\): " + re.escape(start), res.stderr)
    assert refusals and said, res.stderr[-2000:]
    written = {p.name for p in out.rglob("*") if p.is_file()} if out.exists() else set()
    assert written <= {"accelerate_config.yaml"}, written  # launch's own config; nothing of the run

    folder, out = tmp_path / "cut", tmp_path / "out-cut"
    shutil.copytree(arch_models("qwen3_5"), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    res = run_cli(["-m", "sftrecipes", "launch", "recipes/tiny/ddp.yaml", "--model_name_or_path", str(folder),
                   "--output_dir", str(out), "--max_steps", "2", "--force"], env={"MAIN_PROCESS_PORT": str(free_port())})
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1].startswith(f"error: model_name_or_path: {weights} is truncated: "), res.stderr[-2000:]
    assert "launch: ddp" not in res.stderr and "every rank" not in res.stderr, res.stderr[-2000:]  # no rank started
    assert not out.exists()


# 2-rank runs (~35 s each): the MoE and the multimodal Gemma-3 on ZeRO-3 LoRA (its meta-device builds under ZeRO-3
# once hung in deepspeed.zero.Init: meta.on_meta), the MoE on FSDP2 full fine-tuning with RAM-efficient loading (its
# router keeps a buffer: compat.buffers_in_ram_efficient_fsdp2), and CTRL, which names no layer classes for FSDP; the multimodal Gemma-3's FSDP2 run is
# tests/launch/test_twins.py's, a dense model's FSDP2 runs are tests/model/test_families.py's
TWO_RANKS = [("zero3", "deepseek_v3"), ("zero3", "gemma3"), ("fsdp", "deepseek_v3"), ("fsdp", "ctrl")]


@pytest.mark.parametrize("twin,mt", TWO_RANKS, ids=[f"{t}-{m}" for t, m in TWO_RANKS])
def test_two_rank_twins_train_any_architecture(twin, mt, arch_models, tmp_path):
    """A 2-rank twin (ZeRO-3 LoRA with the 70B recipe's dropout; FSDP2 full fine-tuning, RAM-efficient loading) with
    only the model swapped, started with launch: an MoE with dense and sparse layers, the multimodal Gemma-3. The
    ranks hold what the plan counts; the saved buffers are the base's."""
    from safetensors.torch import load_file

    # ZeRO-3: the vocabulary padded past the tokenizer, as hub checkpoints have it
    folder, out = arch_models(mt, pad=64 if twin == "zero3" else 0), tmp_path / "out"
    argv = [f"recipes/tiny/{twin}.yaml", "--model_name_or_path", str(folder), "--output_dir", str(out),
            "--max_steps", "2", "--save_strategy", "no", "--sample_max_new_tokens", "0"]
    res = run_cli(["-m", "sftrecipes", "launch", *argv], env={"MAIN_PROCESS_PORT": str(free_port())})
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "run_summary.json").read_text())
    plan = plan_recipe(load_recipe(argv), _alternatives=False)
    assert summary["backend"]["world_size"] == 2 and summary["steps"] == 2
    assert summary["backend"]["trainable_elements_full"] == plan.trainable
    if twin == "zero3":  # the padded vocabulary kept whole (a rank's 0-row partition once read as "resize to the
        # tokenizer"), so the adapter is LoRA's alone: no embedding saved as if resized
        saved = load_file(out / "adapter_model.safetensors")
        assert saved and all(".lora_" in k for k in saved), sorted(k for k in saved if ".lora_" not in k)
    if (twin, mt) == ("zero3", "deepseek_v3"):  # lora_dropout 0.1 from the 70B recipe: the modules take it
        assert "dropout 0.1 on the modules, none on the parameters" in res.stdout + res.stderr
    if mt == "ctrl":  # declares no _no_split_modules: FSDP wraps its decoder layers' class, read from the structure;
        # and has no activation checkpointing, which the 70B FSDP recipe turns on: the run (and the plan) go without
        logged = res.stdout + res.stderr
        assert "fsdp: wrapping EncoderLayer (CTRLLMHeadModel declares no _no_split_modules" in logged
        assert "WARNING gradient_checkpointing: off for this run: the ctrl model class does not support" in logged
        assert ("gradient_checkpointing: the run goes without: the ctrl model class does not support activation "
                "checkpointing; planned so") in plan.notes
        return
    if twin == "fsdp":  # rank 0 read the weights and handed out the router's buffer whole
        base = {k: v for k, v in load_file(folder / "model.safetensors").items() if "e_score_correction_bias" in k}
        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(out / "pytorch_model_fsdp_0", tmp_path / "whole.pt")  # the run's sharded save, whole
        whole = torch.load(tmp_path / "whole.pt", weights_only=True)["model"]
        saved = {k: v for k, v in whole.items() if "e_score_correction_bias" in k}
        assert base and saved.keys() == base.keys() and all(saved[k].equal(base[k]) for k in base), (sorted(saved), list(whole)[:3])


# what all-linear adapts, read from the module structure of architectures the sweep found wrong: (model type,
# names that must be among the targets, names that must not be, expert tensors, routers)
TARGET_CASES = {
    "afmoe": ({"q_proj", "gate_proj"}, {"gate"}, {"gate_up_proj", "down_proj"}, {"mlp.router.gate"}),
    "ctrl": ({"ffn.0", "Wq"}, {"0"}, set(), set()),  # a Sequential's index 0 by its parent, not to match layer h.0
    "jetmoe": ({"kv_proj"}, set(), {"input_linear.weight", "output_linear.weight"}, {"router.layer"}),  # never ".weight"
    "falcon_mamba": ({"in_proj", "x_proj"}, {"out_proj"}, set(), set()),  # peft refuses out_proj in Mamba models
    "deepseek_v4": ({"o_b_proj", "q_a_proj"}, {"o_a_proj"}, {"gate_up_proj"}, set()),  # grouped: not a Linear
    "falcon": ({"query_key_value", "dense_h_to_4h"}, set(), set(), set()),  # FalconLinear: only its forward is its own
    "gpt2": ({"c_attn", "c_fc", "c_proj"}, set(), set(), set()),  # Conv1D
    # gate_up_proj [n_routed + zero_expert_num, ...] beside down_proj [n_routed, ...]: experts all the same
    "longcat_flash": ({"q_a_proj", "gate_proj"}, {"classifier"}, {"gate_up_proj", "down_proj"}, {"router.classifier"}),
}


@pytest.mark.parametrize("mt", TARGET_CASES)
def test_all_linear_targets_read_from_the_module_structure(mt):
    from transformers import AutoConfig

    from sftrecipes.model.lora import lora_targets
    from sftrecipes.tiny_archs import tiny_config

    want, never, experts, routers = TARGET_CASES[mt]
    model = meta.build(AutoConfig.for_model(**tiny_config(mt)))
    recipe = load_recipe(["recipes/tiny/lora.yaml"])
    t = lora_targets(recipe, model)
    assert want <= set(t["target_modules"]) and not never & set(t["target_modules"]), t["target_modules"]
    assert set(t["target_parameters"] or ()) >= experts and "weight" not in (t["target_parameters"] or ()), t
    found = moe_layout(model)[1]
    assert {r for r in routers if any(n.endswith(r) for n in found)} == routers, found
    if mt == "falcon_mamba":  # named in a list, the same module is one line naming why
        with pytest.raises(RecipeError, match=r"lora_target_modules: 'out_proj' cannot take LoRA here \(.*Mamba"):
            lora_targets(load_recipe(["recipes/tiny/lora.yaml", "--lora_target_modules", "in_proj,out_proj"]), model)


# the modules ZeRO-3 must fetch whole (leaves): every experts module with submodules, and Qwen4-exp's sparse-attention
# indexer, which calls its key norm once per query with a complete block (a count each rank's batch decides)
LEAF_CASES = {"qwen2_moe": {"Qwen2MoeExperts"}, "deepseek_v3": {"DeepseekV3Experts"}, "llama4_text": {"Llama4TextExperts"},
              "longcat_flash": {"LongcatFlashExperts"}, "qwen4_exp_text": {"Qwen4ExpTextExperts", "Qwen4ExpTextQSAIndexer"},
              "llama": set(), "gemma3": set(), "qwen3_5": set()}


@pytest.mark.parametrize("mt", LEAF_CASES)
def test_zero3_leaves_are_the_modules_whose_calls_the_data_decides(mt):
    """ZeRO-3 requires every rank to run the same modules in the same order: a module that calls its submodules as
    often as its data says (an experts module's loop over the experts hit, Qwen4-exp's indexer over its queries) is a
    ZeRO-3 leaf under ZeRO-3; the decoder-layer list and what holds it never are (the model gathered whole); nothing is
    marked under another backend."""
    from transformers import AutoConfig

    from sftrecipes.model.wrapping import zero3_leaves
    from sftrecipes.tiny_archs import tiny_config

    model = meta.build(AutoConfig.for_model(**tiny_config(mt)))
    assert zero3_leaves(model, load_recipe(["recipes/tiny/fsdp.yaml"])) == []
    assert not any(getattr(m, "_z3_leaf", False) for m in model.modules())
    marked = zero3_leaves(model, load_recipe(["recipes/tiny/zero3.yaml"]))
    assert set(marked) == LEAF_CASES[mt]
    leaves = {type(m).__name__ for m in model.modules() if getattr(m, "_z3_leaf", False)}
    assert leaves == LEAF_CASES[mt]
    prefix, _ = meta.decoder_layers(model)
    assert not any(getattr(model.get_submodule(p), "_z3_leaf", False) for p in (prefix, prefix.rpartition(".")[0]) if p)


# architectures whose checkpoints store adapted tensors in another layout than the model holds, and what the merge
# must change in the stored files: Laguna renames shared_experts (and peft 0.21's loader leaves their LoRA at its
# init), Sarvam-MoE stacks q/k/v in query_key_value, Lara-mini stacks its linear attention's input projections,
# HRM renames its H/L modules
STORED_LAYOUTS = {"laguna": "shared_expert.", "sarvam_moe": "query_key_value", "lara_mini": "linear_attn.", "hrm_text": "H_module."}


@pytest.mark.parametrize("mt", STORED_LAYOUTS)
def test_merge_writes_the_stored_layout_and_verifies(mt, arch_models, tmp_path, caplog):
    """The streaming merge maps each adapted tensor to the tensors the checkpoint stores (renamed, or a piece of a
    stacked one), so merge --verify holds against peft's unmerged adapter; where peft's loader leaves LoRA tensors
    unloaded (Laguna) the reference puts them in by name and a warning says so."""
    import torch
    from peft import get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from sftrecipes.model import compat
    from sftrecipes.model.lora import lora_config

    folder = arch_models(mt)
    compat.keep_dense_linears_in_moe_conversion()
    base = AutoModelForCausalLM.from_pretrained(folder)
    model = get_peft_model(base, lora_config(lora_recipe(folder, "--lora_dropout", "0"), [], base))
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.05)
    model.save_pretrained(tmp_path / "adapter")
    with caplog.at_level("WARNING", logger="sftrecipes"):
        merge_lora(tmp_path / "adapter", tmp_path / "merged", base=str(folder), verify=True)
    said = [r.getMessage() for r in caplog.records if "PeftModel.from_pretrained left" in r.getMessage()]
    assert (len(said) == 1 and "shared_experts" in said[0]) if mt == "laguna" else not said, said
    merged, stored = load_file(tmp_path / "merged" / "model.safetensors"), load_file(folder / "model.safetensors")
    assert merged.keys() == stored.keys()
    mark = STORED_LAYOUTS[mt]
    moved = {k for k in stored if mark in k and not torch.equal(merged[k], stored[k])}
    assert moved and moved == {k for k in stored if mark in k and k.endswith("proj.weight") or mark == "query_key_value" and mark in k}


def test_conv1d_adapter_merges_like_peft(tmp_path):
    """GPT-2's Conv1D weights are [in, out]: peft adapts them with fan_in_fan_out, and the streaming merge adds
    (B @ A) transposed; the merged model's logits are peft's merge_and_unload's."""
    import torch
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from sftrecipes.model.lora import lora_config
    from sftrecipes.tiny_archs import tiny_config

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config("gpt2")))
    base.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(base, lora_config(load_recipe(["recipes/tiny/lora.yaml"]), [], base))
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    assert peft_model.peft_config["default"].fan_in_fan_out
    peft_model.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    want = peft_model.merge_and_unload().eval()(input_ids=ids).logits
    merge_lora(tmp_path / "adapter", tmp_path / "merged", base=str(tmp_path / "base"), dtype="float32")
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-5


def test_layouts_the_sweep_found_unread(tmp_path):
    """What the sweep found each of these do, read from the model: a sparse-attention indexer reads the dense mask
    (DeepSeek-V3.2: sft_varlen and flash give it none); a config declaring router logits without experts gets no
    load-balancing loss (Doge); a get_decoder() that is an output head (ModernBERT-decoder) still finds the layers;
    config.json's {"__float__": "Infinity"} reads back as inf (Bamba's time_step_limit)."""
    import types

    from transformers import AutoConfig

    from sftrecipes.model import attnchoice
    from sftrecipes.model import fallbacks
    from sftrecipes.model.attnchoice import VARLEN
    from sftrecipes.facts.config import read_config
    from sftrecipes.tiny_archs import tiny_config

    cfg = AutoConfig.for_model(**tiny_config("deepseek_v32"))
    built = meta.build(cfg)
    support = attnchoice.support_of(type(built), attnchoice.attention_traits(cfg, built))
    assert "indexer" in support.why_not[VARLEN] and "flash_attention_2" in support.why_not
    assert support.runs("sdpa") and support.runs("eager")
    v3 = AutoConfig.for_model(**tiny_config("deepseek_v3"))
    assert "a sparse-attention indexer" not in attnchoice.attention_traits(v3, meta.build(v3))

    args = types.SimpleNamespace(router_aux_loss_coef=None)
    fallbacks.no_aux_loss_without_experts(meta.build(AutoConfig.for_model(**tiny_config("doge"))), args)
    assert args.router_aux_loss_coef == 0.0
    args = types.SimpleNamespace(router_aux_loss_coef=None)
    fallbacks.no_aux_loss_without_experts(meta.build(AutoConfig.for_model(**tiny_config("qwen3_moe"))), args)
    assert args.router_aux_loss_coef is None  # a model with experts keeps TRL's default

    name, layers = meta.decoder_layers(meta.build(AutoConfig.for_model(**tiny_config("modernbert-decoder"))))
    assert name == "model.layers" and len(layers) == 2

    AutoConfig.for_model(**tiny_config("bamba")).save_pretrained(tmp_path)
    assert "Infinity" in (tmp_path / "config.json").read_text()
    assert read_config(str(tmp_path))["time_step_limit"][1] == float("inf")


def test_a_module_run_several_times_a_forward_goes_without_checkpointing_on_zero3(tmp_path):
    """HRM runs its H and L stacks several times a forward; under ZeRO-3 with activation checkpointing DeepSpeed's
    gradient buckets then take their gradients twice in one step (an AssertionError in the first backward; `make
    sweep-two-ranks` launches it). Read from the model: the run goes without checkpointing on ZeRO-3 only, with one
    warning, and the plan sizes the run as it goes (equal to asking for no checkpointing). Other models rerun nothing."""
    from transformers import AutoConfig

    from sftrecipes.model import fallbacks
    from sftrecipes.tiny_archs import tiny_config

    AutoConfig.for_model(**tiny_config("hrm_text")).save_pretrained(tmp_path)
    assert meta.reruns(meta.build(AutoConfig.for_model(**tiny_config("hrm_text")))) == \
        "HrmTextModel runs its L_module and H_module several times a forward"
    for mt in ("qwen3_5", "zamba2", "qwen4_exp"):  # hybrid layers sharing a block, a data-sized indexer loop (a leaf)
        assert meta.reruns(meta.build(AutoConfig.for_model(**tiny_config(mt)))) == "", mt

    def recipe(twin, *flags):
        return load_recipe([f"recipes/tiny/{twin}.yaml", "--model_name_or_path", str(tmp_path), *flags])

    zero3 = recipe("zero3")
    assert zero3.gradient_checkpointing
    plan = plan_recipe(zero3, _alternatives=False)
    without = plan_recipe(recipe("zero3", "--gradient_checkpointing", "false"), _alternatives=False)
    assert plan.phases == without.phases and plan.peak == without.peak
    assert any(n.startswith("gradient_checkpointing: the run goes without: HrmTextModel runs its L_module and H_module")
               and "DeepSpeed#4505" in n for n in plan.notes), plan.notes
    line = fallbacks.checkpointing_fallback(zero3)
    assert line.startswith("WARNING gradient_checkpointing: off for this run: HrmTextModel runs") and not zero3.gradient_checkpointing
    fsdp = recipe("fsdp")
    assert fallbacks.checkpointing_fallback(fsdp) is None and fsdp.gradient_checkpointing
    fsdp_plan = plan_recipe(fsdp, _alternatives=False)  # checkpointed there, and planned so
    assert not any("checkpointing" in n for n in fsdp_plan.notes)
    assert fsdp_plan.phases != plan_recipe(recipe("fsdp", "--gradient_checkpointing", "false"), _alternatives=False).phases
