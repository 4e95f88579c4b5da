"""The planner on online runs (method grpo, rloo; plan/generation.py): the generation's KV cache, the weights ZeRO-3
gathers whole for it, the scoring forwards, the reference as beta and LoRA decide it, vLLM's share of a colocated GPU,
the shipped online recipes offline, and the per-rank figure held against real 2-rank GRPO twins on CPU, where the
generation is most of what a rank holds (docs/planner.md, "Online methods")."""

import json
import textwrap

import pytest

from conftest import ROOT, free_port, launch_twin
from sftrecipes.facts.config import model_shape
from sftrecipes.plan import format_plan, main, plan_recipe
from sftrecipes.plan.sharding import GB
from sftrecipes.recipe.load import load_recipe
from sftrecipes.recipe.schema import ONLINE
from sftrecipes.train.probes import growth_mb
from test_plan import write
from test_twins import assert_planned

START = "start of backward (LM head)"
PREFILL, LAST, SCORING = "generation: prefill (no grad)", "generation: last token (no grad)", "scoring completions (no grad)"
NO_LORA = "use_peft_lora: false\nlora_r: null\nlora_alpha: null\nlora_dropout: null\nlora_target_modules: null\n"
GRPO = ["--method", "grpo", "--dataset_name", "data/tiny_grpo", "--reward_funcs", "recipes/tiny/rewards.py:answer_letters",
        "--num_generations", "4"]


def plan(*argv: str):
    return plan_recipe(load_recipe(list(argv)), _alternatives=False)


def item(p, phase: str, name: str) -> float:
    """GB of one item live at a phase (0 when absent), of a model-states line (phase 'states') or of the generation's
    lines (phase 'generation')."""
    items = {"states": p.states, "generation": p.generation}.get(phase) or p.live.get(phase, [])
    return sum(i.gb for i in items if i.name == name)


def kv_per_token(name: str, dtype_bytes: int) -> int:
    """Bytes of keys and values one token adds to the cache: every layer's KV heads x head size, twice."""
    return sum(2 * L.kv_heads * L.head_dim for L in model_shape(name).decoder) * dtype_bytes


# ----------------------------------------------------------------------------------------------- arithmetic


def test_grpo_plans_its_generation_and_trains_on_prompt_plus_completion():
    """Each rank generates per_device_train_batch_size x steps_per_generation completions at once, each planned at
    prompt + completion = vllm_max_model_length (TRL does not cut prompts; without it, the model's positions): the KV
    cache is layers x 2 x KV heads x head size x those tokens (DeepSpeed's bf16 module: 2 bytes); the training forward
    is KTO's for as many padded sequences of that length (TRL's fused head, no [tokens, vocab] logits); the old
    log-probs are scored without grad only when steps_per_generation outruns gradient_accumulation_steps; the plan's
    text names the KV cache per GPU."""
    base = ["recipes/tiny/zero3.yaml", *GRPO, "--max_completion_length", "40", "--vllm_max_model_length", "100"]
    p = plan(*base, "--per_device_train_batch_size", "2", "--steps_per_generation", "8")
    kv = 2 * 8 * 100 * kv_per_token(".assets/tiny-llama", 2)
    assert item(p, "generation", "generation KV cache") == pytest.approx(kv / GB)
    assert item(p, LAST, "KV cache") == pytest.approx(kv / GB)
    assert item(p, PREFILL, "KV cache") == pytest.approx(kv * 60 / 100 / GB)  # the prompts' 60 tokens
    assert SCORING in p.phases and ("16 completions per rank at once (per_device_train_batch_size 2 x steps_per_generation "
                                    "8), each planned at 60 prompt + 40 completion tokens") in format_plan(p)
    assert "generation KV cache" in format_plan(p) and "reference (grpo): none: beta 0" in format_plan(p)
    aligned = plan(*base, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "8")  # spg = ga: no scoring
    assert SCORING not in aligned.phases and item(aligned, LAST, "KV cache") == pytest.approx(kv / GB)
    assert SCORING in plan(*base, "--method", "rloo", "--beta", "0").phases  # RLOO always scores its old log-probs
    positions = plan("recipes/tiny/zero3.yaml", *GRPO, "--max_completion_length", "40")
    assert item(positions, LAST, "KV cache") == pytest.approx(4 * 1024 * kv_per_token(".assets/tiny-llama", 2) / GB)
    # the training forward: KTO's padded completions of the same length (lora.yaml: one process, dropout 0)
    grpo = plan("recipes/tiny/lora.yaml", *GRPO, "--max_completion_length", "40", "--vllm_max_model_length", "100")
    kto = plan("recipes/tiny/lora.yaml", "--method", "kto", "--dataset_name", "data/tiny_dpo", "--max_length", "100")
    for name in ("activations", "LM head (TRL chunked log-probs)"):
        assert item(grpo, START, name) == pytest.approx(item(kto, START, name)) and item(grpo, START, name) > 0


