"""LoRA as peft has it. Mixture-of-experts models (Qwen3-MoE, Mixtral): the router is left alone unless
lora_target_router says so, the fused expert tensors are adapted as peft does under all-linear, lora_dropout != 0
is refused before anything loads, and the adapter of fused expert tensors exports and merges (final save, checkpoint-N,
a sharded checkpoint) to exactly peft's own merge. peft's LoraConfig options as recipe keys: each seen in the saved
adapter and in the merged model, which equals peft's merge_and_unload and passes --verify.

Runs are single-process and in-process (train.run), 3 steps each, shared by the module's tests."""

import json
import logging
import math
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT

from sftrecipes import export as ex
from sftrecipes.facts.folders import local_model_dir as _local_model_dir
from sftrecipes.export.verify import _base_for_adapter
from sftrecipes.recipe import schema
from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.load import load_recipe

MOE = ["qwen3_moe", "mixtral"]
R, ALPHA = 8, 16  # recipes/tiny/lora.yaml
STEPS = ["--max_steps", "3", "--sample_max_new_tokens", "0", "--save_strategy", "steps", "--save_steps", "2"]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def runs(family_models, tiny_model, tmp_path_factory):
    """name -> (output_dir, the run's 'LoRA adapts ...' log line) of a 3-step recipes/tiny/lora.yaml run on the given
    model with extra flags; trained on first use."""
    import train

    root = tmp_path_factory.mktemp("lora")
    done = {}

    def get(name, model, *flags):
        if name not in done:
            out = root / name
            handler, logger = _Lines(), logging.getLogger("sftrecipes")
            level = logger.level
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            try:
                path = family_models[model] if model in family_models else ROOT / ".assets" / f"tiny-{model}"
                train.run(load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path", str(path), "--output_dir", str(out),
                                       *STEPS, *map(str, flags)]))
            finally:
                logger.removeHandler(handler)
                logger.setLevel(level)
            done[name] = (out, next(line for line in handler.lines if line.startswith("LoRA adapts")))
        return done[name]

    return get


def base_dir(run):
    return _local_model_dir(json.loads((run / "adapter_config.json").read_text())["base_model_name_or_path"])


def peft_merged(adapter, base=None):
    """peft's own merge of an adapter folder: the base in fp32 (resized as the run resized it), merge_and_unload."""
    from peft import PeftModel

    base = base or base_dir(adapter)
    return PeftModel.from_pretrained(_base_for_adapter(base, adapter), adapter).merge_and_unload()


def assert_merge_equals_peft(merged_dir, adapter):
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).state_dict()
    ref = peft_merged(adapter).state_dict()
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    for k in ours:  # fp32, one rounding apart at most (W + s*B@A in place vs peft's einsum then add)
        torch.testing.assert_close(ours[k], ref[k], atol=1e-6, rtol=1e-5, msg=k)


# ---------------------------------------------------------------------------------------------- mixture of experts

def moe_run(runs, family):
    return runs(family, family)


@pytest.mark.parametrize("family", MOE)
def test_moe_router_off_by_default_on_with_the_key(runs, family):
    """all-linear on an MoE model adapts attention and the fused expert tensors (gate_up_proj at 2r per expert, i.e.
    r per projection, down_proj at r) but not the router; lora_target_router: true adds the router. The log line
    says which, and its trainable count is the adapter's trained tensors' size."""
    off, off_line = moe_run(runs, family)
    on, on_line = runs(f"{family}-router", family, "--lora_target_router", "true")
    a_off, a_on = load_file(off / "adapter_model.safetensors"), load_file(on / "adapter_model.safetensors")
    router = {n for n in a_on if ".mlp.gate." in n}
    assert router == {f"base_model.model.model.layers.{i}.mlp.gate.lora_{x}.weight" for i in (0, 1) for x in "AB"}
    assert not any(".mlp.gate." in n for n in a_off) and set(a_on) - router == set(a_off)
    experts = json.loads((base_dir(off) / "config.json").read_text())["num_local_experts"]
    pre = "base_model.model.model.layers.0.mlp.experts"
    assert a_off[f"{pre}.base_layer.lora_A.weight"].shape[0] == 2 * R * experts  # gate_up_proj: inner wrapper
    assert a_off[f"{pre}.lora_A.weight"].shape[0] == R * experts  # down_proj: outer wrapper
    assert {n.split(".")[-3] for n in a_off if "self_attn" in n} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert "expert parameters down_proj (r 8), gate_up_proj (r 16); router not adapted (lora_target_router: false)" in off_line
    assert "router gate.weight (r 8) (lora_target_router: true)" in on_line
    for adapter, line in ((a_off, off_line), (a_on, on_line)):
        trainable = int(re.search(r"([\d,]+) trainable parameters", line).group(1).replace(",", ""))
        # the resized embeddings saved beside added-token rows (Mixtral's tokenizer lacks ChatML's tokens) are not trained
        assert trainable == sum(t.numel() for n, t in adapter.items() if ".token_adapter.base_layer." not in n)


