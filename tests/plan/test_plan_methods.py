"""The planner on preference runs (method dpo, kto): what their batches keep for backward, the reference model each
choice holds per GPU and per node, the verdict naming it, the strategies for a copy that does not fit, and a
calibration against the measured live-tensor peak of real DPO steps on CPU (docs/planner.md, "Preference methods")."""

import textwrap

import pytest
import torch
import torch.nn.functional as F

from sftrecipes.plan import format_plan, main, plan_recipe, verdict
from sftrecipes.plan.sharding import GB
from sftrecipes.recipe.load import load_recipe
from sftrecipes.facts.config import model_shape
from test_plan import CAL, LiveStorage, calibration_error, ready_for_steps, write

from conftest import ROOT

START = "start of backward (LM head)"
REF_FORWARD = "reference forward (no grad)"
NO_LORA = "use_peft_lora: false\nlora_r: null\nlora_alpha: null\nlora_dropout: null\nlora_target_modules: null\n"


def recipe(tmp_path, base: str, text: str = "", *flags: str, name: str = "r.yaml"):
    """A recipe extending recipes/tiny/<base> (written for SFT: a DPO/KTO recipe leaves its packing out), with data
    the plan never reads."""
    body = f"base: {ROOT / 'recipes' / 'tiny' / base}\ndataset_name: data/tiny_dpo\n" + textwrap.dedent(text)
    return load_recipe([write(tmp_path, name, body), *flags])


def item(plan, phase: str, name: str) -> float:
    """GB of one item live at a phase (0 when absent), or of a model-states line (phase 'states')."""
    items = plan.states if phase == "states" else plan.live[phase]
    return sum(i.gb for i in items if i.name == name)


def padded_extras(r, sequences: int) -> float:
    """What a padded preference batch adds on sdpa to an SFT batch of as many sequences (activations.py): its attention
    and completion masks (int64), the causal + padding mask, and k/v repeated to every head in each layer."""
    shape, seq = model_shape(r.model.model_name_or_path), r.trl_value("max_length")
    a = 4  # the tiny recipes: fp32
    tokens = sequences * seq
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return (tokens * 16 + sequences * seq * seq + shape.layers * tokens * a * 2 * (q - kv)) / GB


# ----------------------------------------------------------------------------------------------- activations


def test_dpo_keeps_the_activations_of_twice_the_sequences(tmp_path):
    """DPO runs each pair's chosen and rejected sequences in one forward: its activations and LM head are SFT's for 2 x
    per_device_train_batch_size sequences, plus what a padded batch adds on sdpa; the model states are SFT's (LoRA:
    no reference copy)."""
    dpo = plan_recipe(recipe(tmp_path, "lora.yaml", "method: dpo\n"), _alternatives=False)
    b = 8  # recipes/tiny/_base.yaml
    sft = {n: plan_recipe(load_recipe(["recipes/tiny/lora.yaml", "--packing", "false", "--per_device_train_batch_size",
                                       str(n)]), _alternatives=False) for n in (b, 2 * b)}
    r = recipe(tmp_path, "lora.yaml", "method: dpo\n")
    assert item(dpo, START, "activations") == pytest.approx(item(sft[2 * b], START, "activations") + padded_extras(r, 2 * b))
    assert item(dpo, START, "activations") != pytest.approx(item(sft[b], START, "activations") + padded_extras(r, b))
    assert item(dpo, START, "LM head (TRL chunked log-probs)") == pytest.approx(item(sft[2 * b], START, "LM head (TRL chunked log-probs)"))
    assert dpo.model_states_gb == pytest.approx(sft[b].model_states_gb)
    assert [i.name for i in dpo.states] == ["weights (frozen base)", "trainable params", "reference model", "gradients",
                                            "optimizer states"]
    assert item(dpo, "states", "reference model") == 0 and REF_FORWARD in dpo.phases and REF_FORWARD not in sft[b].phases