def test_zero3_gathers_the_whole_model_to_generate(tmp_path):
    """Under ZeRO-3 with ds3_gather_for_generation (TRL's default) every parameter is gathered on each rank while it
    generates: a full fine-tune of Llama-3.1-8B in bf16 holds its 16 GB then, on top of its shards: the peak;
    without it generation gathers layer by layer, and the strategies offer that."""
    r = write(tmp_path, "r.yaml", textwrap.dedent(f"""
        model_name_or_path: meta-llama/Llama-3.1-8B
        method: grpo
        dataset_name: data/tiny_grpo
        reward_funcs: [numeric_answer]
        num_generations: 8
        max_completion_length: 512
        vllm_max_model_length: 1024
        per_device_train_batch_size: 4
        gradient_checkpointing: true
        bf16: true
        output_dir: {tmp_path / 'out'}
        launch: {{backend: deepspeed, zero_stage: 3, gpus_per_node: 8, gpu_memory_gb: 80}}
        """) + NO_LORA)
    params = model_shape("meta-llama/Llama-3.1-8B").params
    whole = plan(r)
    assert item(whole, LAST, "gathered for generate (ZeRO-3, whole model)") == pytest.approx(params * 2 / GB)
    assert whole.peak_phase == LAST and item(whole, "generation", "gathered for generate (ZeRO-3)") == pytest.approx(params * 2 / GB)
    by_layer = plan(r, "--ds3_gather_for_generation", "false")
    assert item(by_layer, LAST, "gathered for generate (ZeRO-3, whole model)") == 0
    assert whole.gpu_total_gb - by_layer.gpu_total_gb > 10
    names = [a.name for a in plan_recipe(load_recipe([r])).alternatives]
    assert "ZeRO-3, generate layer by layer" in names and "beta 0 (no KL term, no reference)*" not in names


def test_online_reference_follows_beta_and_lora():
    """GRPO's beta 0 (its default) loads no reference; RLOO's default beta 0.05 with LoRA disables the adapter (no
    copy, the scoring forward runs the policy); a full fine-tune with beta > 0 holds a frozen copy sharded like the
    policy (ZeRO-3: over both ranks, DeepSpeed's 16-bit module; ZeRO-2: whole, TRL's ZeRO-0) and scores its
    completions through it; the strategies offer beta 0 and LoRA for the copy. The verdict names the reference."""
    grpo = plan("recipes/tiny/zero3.yaml", *GRPO)
    assert item(grpo, "states", "reference model") == 0 and grpo.reference_kind == "no-kl" and SCORING not in grpo.phases
    rloo = plan("recipes/tiny/zero3.yaml", *GRPO, "--method", "rloo")
    assert rloo.reference == "reference (rloo): the base with the adapter disabled (LoRA), no second copy: 0 GB per GPU"
    full = ["recipes/tiny/zero3.yaml", *GRPO, "--beta", "0.1", "--use_peft_lora", "false", "--lora_r", "null",
            "--lora_alpha", "null", "--lora_dropout", "null", "--lora_target_modules", "null"]
    params = model_shape(".assets/tiny-llama").params
    copy = plan(*full)
    assert item(copy, "states", "reference model (frozen copy)") == pytest.approx(params * 2 / 2 / GB)
    assert copy.reference == f"reference (grpo): a second copy of the model, frozen, sharded over 2 ranks (2-byte weights): {params * 2 / 2 / 1e6:.1f} MB per GPU"
    assert item(copy, SCORING, "gathered reference params") > 0 and copy.reference in format_plan(copy)
    assert item(plan(*full, "--launch.zero_stage", "2"), "states", "reference model (frozen copy)") == pytest.approx(params * 2 / GB)
    names = [a.name for a in plan_recipe(load_recipe([*full, "--launch.gpu_memory_gb", "80"])).alternatives]
    assert "beta 0 (no KL term, no reference)*" in names and "precompute_ref_log_probs" not in names