@pytest.mark.parametrize("family", MOE)
def test_moe_lora_dropout_reaches_the_modules_not_the_experts(family_models, family):
    """A twin inheriting lora_dropout 0.1 from the 70B recipe, pointed at an MoE model: peft refuses dropout on an
    adapter with parameter targets, so the adapted modules get it after injection and the expert parameters none; the
    log line says so. An adapter of parameters only has nowhere to put it: one line."""
    from peft import get_peft_model
    from peft.tuners.lora import ParamWrapper
    from peft.tuners.lora import Linear as LoraLinear
    from transformers import AutoModelForCausalLM

    from sftrecipes.model.lora import describe_adapter, lora_config, module_dropout

    recipe = load_recipe(["recipes/tiny/zero3.yaml", "--model_name_or_path", str(family_models[family])])
    assert recipe.model.lora_dropout == 0.1
    model = AutoModelForCausalLM.from_pretrained(family_models[family])
    config = lora_config(recipe, [], model)
    assert config.lora_dropout == 0.0 and config.target_parameters
    peft_model = get_peft_model(model, config)
    linears = [m for m in peft_model.modules() if isinstance(m, LoraLinear)]
    wrappers = [m for m in peft_model.modules() if isinstance(m, ParamWrapper)]
    assert linears and wrappers
    assert module_dropout(peft_model, recipe) == len(linears)
    assert all(isinstance(m.lora_dropout["default"], torch.nn.Dropout) and m.lora_dropout["default"].p == 0.1 for m in linears)
    assert all(isinstance(m.lora_dropout["default"], torch.nn.Identity) for m in wrappers)
    assert "dropout 0.1 on the modules, none on the parameters" in describe_adapter(peft_model, recipe)
    peft_model.train()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    torch.manual_seed(0)
    a = peft_model(input_ids=ids).logits
    b = peft_model(input_ids=ids).logits
    peft_model.eval()
    assert torch.equal(peft_model(input_ids=ids).logits, peft_model(input_ids=ids).logits)
    # LoRA B starts at zero: dropout cannot change the output yet; after a step on B it does, in training only
    assert torch.equal(a, b)
    with torch.no_grad():
        for m in linears:
            m.lora_B["default"].weight.normal_(0, 0.5)
    peft_model.train()
    assert not torch.equal(peft_model(input_ids=ids).logits, peft_model(input_ids=ids).logits)

    only = load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path", str(family_models[family]),
                        "--lora_target_modules", "gate_up_proj,down_proj", "--lora_dropout", "0.1"])
    with pytest.raises(RecipeError, match=r"^lora_dropout: 0.1 applies to no module here: LoRA adapts only parameters .*set lora_dropout: 0.0$"):
        lora_config(only, [], AutoModelForCausalLM.from_pretrained(family_models[family]))


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("flags, fragment", [
    (["--use_dora", "true"], "use_dora: DoRA cannot adapt the expert parameters that all-linear adapts"),
    (["--init_lora_weights", "orthogonal"], "init_lora_weights: orthogonal cannot initialise the expert parameters"),
    (["--lora_target_modules", "q_proj,w2", "--use_dora", "true"], "use_dora: DoRA cannot adapt the expert parameters of this mixture-of-experts model (w2)"),
    (["--lora_target_modules", "q_proj", "--lora_target_router", "true", "--use_dora", "true"], "cannot adapt the router"),
])
def test_moe_parameter_targets_refuse_what_peft_cannot_do(family_models, family, flags, fragment):
    """peft's parameter wrapper has no DoRA, and orthogonal init reads a module weight experts lack: refused when the
    recipe is read. Attention-only LoRA on the same model keeps DoRA."""
    base = ["recipes/tiny/lora.yaml", "--model_name_or_path", str(family_models[family])]
    with pytest.raises(RecipeError) as e:
        load_recipe(base + flags)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert load_recipe(base + ["--lora_target_modules", "q_proj,v_proj", "--use_dora", "true"]).peft["use_dora"] is True


