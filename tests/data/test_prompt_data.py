"""Prompt-only data of the online methods (grpo, rloo): TRL's standard and conversational `prompt` (ShareGPT too), the
row's other columns kept for the reward functions, empty prompts dropped and counted, a mixture of sources, and the
shapes grpo does not read refused in one line naming what it reads."""

import pytest

from sftrecipes.core.errors import RecipeError
from test_preference_data import read, sharegpt, write_jsonl

ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i), "level": i % 3}
        for i in range(6)]


@pytest.mark.parametrize("shape,written,expected", [
    ("conversational prompt", ROWS, ROWS),
    ("text prompt", [{**r, "prompt": r["prompt"][0]["content"]} for r in ROWS],
     [{**r, "prompt": r["prompt"][0]["content"]} for r in ROWS]),
    ("ShareGPT prompt", [{**r, "prompt": sharegpt(r["prompt"])} for r in ROWS], ROWS),
])
def test_prompt_only_rows_keep_their_columns_for_the_reward_functions(tiny_model, tmp_path, shape, written, expected):
    _, (train, evals, prompt, counts) = read("grpo", "--dataset_name", write_jsonl(tmp_path / "d.jsonl", written),
                                            "--splits", "train", "--reward_funcs", "exact_answer")
    assert counts["train"]["formats"] == {shape: 6} and counts["train"]["kept"] == 6 and evals is None
    assert train.column_names == ["prompt", "answer", "level"]
    assert train.to_list() == expected
    assert prompt == expected[0]["prompt"]


def test_empty_prompts_are_dropped_and_counted_and_sources_mix(tiny_model, tmp_path, caplog):
    import json
    import logging

    a = write_jsonl(tmp_path / "a.jsonl", [*ROWS, {"prompt": [], "answer": "0", "level": 0}])
    b = write_jsonl(tmp_path / "b.jsonl", [{**r, "prompt": r["prompt"][0]["content"]} for r in ROWS[:2]])
    with caplog.at_level(logging.INFO, logger="sftrecipes"):
        _, (train, _, _, counts) = read("rloo", "--dataset_name", str(a), "--splits", "train", "--reward_funcs", "exact_answer")
    assert counts["train"]["read"] == 7 and counts["train"]["empty"] == 1 and counts["train"]["kept"] == 6
    assert "7 read (7 conversational prompt), 1 dropped with a null or no messages where TRL reads, 6 prompts kept for " \
           "RLOOTrainer; it generates 2 completions of up to 512 tokens for each prompt" in caplog.text
    c = write_jsonl(tmp_path / "c.jsonl", ROWS[:2])
    mix = json.dumps([{"path": a, "split": "train"}, {"path": c, "split": "train"}])
    _, (train, _, _, counts) = read("grpo", "--datasets", mix, "--reward_funcs", "exact_answer")
    assert len(train) == 8 and set(train.column_names) == {"prompt", "answer", "level"}
    assert counts["mixture"]["seed"] == 42 and len(counts["mixture"]["sources"]) == 2
    mix = json.dumps([{"path": a, "split": "train"}, {"path": b, "split": "train"}])  # text beside messages
    with pytest.raises(RecipeError, match="one run's sources are all text or all conversational"):
        read("grpo", "--datasets", mix, "--reward_funcs", "exact_answer")


@pytest.mark.parametrize("columns,message", [
    ({"messages": [{"role": "user", "content": "x"}]}, "is none of the shapes method grpo reads: prompt [prompt_only]"),
    ({"question": "x", "answer": "1"}, "{your_column: prompt}"),
])
def test_rows_without_a_prompt_are_refused_naming_what_grpo_reads(tiny_model, tmp_path, columns, message):
    with pytest.raises(RecipeError, match=message.replace("[", r"\[").replace("]", r"\]").replace("{", r"\{").replace("}", r"\}")):
        read("grpo", "--dataset_name", write_jsonl(tmp_path / "d.jsonl", [columns]), "--splits", "train",
             "--reward_funcs", "exact_answer")


def test_preference_formats_are_refused_for_grpo(tiny_model, tmp_path):
    with pytest.raises(RecipeError, match="dataset_format: preference is data of method dpo; method grpo reads prompt"):
        read("grpo", "--dataset_name", write_jsonl(tmp_path / "d.jsonl", ROWS), "--splits", "train",
             "--reward_funcs", "exact_answer", "--dataset_format", "preference")
