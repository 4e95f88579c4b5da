"""Online RL for real: a tiny GRPO recipe copied from recipes/tiny/ learns from a reward file of the user's own in one
process (the logged reward rises; per function, in the log, TensorBoard and run_summary.json, with completions);
RLOO, a reward model by path and a module:function; the built-in reward functions; and the GRPO twins on every
kind of backend on 2 ranks, resumed exactly from a checkpoint (inside a generation cycle too)."""

import json
import math
import shutil

import pytest
import torch

import train
from conftest import ROOT, free_port, launch_twin
from sftrecipes import cli
from sftrecipes.recipe.load import load_recipe
from sftrecipes.train import rewards
from test_preference_train import sft_adapter  # noqa: F401 - the SFT run the pipeline starts from
from test_preference_train import weights
from test_twins import BASE_OF, TWINS, assert_loadable

# the twins' GRPO: data/tiny_grpo's prompts, a reward that varies from the first step (every step has a gradient),
# 4 completions of up to 8 tokens a prompt (2 prompts a step on 2 ranks of 4)
GRPO = ["--method", "grpo", "--dataset_name", "data/tiny_grpo", "--reward_funcs", "recipes/tiny/rewards.py:answer_letters",
        "--num_generations", "4", "--max_completion_length", "8"]
ONLINE_KEYS = ("reward", "reward_std", "completions/mean_length", "completions/clipped_ratio", "entropy")


def mean(rows, key, which):
    values = [r[key] for r in rows]
    part = values[:2] if which == "first" else values[-2:]
    return sum(part) / len(part)


def tensorboard_scalars(folder) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for path in folder.rglob("events.out.tfevents.*"):  # the trainer's, and the throughput table's (train/metrics.py)
        events = EventAccumulator(str(path))
        events.Reload()
        out.update({tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]})
    return out


def test_a_copied_tiny_grpo_recipe_learns_from_a_reward_file(tiny_model, tmp_path, caplog):
    """`cp tiny/grpo` and a reward file of the user's own (TRL's signature, the row's `answer` column as a keyword):
    over 40 steps in one process the logged reward of that function rises (0 -> ~0.8 measured; the completions get
    shorter as it asks), the built-in exact_answer is logged beside it; both per logging step in run_summary.json and
    TensorBoard, with the KL-free run's clip ratios and entropy; a few completions with their rewards in the log and
    the summary; the prompts counted in the data line."""
    import logging

    (tmp_path / "my_rewards.py").write_text(
        "def shorter(prompts, completions, completion_ids, answer, **kwargs):\n"
        "    assert len(answer) == len(completions)  # the row's column reaches the function\n"
        "    return [1.0 - min(len(ids), 12) / 12 for ids in completion_ids]\n")
    recipe = tmp_path / "my-grpo.yaml"
    assert cli.main(["cp", "tiny/grpo", str(recipe)]) == 0
    shipped = f"{ROOT}/recipes/tiny/rewards.py:brevity"  # cp made the shipped reward file's path work from anywhere
    assert shipped in recipe.read_text()
    text = recipe.read_text().replace(shipped, f"{tmp_path}/my_rewards.py:shorter")
    recipe.write_text(text)
    with caplog.at_level(logging.INFO, logger="sftrecipes"):
        _, summary = train.run(load_recipe([str(recipe), "--output_dir", str(tmp_path / "out"), "--report_to",
                                            "tensorboard", "--sample_max_new_tokens", "0"]))
    rows = summary["preference"]
    assert summary["method"] == "grpo" and len(rows) == 8, rows  # logging_steps 5 of 40
    for r in rows:
        assert all(k in r for k in ONLINE_KEYS) and "rewards/exact_answer/mean" in r and "clip_ratio/region_mean" in r, r
    first, last = mean(rows, "rewards/shorter/mean", "first"), mean(rows, "rewards/shorter/mean", "last")
    assert last > first + 0.3, [r["rewards/shorter/mean"] for r in rows]
    assert mean(rows, "completions/mean_length", "last") < mean(rows, "completions/mean_length", "first")
    assert all(r["reward"] == pytest.approx(r["rewards/shorter/mean"] + r["rewards/exact_answer/mean"], abs=1e-5) for r in rows)
    scalars = tensorboard_scalars(tmp_path / "out")
    assert scalars["train/rewards/shorter/mean"] == pytest.approx([r["rewards/shorter/mean"] for r in rows])
    shown = summary["completions"]
    assert len(shown) == 2 and all(c["step"] == 40 and set(c["rewards"]) == {"shorter", "exact_answer"} for c in shown), shown
    assert caplog.text.count("completion (step 40): 'Repeat the word") == 2
    data = summary["data"]["train"]
    assert data["read"] == data["kept"] == 200 and data["formats"] == {"conversational prompt": 200}, data
    assert ("data: train split: 200 read (200 conversational prompt), 200 prompts kept for GRPOTrainer; it generates 4 "
            "completions of up to 12 tokens for each prompt") in caplog.text
    assert "reference model: none (beta 0: no KL term)" in caplog.text