def test_lora_config_on_the_model_refuses_what_validation_could_not_see(family_models):
    """A hub id without a shipped config.json validates without knowing it is an MoE model; building the LoRA config
    on the loaded model then refuses DoRA on its experts with the same one line (here: a recipe for the dense tiny
    model, handed the MoE model)."""
    from transformers import AutoModelForCausalLM

    from sftrecipes.model.lora import lora_config

    r = load_recipe(["recipes/tiny/lora.yaml", "--use_dora", "true"])
    with pytest.raises(RecipeError, match=r"^use_dora: True cannot apply to the parameters .*set use_dora: false$"):
        lora_config(r, [], AutoModelForCausalLM.from_pretrained(family_models["qwen3_moe"]))
    # names that match nothing are one line too, not peft's error after loading (or a silently smaller adapter)
    llama = AutoModelForCausalLM.from_pretrained(family_models["llama3"])
    with pytest.raises(RecipeError, match="target_parameters: 'mlp.nothing.weight' matches no parameter"):
        lora_config(load_recipe(["recipes/tiny/lora.yaml", "--lora_target_modules", "q_proj", "--target_parameters",
                                        "mlp.nothing.weight"]), [], llama)
    with pytest.raises(RecipeError, match="lora_target_modules: 'qkv_proj' matches no module .* its linear layers are down_proj"):
        lora_config(load_recipe(["recipes/tiny/lora.yaml", "--lora_target_modules", "qkv_proj,o_proj"]), [], llama)


@pytest.mark.parametrize("family", MOE)
def test_moe_adapter_exports_and_merges_like_peft(runs, tmp_path, family, capsys):
    """The final adapter, its checkpoint-2 and the router-on adapter export (--verify: logits against peft's unmerged
    model) and merge into the base as it is stored (one tensor per expert and projection), equal to peft's own
    merge_and_unload in fp32."""
    from transformers import AutoModelForCausalLM

    run, _ = moe_run(runs, family)
    router, _ = runs(f"{family}-router", family, "--lora_target_router", "true")
    for i, adapter in enumerate((run, run / "checkpoint-2", router)):
        merged = ex.export(adapter, tmp_path / f"merged{i}", verify=True)
        assert "verify: max abs logits difference" in capsys.readouterr().out
        assert_merge_equals_peft(merged, adapter)
        stored = set(ex.folder_tensors(merged))
        assert stored == set(ex.folder_tensors(base_dir(run)))  # written in the base's own (per-expert) layout
    merged = ex.merge_lora(run, tmp_path / "via-merge", dtype="bfloat16")
    assert AutoModelForCausalLM.from_pretrained(merged).dtype == torch.bfloat16


@pytest.mark.parametrize("family", MOE)
def test_moe_adapter_errors_blame_the_right_thing(runs, family_models, tmp_path, family):
    """On the other MoE family or a dense model the expert LoRA does not fit: 'wrong base', before anything is
    written; an adapter feature the merge does not apply is named."""
    run, _ = moe_run(runs, family)
    other = "mixtral" if family == "qwen3_moe" else "qwen3_moe"
    for base in (family_models[other], family_models["llama3"]):
        with pytest.raises(RecipeError, match="wrong (--)?base") as e:
            ex.export(run, tmp_path / "out", base=str(base))
        assert "\n" not in str(e.value)
    odd = tmp_path / "odd"
    shutil.copytree(run, odd)
    cfg = json.loads((odd / "adapter_config.json").read_text())
    (odd / "adapter_config.json").write_text(json.dumps({**cfg, "lora_bias": True}))
    with pytest.raises(RecipeError, match="lora_bias .* is not supported by the streaming merge"):
        ex.export(odd, tmp_path / "out")
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("family", MOE)
def test_moe_sharded_checkpoint_exports_the_adapter(runs, tmp_path, family, capsys):
    """A sharded (FSDP SHARDED_STATE_DICT) checkpoint of the run: accelerate saves {'model': state_dict} as DCP, so the
    expert LoRA arrives as 'model.base_model.model....experts.base_layer.lora_A.default.weight'. It exports to the
    same adapter the run saved (exactly), verified against peft's model holding the DCP-read tensors."""
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel

    run, _ = moe_run(runs, family)
    ckpt = tmp_path / "run" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    model = PeftModel.from_pretrained(_base_for_adapter(base_dir(run), run), run)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"))
    shutil.copy(run / "adapter_config.json", ckpt.parent)  # FSDP: only the final save in output_dir has it
    out = ex.export(ckpt, tmp_path / "adapter", verify=True)
    assert "verify: max abs logits difference 0 " in capsys.readouterr().out
    ours, saved = load_file(out / "adapter_model.safetensors"), load_file(run / "adapter_model.safetensors")
    assert set(ours) == set(saved) and all(torch.equal(ours[k], saved[k]) for k in ours)


