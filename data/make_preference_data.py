"""Writes data/tiny_dpo and data/tiny_kto: tiny synthetic preference data that the tiny random-init model learns in a
few dozen DPO steps (KTO: about a hundred); and data/tiny_grpo: the same prompts alone, each with its word in an
`answer` column, for the online methods' reward functions (recipes/tiny/rewards.py).

One rule: the reply repeats the word the user names. A DPO row pairs the reply that follows it (chosen) with one naming
another word (rejected); a KTO row is one of the two, labelled desirable (true) or not (false), half of each. The
words are those of the tiny chat data, which the tiny tokenizer was trained on: the reply "The word is X." holds the
prompt's token for X.
Seeded: `python data/make_preference_data.py` writes the same files again (tests/data/test_preference_data.py checks).

Measured on CPU with the tiny Llama (full fine-tune, lr 1e-3 constant, batch 8, beta 0.1, TRL 1.16), on the test
split (tests hold no such run: it is a claim to re-measure after changing the data): DPO after 40 steps a reward
accuracy of 0.9 (margin 1.17, eval loss 0.69 -> 0.32), KTO after 100 steps a reward margin of 1.15 (60 steps: 0.48).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
# each one token of the tiny tokenizer after a space, so the reply repeats the prompt's token
WORDS = ["cat", "river", "stone", "cloud", "apple", "light", "garden", "music", "paper", "window", "bread", "tiger",
         "blue", "black", "yellow", "red", "orange", "plum", "lemon", "tomato"]
# one way of asking: the word sits at the same place in every prompt, which a 2-layer random-init model learns to copy
# from in a few dozen DPO steps (three ways of asking took it about twice as many)
ASK = "Repeat the word {w}."
SPLITS = (("train", 200, 1), ("test", 20, 2))  # name, rows, seed


def pair(rng: random.Random) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) as messages: the asked word, and another one."""
    word, other = rng.sample(WORDS, 2)
    prompt = [{"role": "user", "content": ASK.format(w=word)}]
    return prompt, [{"role": "assistant", "content": f"The word is {word}."}], [{"role": "assistant", "content": f"The word is {other}."}]


def dpo_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [dict(zip(("prompt", "chosen", "rejected"), pair(rng))) for _ in range(n)]


def kto_rows(n: int, seed: int) -> list[dict]:
    """Alternately a desirable and an undesirable row, each of its own prompt."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt, chosen, rejected = pair(rng)
        good = i % 2 == 0
        rows.append({"prompt": prompt, "completion": chosen if good else rejected, "label": good})
    return rows


def grpo_rows(n: int, seed: int) -> list[dict]:
    """Prompt-only rows (conversational) with the asked word as the answer the reward functions read."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, chosen, _ = pair(rng)
        rows.append({"prompt": prompt, "answer": chosen[0]["content"].split()[-1].rstrip(".")})
    return rows


def write(out: Path = HERE) -> None:
    for folder, make in (("tiny_dpo", dpo_rows), ("tiny_kto", kto_rows), ("tiny_grpo", grpo_rows)):
        (out / folder).mkdir(parents=True, exist_ok=True)
        for split, n, seed in SPLITS:
            with open(out / folder / f"{split}.jsonl", "w") as f:
                for row in make(n, seed):
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    write()