def test_rloo_with_a_reward_model_and_a_module_function(tiny_model, tmp_path, monkeypatch, caplog):
    """RLOO (beta 0.05: its KL to the base, the adapter disabled) scored by a reward model named by its folder (TRL
    loads it: a sequence-classification model of one label) and a function named module:function, weighted."""
    import logging

    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_model, num_labels=1)
    torch.manual_seed(0)
    judge = tmp_path / "judge"
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(judge)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(judge)
    (tmp_path / "mymod").mkdir()
    (tmp_path / "mymod" / "__init__.py").write_text("")
    (tmp_path / "mymod" / "scores.py").write_text(
        "def many_words(prompts, completions, **kwargs):\n"
        "    return [float(len(c[0]['content'].split())) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="sftrecipes"):
        _, summary = train.run(load_recipe([
            "recipes/tiny/grpo.yaml", "--method", "rloo", "--reward_funcs", str(judge), "mymod.scores:many_words",
            "--reward_weights", "1.0", "0.5", "--max_steps", "4", "--logging_steps", "1", "--sample_max_new_tokens", "0",
            "--output_dir", str(tmp_path / "out")]))
    rows = summary["preference"]
    assert summary["method"] == "rloo" and len(rows) == 4
    assert all(math.isfinite(r["rewards/judge/mean"]) and r["rewards/many_words/mean"] >= 0 for r in rows), rows
    assert all(r["reward"] == pytest.approx(r["rewards/judge/mean"] + 0.5 * r["rewards/many_words/mean"], abs=1e-4)
               for r in rows), rows
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6) and any(r["kl"] > 0 for r in rows[1:]), rows
    assert "reference model: the adapter disabled (beta 0.05)" in caplog.text


@pytest.mark.parametrize("func,completion,answer,want", [
    ("exact_answer", "apple", "apple", 1.0),
    ("exact_answer", "<think>hm</think><answer> apple </answer>", "apple", 1.0),
    ("exact_answer", "the word is apple", "apple", 0.0),
    ("numeric_answer", "so 3 + 4 = 7", "7", 1.0),
    ("numeric_answer", "it is \\boxed{1,024} not 3", "1024", 1.0),
    ("numeric_answer", "7.0", "Natalia sold 48/2 = 24 clips.\n#### 7", 1.0),  # GSM8K's answers end "#### N"
    ("numeric_answer", "7.5", "7", 0.0),
    ("numeric_answer", "no number", "7", 0.0),
    ("numeric_answer", "7", None, None),  # no answer: left out of the reward (TRL reads None as missing)
])
def test_builtin_answer_rewards(func, completion, answer, want):
    f = getattr(rewards, func)("answer")
    assert f(prompts=["q"], completions=[completion], answer=[answer]) == [want]
    conversational = f(prompts=[[]], completions=[[{"role": "assistant", "content": completion}]], answer=[answer])
    assert conversational == [want]


