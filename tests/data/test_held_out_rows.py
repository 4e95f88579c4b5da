"""val_set_size (sftrecipes/recipe/valset.py, data/load.read_splits): rows of a single file's training split held out as
the eval split, drawn under the seed (data_seed where set), recorded, the same on every read; SFT rows and preference
rows alike. The training runs that evaluate them: tests/train/test_held_out_eval.py; the cache key: test_prepcache.py
(SHAPING); the refusals: tests/bad_inputs/cases.yaml."""

import hashlib
import json
import re

from conftest import run_cli

from sftrecipes.data import load as data
from sftrecipes.data import preference
from sftrecipes.data.tokenizer import load_tokenizer
from sftrecipes.recipe.load import load_recipe

ROWS = 80
QUESTION = re.compile(r"What is (\d+) plus (\d+)\?")


def sums_file(folder, rows: int = ROWS):
    """A JSONL file of chat rows that are all different: row i asks what 3i+1 plus 7i+2 is."""
    f = folder / "sums.jsonl"
    f.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {3 * i + 1} plus {7 * i + 2}?"},
        {"role": "assistant", "content": f"{3 * i + 1} plus {7 * i + 2} is {10 * i + 3}."}]}) + "\n" for i in range(rows)))
    return f


def row_of(text: str) -> int:
    """The file row a rendered sample came from (its question)."""
    a, b = map(int, QUESTION.search(text).groups())
    assert (a - 1) % 3 == 0 and (a - 1) // 3 == (b - 2) // 7
    return (a - 1) // 3


def sha(indices) -> str:
    """The digest valset.digest documents, computed here from the indices alone."""
    return hashlib.sha256(",".join(map(str, sorted(indices))).encode()).hexdigest()[:16]


def held_out(tiny_model, f, *flags):
    """(the file rows held out, the file rows left to train, the record) as the data step prepares them."""
    r = load_recipe(["recipes/tiny/lora.yaml", "--output_dir", "outputs/held", "--dataset_name", str(f), "--splits", "null",
                     "--packing", "false", *map(str, flags)])
    tok, eot, _ = load_tokenizer(r)
    train, evals, _, counts = data.load_datasets(r, tok, eot)
    rows = lambda ds: [row_of(tok.decode(ids)) for ids in ds["input_ids"]]  # noqa: E731
    return rows(evals), rows(train), counts["held_out"]


def test_the_held_out_rows_follow_the_seed_or_data_seed_and_are_recorded(tiny_model, tmp_path):
    """A quarter of 80 rows: 20 held out, the other 60 train, none both; the record's count, seed and digest name exactly
    the rows held out (the digest recomputed here from the rows' questions). The same recipe holds out the same rows
    again; 20 rows (the number the fraction rounds to) are the same 20; another seed draws others; data_seed, where set,
    draws them instead of seed (seed 42 with data_seed 7 holds out seed 7's rows)."""
    f = sums_file(tmp_path)
    evals, train, record = held_out(tiny_model, f, "--val_set_size", 0.25)
    assert len(evals) == 20 and len(train) == 60 and not set(evals) & set(train) and set(evals) | set(train) == set(range(ROWS))
    assert record == {"val_set_size": 0.25, "rows": 20, "of": ROWS, "source": f"dataset_name {f} (train)", "seed": 42,
                      "seed_key": "seed", "rows_sha256": sha(evals)}
    assert held_out(tiny_model, f, "--val_set_size", 0.25) == (evals, train, record)  # the same rows on every read
    again = held_out(tiny_model, f, "--val_set_size", 20)
    assert again[0] == evals and again[2]["val_set_size"] == 20 and again[2]["rows_sha256"] == record["rows_sha256"]
    other = held_out(tiny_model, f, "--val_set_size", 0.25, "--seed", 7)
    assert set(other[0]) != set(evals) and other[2]["rows_sha256"] == sha(other[0]) != record["rows_sha256"]
    by_data_seed = held_out(tiny_model, f, "--val_set_size", 0.25, "--data_seed", 7)
    assert by_data_seed[0] == other[0] and (by_data_seed[2]["seed"], by_data_seed[2]["seed_key"]) == (7, "data_seed")
    from sftrecipes.recipe import valset

    assert valset.words(record) == (f"val_set_size 0.25: 20 of the 80 rows of dataset_name {f} (train) held out as the eval "
                                    f"split (drawn under seed 42; rows sha256 {record['rows_sha256']}); they never train")


def test_preference_rows_are_held_out_whole(tiny_model, tmp_path):
    """kto, whose pairs are unpaired into a desirable and an undesirable row: a pair is held out whole, before it is
    unpaired (no prompt both trains and evaluates), and the counts record it."""
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"What is {i} plus {i}?", "chosen": f" {2 * i}.", "rejected": f" {2 * i + 1}."}) + "\n"
                         for i in range(40)))
    r = load_recipe(["recipes/tiny/kto.yaml", "--output_dir", "outputs/held", "--dataset_name", str(f), "--splits", "train",
                     "--val_set_size", "10"])
    train, evals, prompt, counts = preference.preference_datasets(r, load_tokenizer(r)[0])
    held, trained = set(evals["prompt"]), set(train["prompt"])
    assert (len(evals), len(train), len(held), len(trained)) == (20, 60, 10, 30) and not held & trained
    assert prompt in held and counts["held_out"]["rows"] == 10 and counts["eval"]["kept"] == 20
    assert counts["held_out"]["rows_sha256"] == sha(int(p.split()[2]) for p in held)


def test_the_evaluation_after_the_last_step_is_due_once():
    """The held-out rows are evaluated after the last step unless eval_strategy evaluated them at that step."""
    from sftrecipes.recipe import valset

    r = load_recipe(["recipes/tiny/lora.yaml", "--output_dir", "outputs/held", "--splits", "train", "--val_set_size", "0.1"])
    assert valset.final_eval_due(r, [{"loss": 1.0, "step": 6}, {"eval_loss": 1.0, "step": 4}], 6)
    assert not valset.final_eval_due(r, [{"eval_loss": 1.0, "step": 6}], 6)
    plain = load_recipe(["recipes/tiny/lora.yaml", "--output_dir", "outputs/held"])
    assert not valset.final_eval_due(plain, [], 6)


def test_plan_runs_with_the_key_and_help_names_it():
    """`plan` on a recipe with val_set_size plans as without it; `--help` (and docs/generated/options.md, rendered from
    the same schema) shows the key under its axolotl name."""
    res = run_cli(["-m", "sftrecipes", "plan", "recipes/tiny/lora.yaml", "--splits", "train", "--val_set_size", "0.1"])
    assert res.returncode == 0 and "VERDICT: needs" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
    shown = run_cli(["train.py", "--help"]).stdout
    assert "val_set_size" in shown and "axolotl's val_set_size" in shown