@pytest.mark.parametrize("family", MOE)
def test_moe_target_lists(family_models, family):
    """An explicit list on an MoE model: the expert tensors by their own names, or by the projections fused into them
    (gate_proj+up_proj, w1+w3, w2), adapt exactly what all-linear adapts; half of a fused pair, or the router by
    name, is a one-line error."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from sftrecipes.model.lora import lora_config

    path = str(family_models[family])

    def adapted(targets):
        r = load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path", path, "--lora_target_modules", targets])
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), lora_config(r, [], AutoModelForCausalLM.from_pretrained(path)))
        return {n: tuple(p.shape) for n, p in peft_model.named_parameters() if p.requires_grad}

    everything = adapted("all-linear")
    assert any(".experts.base_layer.lora_A" in n for n in everything)
    for spelled in ("q_proj,k_proj,v_proj,o_proj,gate_up_proj,down_proj", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                    "q_proj,k_proj,v_proj,o_proj,w1,w3,w2"):
        assert adapted(spelled) == everything, spelled
    with pytest.raises(RecipeError, match="gate_proj and up_proj are one tensor \\(gate_up_proj\\).*list both"):
        adapted("q_proj,gate_proj")
    with pytest.raises(RecipeError, match="'gate' is the router .* set lora_target_router: true"):
        load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path", path, "--lora_target_modules", "q_proj,gate"])


# ---------------------------------------------------------------------------------------- peft's LoraConfig options

def lora_pairs(adapter: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (lora_A, lora_B) of a saved adapter."""
    out = {}
    for n, t in adapter.items():
        m = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", n)
        if m:
            out.setdefault(m.group(1), [None, None])["AB".index(m.group(2))] = t
    return {k: tuple(v) for k, v in out.items()}


DORA_RUN = ("dora", "llama", "--use_dora", "true", "--modules_to_save", "lm_head", "--layers_to_transform", "1",
            "--layers_pattern", "layers", "--exclude_modules", r".*\.o_proj", "--init_lora_weights", "gaussian",
            "--chat_template_format", "zephyr")  # zephyr adds 3 tokens: the embeddings grow, lm_head is trained whole
PATTERN_RUN = ("patterns", "qwen2", "--use_rslora", "true", "--rank_pattern", '{"layers\\\\.1\\\\.self_attn\\\\.q_proj": 4}',
               "--alpha_pattern", '{"v_proj": 32}', "--init_lora_weights", "false", "--lora_target_modules", "q_proj,v_proj",
               "--target_parameters", "mlp.down_proj.weight", "--bias", "all")
ORTHOGONAL_RUN = ("orthogonal", "llama", "--init_lora_weights", "orthogonal", "--learning_rate", "0", "--max_steps", "1")


def test_dora_modules_to_save_layers_exclude_gaussian(runs, tmp_path, capsys):
    """use_dora: a magnitude vector beside every LoRA pair, merged as W' = m (W + sBA)/||W + sBA|| like peft's merge;
    modules_to_save: the whole (resized, trained) lm_head in the adapter and in the merged model, the added tokens'
    rows trained there and in the input embeddings (trainable tokens);
    layers_to_transform [1] + layers_pattern 'layers': no LoRA in layer 0; exclude_modules (a regex): no o_proj;
    init_lora_weights gaussian: lora_A drawn N(0, 1/r), far wider than the default kaiming-uniform bound 1/sqrt(in)
    (64 inputs: 0.125; 3 Adam steps at lr 1e-2 move a value by at most ~0.03)."""
    run, line = runs(*DORA_RUN)
    adapter = load_file(run / "adapter_model.safetensors")
    pairs = lora_pairs(adapter)
    assert pairs and all(".layers.1." in m for m in pairs) and not any("o_proj" in m for m in pairs)
    assert {m.rsplit(".", 1)[-1] for m in pairs} == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"}
    assert {n.removesuffix(".lora_magnitude_vector") for n in adapter if n.endswith(".lora_magnitude_vector")} == \
           {f"base_model.model.{m}" for m in pairs}
    assert max(a.abs().max().item() for a, _ in pairs.values()) > 0.25
    head = adapter["base_model.model.lm_head.weight"]
    base_head = load_file(ROOT / ".assets/tiny-llama/model.safetensors")["lm_head.weight"]
    assert head.shape == (515, 64) and (head[:512] - base_head).abs().max() > 1e-3  # trained, with the added rows
    assert "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta" in adapter
    assert not any("lm_head.token_adapter" in n for n in adapter)  # lm_head is whole in modules_to_save
    merged = ex.export(run, tmp_path / "merged", verify=True)
    assert "verify: max abs logits difference" in capsys.readouterr().out
    assert_merge_equals_peft(merged, run)
    assert torch.equal(load_file(merged / "model.safetensors")["lm_head.weight"], head)
    assert "LoRA adapts modules down_proj (r 8), gate_proj (r 8)" in line