def test_builtin_format_and_length_rewards():
    fmt = rewards.format_reward(r"<think>.*?</think>\s*<answer>.*?</answer>")
    assert fmt(prompts=["q", "q"], completions=["<think>a\nb</think> <answer>7</answer>", "7"]) == [1.0, 0.0]
    length = rewards.length_reward(10, 4)  # TRL's soft overlong punishment: 0 up to 6 tokens, -1 at 10
    assert length(prompts=["q"] * 3, completions=["x"] * 3, completion_ids=[[1] * 6, [1] * 8, [1] * 10]) == [0.0, -0.5, -1.0]


# (twin) -> the shipped twin whose backend it shows: GRPO on every kind of backend on 2 ranks (the FSDP2 twin trains
# every weight: with beta 0.1 its reference is a second copy, loaded by TRL on each rank and sharded)
TWIN_RUNS = ("ddp", "zero2", "zero3", "fsdp", "qlora-zero3", "qlora-fsdp")
EXTRA = {"fsdp": ["--beta", "0.1"]}
# resumed from a copy of checkpoint-3: the FSDP2 twin with its reference copy (ZeRO-3 is resumed after SIGKILL and
# SIGTERM, inside generation cycles, by run/test_resume.py's grpo-zero3 chain), and DDP with steps_per_generation 2:
# each generation feeds 2 steps, so checkpoint-3 is inside a cycle and the resumed run trains step 4 on the
# completions the first one generated at step 3 (train/online.py), not on new ones
RESUMED = {"fsdp": (), "ddp": ("--steps_per_generation", "2")}


def grpo_flags(name, extra=()):
    return [*GRPO, *EXTRA.get(name, ()), *extra, "--save_strategy", "steps", "--save_steps", "3"]


@pytest.fixture(scope="module")
def grpo_runs(tiny_model, tmp_path_factory):
    """(twin, extra flags) -> (output_dir, summary, log) of the twin launched once with GRPO (6 steps, checkpoints at 3
    and 6)."""
    root = tmp_path_factory.mktemp("grpo")
    done = {}

    def get(name, extra=()):
        key = (name, tuple(extra))
        if key not in done:
            out = root / f"{name}-{len(done)}"
            done[key] = (out, *launch_twin(name, out, grpo_flags(name, extra), env={"MAIN_PROCESS_PORT": str(free_port())}))
        return done[key]

    return get


@pytest.mark.parametrize("name", TWIN_RUNS)
def test_grpo_twin_trains_on_its_backend(grpo_runs, family_models, name):
    """The twin with method grpo trains on 2 ranks through its emitted launcher: its backend took effect, every step
    logged the reward and its parts, the completions were generated on every rank (the throughput counts their
    tokens), the reference is what beta says, the save loads."""
    out, summary, log = grpo_runs(name)
    want, b = TWINS[name], summary["backend"]
    assert b["world_size"] == 2 and b["distributed_type"] == want["distributed_type"], b
    if want["shard"] == "params":
        assert b["param_elements_local"] * 2 == pytest.approx(b["param_elements_full"], rel=0.02), b
    rows = summary["preference"]
    assert summary["method"] == "grpo" and len(rows) == 6, rows
    assert all(math.isfinite(r["rewards/answer_letters/mean"]) and r["reward_std"] > 0 for r in rows), rows
    assert all(math.isfinite(x) for x in summary["losses"]), summary["losses"]
    ranks = summary["throughput"]["ranks"]
    assert len(ranks) == 2 and all(r["steps"] == 6 and r["real_tokens"] > 0 for r in ranks), ranks
    if name in EXTRA:  # beta 0.1 on a full fine-tune: the reference is the policy at step 1 on both ranks
        assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6) and rows[-1]["kl"] > 0, rows
        assert log.count("reference model: a second copy (beta 0.1)") == 1
    else:
        assert log.count("reference model: none (beta 0: no KL term)") == 1
    assert_loadable(out, summary, base_dir=family_models[BASE_OF[name]] if name in BASE_OF else ".assets/tiny-llama",
                    quantized="qlora" in name)