def test_kto_keeps_its_completions_and_gathers_for_three_forwards_without_grad(tmp_path):
    """KTO runs its completions with grad (per_device_train_batch_size sequences, not DPO's two per pair); the KL batch
    (mismatched completions) goes through the policy and the reference, the completions through the reference, all
    without grad: on ZeRO-3 with LoRA each of the three gathers the layers again, besides forward and backward."""
    b = 8
    kto = plan_recipe(recipe(tmp_path, "lora.yaml", "method: kto\n"), _alternatives=False)
    sft = plan_recipe(load_recipe(["recipes/tiny/lora.yaml", "--packing", "false"]), _alternatives=False)
    r = recipe(tmp_path, "lora.yaml", "method: kto\n")
    assert item(kto, START, "activations") == pytest.approx(item(sft, START, "activations") + padded_extras(r, b))

    def gathers(method: str, *flags: str) -> str:
        p = plan_recipe(recipe(tmp_path, "zero3.yaml", f"method: {method}\n", *flags), _alternatives=False)
        return next(i.note for i in p.comm if i.name == "param all-gather").split("x per")[0]

    assert [gathers("sft"), gathers("dpo"), gathers("kto"), gathers("kto", "--loss_type", "apo_zero_unpaired")] == ["2", "3", "5", "3"]


# ----------------------------------------------------------------------------------------------- the reference


def test_full_dpo_on_zero3_holds_a_reference_copy_sharded_over_its_ranks(tmp_path):
    """A full fine-tune's reference is a second copy, frozen, sharded like the policy's weights: on ZeRO-3 over both
    ranks in DeepSpeed's 16-bit module (its inference engine casts it as the policy's), whole on each GPU on ZeRO-2
    (TRL runs it as ZeRO-0) and on DDP in the load dtype; the verdict names it."""
    r = recipe(tmp_path, "zero3.yaml", "method: dpo\n" + NO_LORA)
    params = model_shape(r.model.model_name_or_path).params
    p = plan_recipe(r, _alternatives=False)
    ref = item(p, "states", "reference model (frozen copy)")
    assert ref == pytest.approx(params * 2 / 2 / GB) and ref == pytest.approx(item(p, "states", "weights"))
    assert [i.name for i in p.states][:2] == ["weights", "reference model (frozen copy)"]
    assert p.reference == f"reference (dpo): a second copy of the model, frozen, sharded over 2 ranks (2-byte weights): {params / 1e6:.1f} MB per GPU"
    assert p.reference in format_plan(p).split("VERDICT", 1)[1]
    # the copy's forward: its own layer + prefetch and lm_head gathered, and one more all-gather of its weights
    assert item(p, REF_FORWARD, "gathered reference params") > 0 and any(i.name == "reference all-gather" for i in p.comm)
    zero2 = plan_recipe(recipe(tmp_path, "zero3.yaml", "method: dpo\n" + NO_LORA, "--launch.zero_stage", "2"), _alternatives=False)
    assert item(zero2, "states", "reference model (frozen copy)") == pytest.approx(params * 2 / GB)
    ddp = plan_recipe(recipe(tmp_path, "ddp.yaml", "method: dpo\n" + NO_LORA), _alternatives=False)
    assert item(ddp, "states", "reference model (frozen copy)") == pytest.approx(params * 4 / GB)  # fp32, as loaded
    assert "whole on every GPU (4-byte weights)" in ddp.reference


def test_the_reference_copy_loads_as_the_policy_did(tmp_path):
    """CPU RAM: the copy loads right after the policy, in the same way; with zero3_init the policy's partitions are on
    the GPUs by then (the node peak is the same), else the policy is still in host RAM (twice the loading)."""
    def loading(*flags: str, method: str = "dpo") -> float:
        p = plan_recipe(recipe(tmp_path, "zero3.yaml", f"method: {method}\n" + NO_LORA, *flags), _alternatives=False)
        return p.cpu[1].gb

    assert loading() == pytest.approx(loading(method="sft"))
    off = ("--launch.zero3_init", "false")
    assert loading(*off) == pytest.approx(2 * loading(*off, method="sft")) and loading(*off) > 0
    # FSDP2's RAM-efficient loading: rank 0 alone reads the policy, each rank reads the copy (nothing broadcasts into it)
    fsdp = {m: plan_recipe(recipe(tmp_path, "fsdp.yaml", f"method: {m}\n" + NO_LORA), _alternatives=False).cpu[1]
            for m in ("sft", "dpo")}
    assert fsdp["dpo"].gb == pytest.approx(fsdp["sft"].gb * (1 + 2)) and "read by each of the 2 ranks" in fsdp["dpo"].note