def test_vllm_colocate_takes_its_share_and_a_server_is_not_planned(tmp_path):
    """use_vllm, vllm_mode colocate: vLLM holds vllm_gpu_memory_utilization of each GPU through the step (a line of
    the model states: the training gets the rest), and transformers' generation phases are gone; with
    vllm_enable_sleep_mode it holds it only while generating; vllm_mode server: the server's GPUs are its own and
    the plan says so."""
    r = write(tmp_path, "r.yaml", f"""
        model_name_or_path: Qwen/Qwen3-8B
        method: grpo
        dataset_name: data/tiny_grpo
        reward_funcs: [numeric_answer]
        num_generations: 8
        max_completion_length: 1024
        vllm_max_model_length: 1536
        per_device_train_batch_size: 8
        gradient_checkpointing: true
        bf16: true
        use_vllm: true
        vllm_gpu_memory_utilization: 0.4
        use_peft_lora: true
        lora_r: 16
        lora_alpha: 32
        lora_target_modules: all-linear
        output_dir: {tmp_path / 'out'}
        launch: {{backend: deepspeed, zero_stage: 3, gpus_per_node: 8, gpu_memory_gb: 80}}
        """)
    colocate = plan(r)
    assert item(colocate, "states", "vLLM (colocated)") == pytest.approx(32.0)
    assert LAST not in colocate.phases and SCORING in colocate.phases  # vLLM's importance sampling: old log-probs
    assert "vLLM (colocated)                                32.00 GB  vllm_gpu_memory_utilization 0.4 x 80 GB" in format_plan(colocate)
    asleep = plan(r, "--vllm_enable_sleep_mode", "true")
    assert item(asleep, "states", "vLLM (colocated)") == 0
    assert asleep.phases["generation (vLLM awake)"] == pytest.approx(asleep.model_states_gb + 32.0, abs=0.01)
    server = plan(r, "--vllm_mode", "server", "--vllm_server_base_url", "http://localhost:8000")
    assert item(server, "states", "vLLM (colocated)") == 0 and LAST not in server.phases
    assert "vllm_mode server: the server's GPUs are its own, not in this plan" in format_plan(server)


def test_shipped_online_recipes_plan_offline(capsys):
    """Every shipped grpo / rloo recipe gets its plan offline, with its generation's lines."""
    online = []
    for path in sorted((ROOT / "recipes").rglob("*.yaml")):
        try:
            if load_recipe([str(path)]).method in ONLINE:
                online.append(str(path.relative_to(ROOT)))
        except Exception:  # a partial base (no method of its own to run)
            continue
    assert "recipes/tiny/grpo.yaml" in online
    for rel in online:
        assert main([rel]) in (0, 2), rel
        out = capsys.readouterr().out
        assert "Per GPU — generation" in out and ("generation KV cache" in out or "vLLM" in out), (rel, out[-2000:])


# ----------------------------------------------------------------------------------------------- the twins