@pytest.mark.parametrize("name", list(RESUMED))
def test_grpo_resumes_exactly(grpo_runs, tmp_path, name):
    """checkpoint-3 copied to a new folder and resumed ends with the uninterrupted run's weights: the sampler, the
    random state generation samples with, the optimizer, and (steps_per_generation 2) the completions of a generation
    cycle the checkpoint fell inside, restored."""
    extra = RESUMED[name]
    out, summary, _ = grpo_runs(name, extra)
    assert all((out / "checkpoint-3" / f"online_state-rank{r}.pt").is_file() for r in (0, 1))
    again = tmp_path / "again"
    again.mkdir()
    shutil.copytree(out / "checkpoint-3", again / "checkpoint-3")
    resumed, log = launch_twin(name, again, [*grpo_flags(name, extra), "--resume_from_checkpoint", "auto"],
                               env={"MAIN_PROCESS_PORT": str(free_port())})
    assert resumed["resumed_from"].endswith("checkpoint-3") and resumed["steps"] == 6
    if name == "ddp":
        assert "resume: the generation cycle at micro-step 1 of 2 (its completions restored)" in log
    a, b = weights(out, tmp_path / "straight-export"), weights(again, tmp_path / "again-export")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    rows = {r["step"]: r for r in summary["preference"]}  # (a step that generated nothing logs no reward)
    assert [r.get("reward") for r in resumed["preference"]] == pytest.approx([rows[r["step"]].get("reward") for r in resumed["preference"]])


def test_sft_then_grpo_from_its_adapter(sft_adapter, tmp_path, caplog):  # noqa: F811 - the fixture
    """SFT -> GRPO as SFT -> DPO: the GRPO recipe names the SFT run's adapter as model_name_or_path; the run merges it
    into its base once and trains a new adapter on the merge (with the SFT run's tokenizer and template), which merges
    with --verify."""
    import logging

    sft = tmp_path / "sft"
    shutil.copytree(sft_adapter, sft, ignore=shutil.ignore_patterns("checkpoint-*"))
    with caplog.at_level(logging.INFO, logger="sftrecipes"):
        _, summary = train.run(load_recipe(["recipes/tiny/grpo.yaml", "--model_name_or_path", str(sft), "--max_steps", "2",
                                            "--logging_steps", "1", "--sample_max_new_tokens", "0",
                                            "--output_dir", str(tmp_path / "grpo")]))
    assert f"model: merging the LoRA adapter {sft} into its base .assets/tiny-llama -> {tmp_path / 'sft-merged'}" in caplog.text
    adapter = json.loads((tmp_path / "grpo" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tmp_path / "sft-merged") and len(summary["preference"]) == 2
    assert cli.main(["merge", str(tmp_path / "grpo"), str(tmp_path / "merged"), "--verify"]) == 0


def test_grpo_evaluates_its_eval_split_by_generating(tiny_model, tmp_path):
    """eval_strategy steps: the eval split's prompts are generated from and scored like the training ones; each
    evaluation's reward per function in run_summary.json's eval, the last one in the run's last line."""
    from sftrecipes.recipe.evalonly import eval_words

    _, summary = train.run(load_recipe(["recipes/tiny/grpo.yaml", "--max_steps", "2", "--eval_strategy", "steps",
                                        "--eval_steps", "2", "--per_device_eval_batch_size", "8", "--num_generations_eval",
                                        "2", "--sample_max_new_tokens", "0", "--output_dir", str(tmp_path / "out")]))
    last = summary["eval"]["last"]
    assert last["step"] == 2 and "perplexity" not in last and math.isfinite(last["eval_rewards/brevity/mean"])
    assert eval_words(last) == f"eval_loss {last['eval_loss']:.4g}, eval_reward {last['eval_reward']:.4g} (the generated " \
                               "completions' mean reward)"  # (train.py's last line prints it)
