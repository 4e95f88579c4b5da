"""sftrecipes.facts.shape: every shipped config against the model transformers builds from it (meta device, real size),
LoRA counts against peft's own, the config-class defaults, the load-dtype rule in the planner, MoE in the planner."""

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import ROOT
from sftrecipes.model import meta
from sftrecipes.facts import config as configs
from sftrecipes.facts import shape_table
from sftrecipes.plan import sharding
from sftrecipes.plan import main, plan_recipe
from sftrecipes.plan.sharding import GB
from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.load import load_recipe
from sftrecipes.facts.config import model_shape, read_config

# published totals (model cards / safetensors indexes), in billions, and active parameters of the MoE models
PUBLISHED = {
    "meta-llama/Llama-3.1-8B": 8.03, "meta-llama/Llama-3.1-70B": 70.55, "Qwen/Qwen2.5-7B": 7.62,
    "Qwen/Qwen2.5-0.5B": 0.49, "Qwen/Qwen3-8B": 8.19, "Qwen/Qwen3-32B": 32.76, "Qwen/Qwen3-30B-A3B": 30.53,
    "mistralai/Mistral-7B-v0.3": 7.25, "google/gemma-2-9b": 9.24, "microsoft/Phi-3-mini-4k-instruct": 3.82,
    "mistralai/Mixtral-8x7B-v0.1": 46.70,
    "google/gemma-3-12b-pt": 11.77,  # the text decoder (shipped as gemma3_text); the card's 12.2B adds the vision tower
}
ACTIVE = {"Qwen/Qwen3-30B-A3B": 3.3, "mistralai/Mixtral-8x7B-v0.1": 12.9}
SHIPPED = sorted(p.stem.replace("--", "/") for p in configs.CONFIGS.glob("*.json"))
MOE = ["Qwen/Qwen3-30B-A3B", "mistralai/Mixtral-8x7B-v0.1"]


_models: dict = {}


def meta_model(key, config: dict):
    """The model transformers builds from a config, on the meta device; one per key for the whole module (peft
    cases unload their adapters again)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if key not in _models:
        with torch.device("meta"):
            _models[key] = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    return _models[key]


def model_tensors(model) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def shape_tensors(s) -> dict[str, tuple[int, ...]]:
    out = {f"model.layers.{i}.{w.param_name}": w.dims for i, layer in enumerate(s.decoder) for w in layer.weights}
    out.update({"model.embed_tokens.weight": (s.vocab, s.hidden), "model.norm.weight": (s.hidden,)})
    if not s.tied:
        out["lm_head.weight"] = (s.vocab, s.hidden)
    return out


# ----------------------------------------------------------------------------------------------- parameter counts


def test_every_published_model_is_shipped():
    assert set(PUBLISHED) <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_is_the_model_weight_by_weight(name):
    """Exact: the same tensor names with the same dims as the model transformers 5.24 builds, hence the same count."""
    model = meta_model(name, read_config(name))
    s = model_shape(name)
    assert shape_tensors(s) == model_tensors(model)
    assert s.params == sum(p.numel() for p in model.parameters())
    if name in PUBLISHED:
        assert round(s.params / 1e9, 2) == PUBLISHED[name]
    # MoE cards round the active count (Qwen3-30B-A3B: "3.3B activated" for 3.35B, embeddings and head included)
    assert s.active_params / 1e9 == pytest.approx(ACTIVE[name], abs=0.06) if name in ACTIVE else s.active_params == s.params


def test_multimodal_config_is_counted_whole():
    """Gemma-3's hub config.json nests the decoder in text_config beside a SigLIP vision tower: the shape is the model
    transformers builds (Gemma3ForConditionalGeneration), vision tower and projector included; its decoder layers are
    the flat text model's."""
    flat = read_config("google/gemma-3-12b-pt")
    nested = {"model_type": "gemma3", "text_config": {k: v for k, v in flat.items() if k != "model_type"},
              "vision_config": {"model_type": "siglip_vision_model"}}
    s, text = model_shape(nested), model_shape(flat)
    model = meta.meta_model(nested)
    assert s.params == sum(p.numel() for p in model.parameters())
    assert [set(L.weights) for L in s.decoder] == [set(L.weights) for L in text.decoder]
    assert s.params - text.params == sum(w.numel for w in s.rest) - text.hidden > 0.05e9  # SigLIP and the projector
    assert {w.name.split(".")[1] for w in s.rest} >= {"vision_tower", "multi_modal_projector"}