# A Llama whose keys and values are wide for its compute (8 KV heads of 128 on a hidden size of 64, 4 layers: 16 kB a
# token in bf16, 1.3M parameters), so that generating for long prompts is what a rank holds most of, at CPU cost
KV_HEAVY = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                head_dim=128)
COMPLETION = 8


@pytest.fixture(scope="module")
def long_prompt_run_inputs(tiny_model, tmp_path_factory):
    """(the model folder, the data folder, its longest prompt in tokens as TRL renders it): the KV-heavy Llama with the
    tiny tokenizer, and 64 prompts of ~245 tokens (16 words asked for, each with the same long instruction)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("online-plan")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=1024, tie_word_embeddings=False, initializer_range=0.1,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **KV_HEAVY)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    words = ["cat", "river", "stone", "cloud", "apple", "light", "garden", "music", "paper", "window", "bread", "tiger",
             "lemon", "ocean", "forest", "candle"]
    rows = {split: [{"prompt": [{"role": "user", "content": f"Repeat the word {words[i % 16]}." + " Say the word once, in "
                                 "lower case, and nothing else." * 7}], "answer": words[i % 16]} for i in range(n)]
            for split, n in (("train", 64), ("test", 8))}
    (root / "data").mkdir()
    for split, part in rows.items():
        (root / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    longest = max(len(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
                  for r in rows["train"])
    return root / "model", root / "data", longest


@pytest.mark.parametrize("twin,extra", [("zero3", []), ("fsdp", ["--beta", "0.1"])], ids=["zero3-lora", "fsdp-full-beta"])
def test_plan_holds_per_rank_on_grpo_twins(long_prompt_run_inputs, tmp_path, twin, extra):
    """A 2-rank GRPO run of the twin (ZeRO-3 with LoRA, beta 0; FSDP2 full fine-tuning with beta 0.1: a reference
    copy sharded over both ranks, scored through) on the KV-heavy Llama: each rank generates 32 completions at once
    (per_device_train_batch_size 1 x steps_per_generation 32) for ~245-token prompts, 8 tokens each. Each rank's RSS
    growth at the peak of its first steps is the plan's figure for the cpu target, within the twins' tolerance
    (test_twins.assert_planned: 10% and half the run-to-run spread); the generation is the peak, and the same plan
    without it (the training step's largest phase) falls outside that tolerance."""
    model, data, longest = long_prompt_run_inputs
    flags = [*GRPO, "--model_name_or_path", str(model), "--dataset_name", str(data), "--max_completion_length",
             str(COMPLETION), "--vllm_max_model_length", str(longest + COMPLETION), "--per_device_train_batch_size", "1",
             "--steps_per_generation", "32", "--max_steps", "2", "--save_strategy", "no", "--sample_max_new_tokens", "0",
             *extra]
    summary, _ = launch_twin(twin, tmp_path / twin, flags, env={"MAIN_PROCESS_PORT": str(free_port())})
    p = plan_recipe(load_recipe([f"recipes/tiny/{twin}.yaml", *flags]), _alternatives=False)
    assert len(summary["memory"]) == 2
    for m in summary["memory"]:
        got = growth_mb(m, "first_steps")
        print(f"{twin} rank {m['rank']}: first steps grew {got:.0f} MB, planned {p.rank_steps.peak_gb * 1e3:.0f} MB "
              f"({p.peak_phase})")
        assert_planned(p.rank_steps.peak_gb, None, got, (twin, m["rank"], m))
    assert p.peak_phase.startswith("generation") and (p.reference_kind == "copy") == bool(extra)
    training = max(v for k, v in p.phases.items() if not k.startswith(("generation", "scoring")))
    without = p.rank_steps.peak_gb - (p.phases[p.peak_phase] - training)
    for m in summary["memory"]:
        with pytest.raises(AssertionError):
            assert_planned(without, None, growth_mb(m, "first_steps"), f"without the generation: {without * 1e3:.0f} MB")