def test_precomputed_reference_log_probs_hold_no_copy(tmp_path):
    """precompute_ref_log_probs: no copy and no reference forward during training, and the verdict says so; under FSDP
    TRL loads a copy itself for the pass before training, whole per GPU until it shards it: a loading phase, and a
    pitfall that says what to do."""
    pre = ("--precompute_ref_log_probs", "true")
    p = plan_recipe(recipe(tmp_path, "zero3.yaml", "method: dpo\n" + NO_LORA, *pre), _alternatives=False)
    assert item(p, "states", "reference model") == 0 and REF_FORWARD not in p.phases
    assert p.reference.startswith("reference (dpo): precomputed reference log-probs: no copy during training, one extra")
    assert "FSDP" not in p.reference and not any(i.name == "reference all-gather" for i in p.comm)
    lora = plan_recipe(recipe(tmp_path, "lora.yaml", "method: dpo\n", *pre), _alternatives=False)  # the pass: adapter off
    assert REF_FORWARD not in lora.phases and "precomputed reference log-probs" in lora.reference
    r = recipe(tmp_path, "fsdp.yaml", "method: dpo\n" + NO_LORA, *pre)
    fsdp = plan_recipe(r, _alternatives=False)
    whole = model_shape(r.model.model_name_or_path).params * 4 / GB
    assert fsdp.phases["loading (reference for the precompute pass, whole)"] == pytest.approx(whole)
    assert "under FSDP TRL loads its own copy" in fsdp.reference
    assert "WARNING precompute_ref_log_probs under FSDP" in verdict(r)[1]


def test_a_reference_copy_that_does_not_fit_gets_precompute_and_lora_strategies(capsys):
    """Llama-3.1-70B fully fine-tuned with DPO on 8 x 80 GB: the copy (17.6 GB per GPU in bf16 on ZeRO-3) is planned,
    the run does not fit, and the strategies offer precomputed log-probs (no copy) and LoRA (the base as reference)."""
    flags = ["recipes/llama3.1-70b/dpo-lora.yaml", "--use_peft_lora", "false", "--lora_r", "null", "--lora_alpha", "null",
             "--lora_dropout", "null", "--lora_target_modules", "null"]
    assert main(flags) == 2
    out = capsys.readouterr().out
    assert "reference (dpo): a second copy of the model, frozen, sharded over 8 ranks (2-byte weights): 17.6 GB per GPU" in out
    plan = plan_recipe(load_recipe(flags))
    by_name = {a.name: a for a in plan.alternatives}
    assert by_name["precompute_ref_log_probs"].gpu_gb == pytest.approx(plan.gpu_total_gb - 17.64, abs=2.5)
    assert by_name["LoRA r16 (reference: adapter off)*"].fits


@pytest.mark.parametrize("rel", ["recipes/llama3.1-70b/dpo-lora.yaml", "recipes/qwen3-32b/dpo-qlora-fsdp.yaml"])
def test_shipped_dpo_recipes_name_their_reference(rel, capsys):
    """LoRA and QLoRA recipes use the base with the adapter disabled as the reference: no copy, said under the verdict."""
    assert main([rel]) == 0
    out = capsys.readouterr().out.split("VERDICT", 1)[1]
    assert "reference (dpo): the base with the adapter disabled (LoRA), no second copy: 0 GB per GPU" in out


# ----------------------------------------------------------------------------------------------- calibration

CAL_CASES = [(True, False), (False, True)]


def cal_recipe(tmp_path, config: dict, method: str, lora: bool, ckpt: bool, extra: str = ""):
    """(the model config, saved to tmp_path/model; a recipe of it for `method`): 2 pairs of 256 tokens, fp32, on the
    cpu target, LoRA r8 on every linear layer or a full fine-tune, with or without checkpointing."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**config)
    cfg.save_pretrained(tmp_path / "model")
    r = load_recipe([write(tmp_path, "cal.yaml", textwrap.dedent(f"""
        model_name_or_path: {tmp_path / 'model'}
        method: {method}
        dataset_name: data/tiny_dpo
        output_dir: {tmp_path / 'out'}
        max_length: 256
        per_device_train_batch_size: 2
        gradient_checkpointing: {str(ckpt).lower()}
        bf16: false
        launch: {{hardware: cpu}}
        """) + ("use_peft_lora: true\nlora_r: 8\nlora_target_modules: all-linear\nlora_dropout: 0.1\n" if lora else "") + extra)])
    return cfg, r


def ready_to_train(model, ckpt: bool):
    """The model as the preference trainers train it (their disable_dropout: every dropout p = 0; non-reentrant
    checkpointing when asked; train mode), and a fused AdamW over its trainable parameters."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0
    return ready_for_steps(model, ckpt)