def test_rslora_patterns_target_parameters_bias_init_false(runs, tmp_path, capsys):
    """use_rslora + rank_pattern (a regex on the full name) + alpha_pattern: each merged delta is exactly
    (alpha_m / sqrt(r_m)) B@A with the pattern's rank and alpha; target_parameters on a dense model: down_proj adapted
    as a parameter; bias: all: every bias trained and merged; init_lora_weights false: lora_B starts random (kaiming
    bound 1/sqrt(r) = 0.35), not at 0 (3 Adam steps at lr 1e-2 reach ~0.03)."""
    run, _ = runs(*PATTERN_RUN)
    adapter = load_file(run / "adapter_model.safetensors")
    pairs = lora_pairs(adapter)
    assert set(pairs) == {f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}
    assert pairs["model.layers.1.self_attn.q_proj"][0].shape[0] == 4 and pairs["model.layers.0.self_attn.q_proj"][0].shape[0] == R
    assert max(b.abs().max().item() for _, b in pairs.values()) > 0.15
    merged = ex.export(run, tmp_path / "merged", verify=True)
    assert "verify: max abs logits difference" in capsys.readouterr().out
    assert_merge_equals_peft(merged, run)
    base, ours = load_file(base_dir(run) / "model.safetensors"), load_file(merged / "model.safetensors")
    for module, (a, b) in pairs.items():
        r_m = 4 if module == "model.layers.1.self_attn.q_proj" else R
        alpha_m = 32 if module.endswith("v_proj") else ALPHA
        delta = ours[f"{module}.weight"] - base[f"{module}.weight"]
        torch.testing.assert_close(delta, alpha_m / math.sqrt(r_m) * (b @ a), atol=1e-6, rtol=1e-4, msg=module)
    biases = {n: t for n, t in adapter.items() if n.endswith(".bias")}
    assert len(biases) == 6  # q, k, v of both layers (Qwen2 has no other biases)
    for n, t in biases.items():
        name = n.removeprefix("base_model.model.").replace(".base_layer.", ".")
        assert (t - base[name]).abs().max() > 1e-3 and torch.equal(ours[name], t), name


def test_orthogonal_init(runs, tmp_path):
    """init_lora_weights orthogonal (learning rate 0: the adapter is its init): lora_A and lora_B both non-zero, yet
    B@A = 0 (orthogonal halves of one QR basis), so the merged model is the base."""
    run, _ = runs(*ORTHOGONAL_RUN)
    pairs = lora_pairs(load_file(run / "adapter_model.safetensors"))
    for a, b in pairs.values():
        assert a.abs().max() > 1e-2 and b.abs().max() > 1e-2 and (b @ a).abs().max() < 1e-6
    merged = load_file(ex.export(run, tmp_path / "merged") / "model.safetensors")
    base = load_file(ROOT / ".assets/tiny-llama/model.safetensors")
    assert all(torch.allclose(merged[k][: base[k].shape[0]], base[k], atol=1e-6) for k in base if "layers" in k)


# Where each exposed peft option is seen at work (a new LoraConfig field becomes a recipe key when the snapshot is
# refreshed: it fails here until a test shows its effect, or PEFT_NOT_EXPOSED says why it is not a key).
EFFECTS = {
    "use_dora": test_dora_modules_to_save_layers_exclude_gaussian,
    "modules_to_save": test_dora_modules_to_save_layers_exclude_gaussian,
    "layers_to_transform": test_dora_modules_to_save_layers_exclude_gaussian,
    "layers_pattern": test_dora_modules_to_save_layers_exclude_gaussian,
    "exclude_modules": test_dora_modules_to_save_layers_exclude_gaussian,
    "init_lora_weights": test_orthogonal_init,  # and gaussian, false in the two runs above; refused values: test_recipe
    "use_rslora": test_rslora_patterns_target_parameters_bias_init_false,
    "rank_pattern": test_rslora_patterns_target_parameters_bias_init_false,
    "alpha_pattern": test_rslora_patterns_target_parameters_bias_init_false,
    "target_parameters": test_rslora_patterns_target_parameters_bias_init_false,
    "bias": test_rslora_patterns_target_parameters_bias_init_false,
}


def test_every_peft_option_is_seen_at_work():
    exposed = {n for n, o in schema.all_options().items() if o.owner == "peft"}
    assert exposed == set(EFFECTS)