@pytest.mark.parametrize("model_type", list(shape_table.DEFAULTS))
def test_defaults_are_the_config_classes(model_type):
    """A config.json that leaves keys out gets the config class's defaults: an empty config is the class default."""
    from transformers import AutoConfig

    model = meta_model(("default", model_type), {"model_type": model_type})
    s = model_shape({"model_type": model_type})
    assert shape_tensors(s) == model_tensors(model)
    assert dataclasses.replace(model_shape(AutoConfig.for_model(model_type).to_dict()), name="") == \
        dataclasses.replace(s, name="")


SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
LAYOUTS = {  # dense layers among sparse ones, a shared expert, biases, explicit head_dim
    "qwen3_moe-dense-layers": dict(SMALL, model_type="qwen3_moe", mlp_only_layers=[0], decoder_sparse_step=2, head_dim=8,
                                   attention_bias=True),
    "qwen2_moe-shared-expert": dict(SMALL, model_type="qwen2_moe", shared_expert_intermediate_size=48, mlp_only_layers=[2]),
    "llama-biases": dict(SMALL, model_type="llama", attention_bias=True, mlp_bias=True, head_dim=32),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_weight_by_weight(layout):
    s = model_shape(LAYOUTS[layout])
    assert shape_tensors(s) == model_tensors(meta_model(layout, LAYOUTS[layout]))
    if s.moe:
        kinds = ["sparse" if layer.experts else "dense" for layer in s.decoder]
        assert kinds == (["dense", "sparse", "dense", "sparse"] if layout.startswith("qwen3") else
                         ["sparse", "sparse", "dense", "sparse"])


# ----------------------------------------------------------------------------------------------- LoRA: the table = the run


def run_count(name, targets: str, r: int, router: bool = False) -> int:
    """The trainable parameters the run creates: peft applying lora.lora_config (train.py's LoraConfig, targets
    resolved on the model, compat's MoE conversion fix) to the model transformers builds, on the meta device."""
    recipe = load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path", name, "--lora_target_modules", targets,
                          "--lora_r", str(r), "--lora_alpha", str(2 * r), "--lora_target_router", str(router).lower()])
    return meta.lora_layout(recipe, model_shape(name)).trainable


LLAMA_NAMES = "q_proj,k_proj,v_proj,o_proj,down_proj,up_proj,gate_proj"  # the schema's default lora_target_modules
EXPLICIT = {"microsoft/Phi-3-mini-4k-instruct": ["qkv_proj,down_proj"],
            "Qwen/Qwen3-30B-A3B": ["q_proj,v_proj", LLAMA_NAMES, "gate_up_proj,down_proj,q_proj"],  # fused experts
            "mistralai/Mixtral-8x7B-v0.1": ["q_proj,v_proj", "q_proj,v_proj,w1,w2,w3"]}  # and Mixtral's w1/w3, w2


def lora_cases():
    for name in sorted(PUBLISHED):
        for targets in ["all-linear", *EXPLICIT.get(name, ["q_proj,v_proj"])]:
            yield pytest.param(name, targets, id=f"{name}-{targets}")


@pytest.mark.parametrize("name,targets", list(lora_cases()))
def test_table_lora_count_is_the_runs(name, targets):
    """The torch-free table (the planner's fast path) counts what the run trains, router off and on; MoE: the fused
    experts (gate_up_proj at twice the rank), the router only with lora_target_router."""
    s = model_shape(name)
    for r, router in ((8, False), (16, s.moe)):
        assert s.lora_params(targets, r, router=router) == run_count(name, targets, r, router), (r, router)


@pytest.mark.parametrize("layout", ["qwen3_moe-dense-layers", "qwen2_moe-shared-expert"])
def test_lora_count_on_dense_layers_and_shared_experts(layout, tmp_path):
    """Dense layers' MLPs and shared experts are adapted under all-linear beside the fused experts, also where peft's
    v4->v5 conversion would drop them (Qwen3-MoE; compat.keep_dense_linears_in_moe_conversion)."""
    (tmp_path / "config.json").write_text(json.dumps(LAYOUTS[layout]))
    s = model_shape(str(tmp_path))
    for targets in ("all-linear", LLAMA_NAMES):
        assert s.lora_params(targets, 8) == run_count(str(tmp_path), targets, 8), targets
    adapted = {w.name for layer in s.lora_targets("all-linear") for w, _ in layer}
    assert {"mlp.gate_proj", "mlp.experts.gate_up_proj"} <= adapted or {"mlp.shared_expert.gate_proj", "mlp.experts.gate_up_proj"} <= adapted


