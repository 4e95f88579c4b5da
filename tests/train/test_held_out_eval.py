"""val_set_size in training runs: the rows held out of a single file never train, and their eval_loss and perplexity
land in run_summary.json at the eval steps and after the last step, equal to the loss computed here on those rows; an
evaluation-only run of the same recipe evaluates the same rows; a preference method evaluates them too. (The rows as
the data step draws them: tests/data/test_held_out_rows.py.)"""

import json
import math

import pytest
import torch
from conftest import run_cli
from test_held_out_rows import ROWS, row_of, sha, sums_file

import train
from sftrecipes.recipe.load import load_recipe

FLAGS = ["--splits", "null", "--val_set_size", "0.25", "--max_steps", "6", "--eval_strategy", "steps", "--eval_steps", "4",
         "--eval_packing", "false", "--per_device_eval_batch_size", "32", "--sample_max_new_tokens", "0"]


@pytest.fixture(scope="module")
def held_run(tiny_model, tmp_path_factory):
    """One LoRA run on a file of 80 different rows, without `splits` (its default names a test split the file lacks):
    20 rows held out, evaluated at step 4 and after step 6."""
    tmp = tmp_path_factory.mktemp("held")
    f, out = sums_file(tmp), tmp / "run"
    argv = ["recipes/tiny/lora.yaml", "--dataset_name", str(f), "--output_dir", str(out), "--data_cache_dir", str(tmp / "cache"), *FLAGS]
    trainer, summary = train.run(load_recipe(argv))
    return trainer, summary, argv, out


def samples(tok, ds):
    """The file rows of a split's samples (packed rows cut at their seq_lengths)."""
    out = []
    for row in ds:
        ids, start = row["input_ids"], 0
        for n in row.get("seq_lengths") or [len(ids)]:
            out.append(row_of(tok.decode(ids[start:start + n])))
            start += n
    return out


def test_the_held_out_rows_never_train_and_are_what_is_evaluated(held_run):
    """Every row the trainer trains on (its packed rows, unpacked) is one of the 60 left; the 20 it evaluates are the
    others, the very rows run_summary.json's record names (count, seed, digest recomputed from their questions)."""
    trainer, summary, _, _ = held_run
    tok = trainer.processing_class
    trained, evaluated = samples(tok, trainer.train_dataset), samples(tok, trainer.eval_dataset)
    assert "seq_lengths" in trainer.train_dataset.column_names  # packed: whole rows of several samples
    assert sorted(trained) == sorted(set(trained)) and len(trained) == 60 and len(evaluated) == 20
    assert not set(trained) & set(evaluated) and set(trained) | set(evaluated) == set(range(ROWS))
    record = summary["data"]["held_out"]
    assert (record["rows"], record["of"], record["seed"], record["seed_key"]) == (20, ROWS, 42, "seed")
    assert record["rows_sha256"] == sha(evaluated)
    assert summary["data"]["eval"]["kept"] == 20 and summary["data"]["train"]["kept"] == 60


def test_eval_loss_and_perplexity_of_the_held_out_rows_land_in_the_summary(held_run):
    """Evaluated at step 4 (eval_strategy) and after the last step 6 (val_set_size), each with perplexity =
    exp(eval_loss); the last eval_loss is the mean token loss of the held-out rows computed here with the trained model
    (one eval batch: the 20 rows padded)."""
    trainer, summary, _, out = held_run
    evals = summary["eval"]
    assert evals == json.loads((out / "run_summary.json").read_text())["eval"]
    assert [e["step"] for e in evals["history"]] == [4, 6] and evals["last"] == evals["history"][-1]
    assert all(e["perplexity"] == pytest.approx(math.exp(e["eval_loss"]), rel=1e-12) for e in evals["history"])
    model = trainer.model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in trainer.eval_dataset:
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor(row["labels"][1:])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            kept = labels != -100
            total -= logp[kept].gather(1, labels[kept][:, None]).sum().item()
            count += int(kept.sum())
    assert evals["last"]["eval_loss"] == pytest.approx(total / count, rel=1e-5)


def test_an_evaluation_only_run_of_the_recipe_evaluates_the_same_rows(held_run):
    """do_train: false on the run's adapter, with the same recipe, in another process and without the data cache:
    the same 20 rows held out (the same digest) and the eval_loss the run measured after its last step."""
    _, summary, argv, out = held_run
    res = run_cli(["train.py", *argv, "--model_name_or_path", str(out), "--do_train", "false"])
    assert res.returncode == 0, res.stderr[-3000:]
    evaluated = json.loads((out / "eval" / "run_summary.json").read_text())
    assert evaluated["data"]["held_out"] == summary["data"]["held_out"]
    assert evaluated["eval"]["eval_loss"] == pytest.approx(summary["eval"]["last"]["eval_loss"], rel=1e-5)
    assert f"rows sha256 {summary['data']['held_out']['rows_sha256']}); they never train" in res.stderr


def test_a_preference_method_evaluates_its_held_out_pairs_after_training(tiny_model, tmp_path):
    """dpo: 8 of 40 different pairs held out (prompt ids of the trained and evaluated rows disjoint), evaluated after
    the last step: eval_loss (the DPO loss) and the reward metrics in run_summary.json, no perplexity (not an NLL)."""
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i} plus {i}?"}],
                                     "chosen": [{"role": "assistant", "content": f"{2 * i}."}],
                                     "rejected": [{"role": "assistant", "content": f"{2 * i + 1}."}]}) + "\n" for i in range(40)))
    trainer, summary = train.run(load_recipe(["recipes/tiny/dpo.yaml", "--dataset_name", str(f), "--splits", "train",
                                              "--val_set_size", "8", "--max_steps", "2", "--sample_max_new_tokens", "0",
                                              "--output_dir", str(tmp_path / "run")]))
    prompts = lambda ds: {tuple(ids) for ids in ds["prompt_ids"]}  # noqa: E731 (what TRL tokenized to train on)
    assert len(prompts(trainer.eval_dataset)) == 8 and len(prompts(trainer.train_dataset)) == 32
    assert not prompts(trainer.eval_dataset) & prompts(trainer.train_dataset)
    assert summary["data"]["held_out"]["rows"] == 8 and summary["data"]["eval"]["kept"] == 8
    last = summary["eval"]["last"]
    assert [e["step"] for e in summary["eval"]["history"]] == [2] and "perplexity" not in last
    assert math.isfinite(last["eval_loss"]) and "eval_rewards/accuracies" in last