def collated_pairs(vocab: int):
    """(ids, attention mask, labels) of 2 collated pairs, chosen rows then rejected, 256 slots each: rows padded on the
    right to 256, 216, 246 and 256 real tokens, the first 64 (the prompt) and the padding labelled -100."""
    ids = torch.randint(0, vocab, (4, 256))
    pos, lengths = torch.arange(256), torch.tensor([256, 216, 246, 256])
    mask = (pos < lengths[:, None]).long()
    return ids, mask, ids.masked_fill((pos < 64) | (mask == 0), -100)


@pytest.mark.parametrize("lora,ckpt", CAL_CASES, ids=["lora-no-ckpt", "full-ckpt"])
def test_calibration_dpo_plan_vs_measured_peak_on_cpu(tmp_path, lora, ckpt):
    """Plan a DPO recipe of the test model (2 pairs of 256 tokens: 4 sequences, padded), then run 2 real steps as
    DPOTrainer._compute_loss does (the policy's forward with grad through TRL's fused head, the reference forward
    without grad: the adapter disabled, or a frozen copy; the sigmoid loss, backward, fused AdamW, zero_grad) and
    compare the measured peak of the step and of the reference forward with the plan's."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from sftrecipes.model.lora import lora_config
    from sftrecipes.model.load import load_dtype

    cfg, r = cal_recipe(tmp_path, CAL, "dpo", lora, ckpt)
    plan = plan_recipe(r, _alternatives=False)
    kw = dict(dtype=load_dtype(r), attn_implementation="sdpa")
    torch.manual_seed(0)
    peak = ref_peak = 0
    with LiveStorage() as mode:
        model = AutoModelForCausalLM.from_config(cfg, **kw)
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))  # what DPOTrainer installs
        ref = None
        if lora:
            from peft import get_peft_model

            model = get_peft_model(model, lora_config(r, []))
        else:  # methods.trainer_kwargs: a second copy loaded as the policy; TRL gives it the default fused head
            ref = AutoModelForCausalLM.from_config(cfg, **kw).requires_grad_(False).eval()
            add_fused_lm_head(ref)
        opt = ready_to_train(model, ckpt)
        ids, mask, labels = collated_pairs(CAL["vocab_size"])
        batch = dict(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, use_cache=False)
        for _ in range(2):
            chosen, rejected = model(**batch).log_probs.sum(1).chunk(2)
            peak, mode.peak = max(peak, mode.peak), mode.current  # the reference forward's own peak from here
            with torch.no_grad():
                if lora:
                    with model.disable_adapter():
                        ref_chosen, ref_rejected = model(**batch).log_probs.sum(1).chunk(2)
                else:
                    ref_chosen, ref_rejected = ref(**batch).log_probs.sum(1).chunk(2)
            ref_peak = max(ref_peak, mode.peak)
            loss = -F.logsigmoid(0.1 * ((chosen - ref_chosen) - (rejected - ref_rejected))).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del chosen, rejected, loss
    peak = max(peak, mode.peak, ref_peak)
    predicted, predicted_ref = plan.tensor_peak_gb * GB, plan.phases[REF_FORWARD] * GB
    error, ref_error = predicted / peak - 1, predicted_ref / ref_peak - 1
    print(f"calibration dpo lora={lora} ckpt={ckpt}: measured {peak / 1e6:.1f} MB, predicted {predicted / 1e6:.1f} MB "
          f"({plan.peak_phase}), error {error:+.1%}; reference forward measured {ref_peak / 1e6:.1f} MB, predicted "
          f"{predicted_ref / 1e6:.1f} MB, error {ref_error:+.1%}")
    assert abs(error) <= 0.10 and abs(ref_error) <= 0.10


# ----------------------------------------------------------------------------------------------- orpo, cpo


def test_reference_free_methods_hold_no_reference_and_keep_full_logits(tmp_path):
    """orpo and cpo: the pairs' 2 x per_device_train_batch_size sequences as DPO's, no reference (no copy, no
    reference forward, said under the verdict even for a full fine-tune), and an LM head that keeps [tokens, vocab]
    logits where DPO's runs TRL's chunked one (the calibration below holds its size)."""
    dpo = plan_recipe(recipe(tmp_path, "zero3.yaml", "method: dpo\n" + NO_LORA), _alternatives=False)
    for method in ("orpo", "cpo"):
        p = plan_recipe(recipe(tmp_path, "zero3.yaml", f"method: {method}\n" + NO_LORA), _alternatives=False)
        assert item(p, START, "activations") == pytest.approx(item(dpo, START, "activations"))
        assert item(p, "states", "reference model") == 0 and item(p, "states", "reference model (frozen copy)") == 0
        assert REF_FORWARD not in p.phases and not any(i.name == "reference all-gather" for i in p.comm)
        assert p.reference == f"reference ({method}): none: the method compares chosen with rejected under the policy alone: 0 GB per GPU"
        assert p.reference in format_plan(p).split("VERDICT", 1)[1]
        assert item(p, START, "LM head (full logits)") > 0 and item(p, START, "LM head (TRL chunked log-probs)") == 0
    assert item(dpo, START, "LM head (full logits)") == 0


CAL_FREE = [("orpo", True, False, None), ("cpo", False, True, "simpo")]


@pytest.mark.parametrize("method,lora,ckpt,loss_type", CAL_FREE, ids=["orpo-lora-no-ckpt", "cpo-simpo-full-ckpt"])
def test_calibration_reference_free_plan_vs_measured_peak_on_cpu(tmp_path, method, lora, ckpt, loss_type):
    """Plan an orpo / cpo recipe of the test model with a 32k vocabulary (the [1024 tokens, 32768] logits, 134 MB in
    fp32, are most of the peak), then run 2 real steps through the trainer's own loss (get_batch_loss_metrics on the
    collated pairs: the forward, its NLL and odds-ratio or SimPO terms), backward, fused AdamW, and compare the
    measured peak of live tensors with the plan's."""
    import functools
    import types

    from transformers import AutoModelForCausalLM

    from sftrecipes.model.lora import lora_config
    from sftrecipes.model.load import load_dtype
    from sftrecipes.train.options import trl_class

    vocab = 32768
    cfg, r = cal_recipe(tmp_path, {**CAL, "vocab_size": vocab}, method, lora, ckpt, f"loss_type: {loss_type}\n" if loss_type else "")
    plan = plan_recipe(r, _alternatives=False)
    trainer = trl_class(method, f"{method.upper()}Trainer")
    # the attributes its loss reads, as its __init__ sets them from the config (the trainer itself would tokenize a
    # dataset and build an accelerator: not what is measured)
    me = types.SimpleNamespace(is_encoder_decoder=False, padding_value=0, pad_token_id=0, aux_loss_enabled=False,
                               accelerator=types.SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x),
                               **{k: r.trl_value(k) for k in ("beta", "loss_type", "label_smoothing", "cpo_alpha",
                                                              "simpo_gamma", "alpha") if method == "cpo" or k == "beta"})
    for name in ("concatenated_inputs", "get_batch_logps", "concatenated_forward", "odds_ratio_loss", "cpo_loss"):
        if hasattr(trainer, name):
            attr = getattr(trainer, name)
            setattr(me, name, attr if isinstance(trainer.__dict__.get(name), staticmethod) else functools.partial(attr, me))
    torch.manual_seed(0)
    with LiveStorage() as mode:
        model = AutoModelForCausalLM.from_config(cfg, dtype=load_dtype(r), attn_implementation="sdpa")
        if lora:
            from peft import get_peft_model

            model = get_peft_model(model, lora_config(r, []))
        opt = ready_to_train(model, ckpt)
        ids, mask, labels = collated_pairs(vocab)
        batch = {f"{side}_{k}": v[rows] for side, rows in (("chosen", slice(0, 2)), ("rejected", slice(2, 4)))
                 for k, v in (("input_ids", ids), ("attention_mask", mask), ("labels", labels))}
        for _ in range(2):
            loss, _metrics = trainer.get_batch_loss_metrics(me, model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss, _metrics
    assert plan.peak_phase == START and abs(calibration_error(plan, mode.peak, f"{method} lora={lora} ckpt={ckpt}")) <= 0.10