def test_unknown_target_names_the_models_own():
    cases = {("microsoft/Phi-3-mini-4k-instruct", "q_proj,v_proj"): ("'q_proj'", "qkv_proj"),
             ("mistralai/Mixtral-8x7B-v0.1", LLAMA_NAMES): ("'up_proj'", "w1"),  # Mixtral's experts are w1/w3, w2
             ("Qwen/Qwen3-30B-A3B", "q_proj,gate_proj"): ("'gate_proj' is half", "'up_proj'")}  # peft refuses it too
    for (name, targets), (bad, hint) in cases.items():
        with pytest.raises(RecipeError) as e:
            model_shape(name).lora_params(targets, 8)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"lora_target_modules: {bad}") and hint in msg, msg


# ----------------------------------------------------------------------------------------------- errors, torch-free


def test_a_type_the_table_lacks_is_read_from_the_model(tmp_path):
    """A layout shape.py's table does not hold (Falcon here) is the model transformers builds, not a refusal; a config
    without model_type is one line naming the fix."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon", "hidden_size": 256, "num_hidden_layers": 2,
                                                      "num_attention_heads": 4, "vocab_size": 512}))
    s = model_shape(str(tmp_path))
    assert s.source == "meta" and s.params == sum(p.numel() for p in meta.meta_model(read_config(str(tmp_path))).parameters())
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4544}))
    with pytest.raises(RecipeError, match="no model_type") as e:
        model_shape(str(tmp_path))
    assert "\n" not in str(e.value) and str(e.value).startswith("model_name_or_path:")


def test_shape_and_plan_import_no_torch():
    code = textwrap.dedent("""
        import sys
        from sftrecipes import plan
        from sftrecipes.facts import config as shape
        from sftrecipes.recipe import target
        from sftrecipes.recipe.load import load_recipe
        s = shape.model_shape("Qwen/Qwen3-30B-A3B")
        assert s.lora_params("all-linear", 8) > 0
        p = plan.plan_recipe(load_recipe(["recipes/llama2-70b/lora.yaml", "--model_name_or_path", "Qwen/Qwen3-30B-A3B",
                                          "--lora_dropout", "0"]))
        assert target.load_dtype(load_recipe(["recipes/llama2-70b/lora.yaml"])) == "bfloat16"
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "peft")))
        """)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"


# ----------------------------------------------------------------------------------------------- the planner


def test_memory_constrained_loads_and_plans_in_16_bit():
    """precision memory_constrained: the model loads in bf16 (model.load_dtype) and the planner counts bf16 weights,
    grads and Adam states (2 + 2 + 4 bytes instead of 4 + 4 + 8): model states halve."""
    from sftrecipes.model.load import load_dtype

    base = load_recipe(["recipes/llama2-70b/fsdp.yaml"])
    mc = load_recipe(["recipes/llama2-70b/fsdp.yaml", "--precision", "memory_constrained"])
    assert (load_dtype(base), load_dtype(mc)) == (torch.float32, torch.bfloat16)
    p, q = plan_recipe(base, _alternatives=False), plan_recipe(mc, _alternatives=False)
    assert q.model_states_gb == pytest.approx(p.model_states_gb / 2)
    assert q.gpu_total_gb < p.gpu_total_gb - 30
    # the weights rank 0 reads (fsdp_cpu_ram_efficient_loading) are counted in the dtype they load in: half the RAM
    loading = [next(i.gb for i in plan.cpu if i.name == "loading") for plan in (p, q)]
    assert loading == pytest.approx([p.params * 4 / GB, p.params * 2 / GB])


FSDP_70B, DDP_7B = "recipes/llama2-70b/fsdp.yaml", "recipes/llama2-7b/ddp.yaml"


@pytest.mark.parametrize("argv", [
    [FSDP_70B], [FSDP_70B, "--precision", "memory_constrained"], [FSDP_70B, "--dtype", "bfloat16"],
    [FSDP_70B, "--bf16", "false"], [FSDP_70B, "--bf16", "false", "--fp16", "true", "--precision", "memory_constrained"],
    ["recipes/llama2-70b/lora.yaml"], ["recipes/llama2-70b/qlora-fsdp.yaml"], [DDP_7B, "--bf16", "false"],
    [DDP_7B, "--use_peft_lora", "true", "--use_8bit_quantization", "true"],
    [DDP_7B, "--use_peft_lora", "true", "--use_4bit_quantization", "true", "--bnb_4bit_quant_storage_dtype", "uint8"],
], ids=lambda a: " ".join(a).replace("recipes/", ""))
def test_planner_counts_the_dtype_the_model_loads_in(argv):
    """One load-dtype rule (shape.load_dtype) for the loader and the planner: the bytes per weight the planner's
    loading RAM counts are those of the dtype model.load_dtype loads in, for every precision setting -- a copy of the
    rule on either side that drifts in one case fails here."""
    from sftrecipes.recipe.target import EVERY_RANK, RANK0_READS, weight_reading
    from sftrecipes.model.load import load_dtype

    recipe = load_recipe(argv)
    plan = plan_recipe(recipe, _alternatives=False)
    loading = next(i for i in plan.cpu if i.name == "loading")
    quantized = recipe.model.use_4bit_quantization or recipe.model.use_8bit_quantization
    mode, why = weight_reading(recipe, quantized)  # the loader's rule; the plan states it
    assert why in loading.note
    if mode == RANK0_READS and not quantized:  # fsdp_cpu_ram_efficient_loading: rank 0 reads the whole model
        per_weight = loading.gb * GB / plan.params
    elif mode == EVERY_RANK and not quantized:  # every rank reads the whole model, in the load dtype
        per_weight = loading.gb * GB / recipe.launch.gpus_per_node / plan.params
    else:  # quantized / zero.Init: streamed shard by shard, so the shard cap hides it (4-bit FSDP2: rank 0 too)
        per_weight = sharding.load_bytes(recipe)
    assert per_weight == pytest.approx(load_dtype(recipe).itemsize)


def mixtral_fsdp(*flags):
    return ["recipes/llama2-70b/fsdp.yaml", "--model_name_or_path", "mistralai/Mixtral-8x7B-v0.1",
            "--launch.num_machines", "1", *flags]


def test_mixtral_full_fsdp_on_8x80_does_not_fit(capsys):
    """Full fine-tuning holds weights, grads and Adam states of all 8 experts: 16 B x 46.7B / 8 GPUs = 93 GB each."""
    plan = plan_recipe(load_recipe(mixtral_fsdp()))
    assert plan.params == model_shape("mistralai/Mixtral-8x7B-v0.1").params
    assert plan.model_states_gb * GB == pytest.approx(16 * plan.params / 8)
    assert plan.fits is False and plan.gpu_total_gb > 80
    assert any(a.fits and a.gpus == 16 for a in plan.alternatives)
    assert main(mixtral_fsdp()) == 2
    out = capsys.readouterr().out
    assert "46.70B params (12.88B active per token)" in out and "VERDICT: DOES NOT FIT" in out


def test_moe_lora_plan_counts_router_and_folded_experts(tmp_path):
    """Qwen3-30B-A3B LoRA all-linear: the router is trained only with lora_target_router; adapting the fused experts
    makes peft fold W + s*BA each forward (a full-size copy of every expert tensor, saved for backward, and in
    backward a full-size gradient of it), against the same run adapting the attention only."""
    (tmp_path / "moe.yaml").write_text(textwrap.dedent("""
        model_name_or_path: Qwen/Qwen3-30B-A3B
        dataset_name: data/tiny_chat
        output_dir: outputs/moe
        max_length: 2048
        per_device_train_batch_size: 4
        bf16: true
        use_peft_lora: true
        lora_r: 8
        lora_dropout: 0.0
        lora_target_modules: all-linear
        launch: {backend: deepspeed, zero_stage: 3, gpus_per_node: 8, gpu_memory_gb: 80}
        """))
    lora = [str(tmp_path / "moe.yaml"), "--gradient_checkpointing", "true"]
    no_ckpt = [str(tmp_path / "moe.yaml"), "--gradient_checkpointing", "false"]
    attention = ["--lora_target_modules", "q_proj,k_proj,v_proj,o_proj"]
    s = model_shape("Qwen/Qwen3-30B-A3B")
    plans = {k: plan_recipe(load_recipe(argv), _alternatives=False) for k, argv in {
        "off": lora, "on": lora + ["--lora_target_router", "true"], "attn": lora + attention,
        "off-no-ckpt": no_ckpt, "attn-no-ckpt": no_ckpt + attention}.items()}
    assert plans["off"].trainable == s.lora_params("all-linear", 8)
    assert plans["on"].trainable - plans["off"].trainable == s.layers * 8 * (s.hidden + s.experts)
    assert any("router (mlp.gate): not adapted" in n for n in plans["off"].notes)
    layer = s.decoder[0]
    fold = layer.expert_params * 2  # bf16 under DeepSpeed
    grad = layer.get("mlp.experts.gate_up_proj").numel * 2  # the larger tensor's gradient
    # what is live besides the model states (which differ by the adapters), at the start of backward (every layer's
    # saved tensors) and in the last layer's backward (checkpointed: that layer's recomputed tensors + temporaries)
    # (ZeRO-3's gathers average the bytes per parameter over base and adapters: they differ a little between the two)
    live = lambda p, phase: (p.phases[phase] - p.model_states_gb) * GB  # noqa: E731
    start, last = "start of backward (LM head)", "backward, last layer"
    assert live(plans["off-no-ckpt"], start) - live(plans["attn-no-ckpt"], start) == pytest.approx(s.layers * fold, rel=1e-3)
    assert live(plans["off"], last) - live(plans["attn"], last) == pytest.approx(fold + grad, rel=0.02)


def test_qlora_quantizes_linears_only():
    """bitsandbytes replaces nn.Linear: the fused experts and routers of Mixtral stay in 16-bit floats."""
    q = plan_recipe(load_recipe(["recipes/llama2-70b/qlora.yaml", "--model_name_or_path", "mistralai/Mixtral-8x7B-v0.1",
                                 "--lora_dropout", "0"]), _alternatives=False)
    s = model_shape("mistralai/Mixtral-8x7B-v0.1")
    weights = next(i for i in q.states if i.name.startswith("weights"))
    linear_4bit = s.linear_params * (0.5 + 1 / 64 + 4 / (64 * 256))  # nf4 + nested-quant constants
    assert weights.gb * GB * q.world == pytest.approx(linear_4bit + (s.params - s.linear_params) * 2, rel=1e-6)
    assert any("quantization covers nn.Linear weights only" in n for n in q.notes)


@pytest.mark.parametrize("model_type", list(shape_table.DEFAULTS))
def test_sdpa_table_is_the_model_classes(model_type):
    """The torch-free planner needs to know which models have no sdpa path (attention then runs eager, with its s x s
    scores): its table must say what transformers' classes say."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.for_model(model_type))]
    assert model_shape({"model_type": model_type}).sdpa == cls._supports_sdpa


def test_planned_attention_follows_the_recipe():
    from sftrecipes.plan import plan_recipe

    gemma = load_recipe(["recipes/llama2-7b/ddp.yaml", "--model_name_or_path", "google/gemma-2-9b", "--use_flash_attn", "false"])
    gemma.trl["max_length"] = 1024
    acts = {p.name: p.note for p in plan_recipe(gemma, _alternatives=False).peak}
    assert "eager" in acts["activations"]  # Gemma-2 has no sdpa path: its s x s scores are counted
    llama = load_recipe(["recipes/llama2-7b/ddp.yaml", "--use_flash_attn", "false", "--attn_implementation", "eager"])
    eager = plan_recipe(llama, _alternatives=False).gpu_total_gb
    llama.model.attn_implementation = "sdpa"
    assert plan_recipe(llama, _alternatives=False).gpu_total_gb < eager


# ----------------------------------------------------------------------------------------------- per-layer configs
# transformers' per_layer_config (integrations/heterogeneity): a config may give decoder layers sizes of their own,
# and then refuses to read them as one global value (AmbiguousGlobalPerLayerAttributeError)


def test_gemma4_default_config_validates_and_plans_without_a_traceback(tmp_path):
    """The user's path: a folder with Gemma4TextConfig()'s config.json, whose full-attention layers have head_dim 512
    beside the sliding layers' 256. Recipe validation and `plan` answer (exit 0, no traceback); the plan's parameters
    are the meta-device model's."""
    from transformers import Gemma4TextConfig

    Gemma4TextConfig().save_pretrained(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["per_layer_config"]["05"] == {"head_dim": 512} and config["head_dim"] == 256
    (tmp_path / "r.yaml").write_text(f"base: {ROOT / 'recipes/tiny/lora.yaml'}\nmodel_name_or_path: {tmp_path / 'model'}\n")
    res = subprocess.run([sys.executable, "-m", "sftrecipes", "plan", str(tmp_path / "r.yaml")], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "VERDICT" in res.stdout and "30 layers" in res.stdout
    plan = plan_recipe(load_recipe([str(tmp_path / "r.yaml")]), _alternatives=False)
    assert plan.params == sum(p.numel() for p in meta_model("gemma4-default", config).parameters())


def gemma4_kv_shared() -> dict:
    """A Gemma-4 laid out like the small releases, tiny: KV-sharing last layers with MLPs twice as wide (no config key
    says so), full-attention layers with larger heads and one KV head shared by keys and values (attention_k_eq_v)."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=512, vocab_size_per_layer_input=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, hidden_size_per_layer_input=16,
        layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2, num_kv_shared_layers=4, use_double_wide_mlp=True,
        attention_k_eq_v=True, num_global_key_value_heads=1).to_dict()


@pytest.mark.parametrize("case", ["gemma4-default", "gemma4-kv-shared"])
def test_each_layers_sizes_are_the_models(case):
    """Each decoder layer's heads, KV heads, head size and MLP width as planned are those of the layer transformers
    builds (its attention and MLP modules), and the attention FLOPs sum each layer's own width."""
    from transformers import Gemma4TextConfig

    from sftrecipes.train import flops

    config = Gemma4TextConfig().to_dict() if case == "gemma4-default" else gemma4_kv_shared()
    s, model = model_shape(config), meta_model(case, config)
    layers = model.model.layers
    assert len({L.head_dim for L in s.decoder}) == 2  # the case varies them
    for L, layer in zip(s.decoder, layers, strict=True):
        attn = layer.self_attn
        assert (L.head_dim, L.heads * L.head_dim) == (attn.head_dim, attn.q_proj.out_features)
        assert L.kv_heads == L.heads // attn.num_key_value_groups
        assert L.intermediate == layer.mlp.up_proj.out_features
    with pytest.raises(ValueError, match="head_dim differs by decoder layer"):
        s.head_dim  # noqa: B018 - no one value stands for every layer
    pairs = 1000
    assert flops.step_flops(s, 1, pairs) - flops.step_flops(s, 1, 0) == \
        12 * pairs * sum(layer.self_attn.q_proj.out_features for layer in layers)


@pytest.mark.parametrize("model_type", list(shape_table.DEFAULTS))
def test_the_tables_layer_sizes_are_the_models(model_type):
    """The torch-free table gives each layer the sizes the model transformers builds reads for it (meta.py reads each
    layer's own config)."""
    c = {**SMALL, "model_type": model_type, "pad_token_id": 0}
    table = model_shape(c)
    built = meta.meta_shape(c, model_type)
    assert table.source == "table" and built.source == "meta"
    sizes = [[(L.heads, L.kv_heads, L.head_dim, L.intermediate) for L in s.decoder] for s in (table, built)]
    assert sizes[0] == sizes[1]


def test_per_layer_overrides_go_to_the_model_and_a_global_reader_is_one_line():
    """The table never reads a global size that per_layer_config overrides: such a config is the meta path's, and a
    modeling class that reads the size once for every layer (Llama's MLP) is one line naming the key."""
    c = {**SMALL, "model_type": "llama", "per_layer_config": {"1": {"intermediate_size": 64}}}
    with pytest.raises(RecipeError) as e:
        model_shape(c)
    assert str(e.value) == ("model_name_or_path: the model config gives decoder layers their own 'intermediate_size' "
                            "(per_layer_config), which transformers' llama model reads as one value for all; remove "
                            "'intermediate_size' from per_layer_config")
