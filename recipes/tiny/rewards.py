"""A reward function of the user's own, as recipes/tiny/grpo.yaml names it (reward_funcs: [recipes/tiny/rewards.py:
brevity, ...]), with TRL's signature: prompts, completions, completion_ids and the row's columns (here `answer`) as
keyword arguments.

The tiny random-init model cannot write the word it is asked for, so the built-in exact_answer stays at 0 for hundreds
of steps; brevity is dense: a completion that ends (the end of turn) sooner scores more, which GRPO raises from 0 to
about 0.8 within 40 steps on CPU (tests/train/test_grpo.py holds the rise)."""

LIMIT = 12  # the recipe's max_completion_length: a completion cut there scores 0


def brevity(prompts, completions, completion_ids, **kwargs) -> list[float]:
    return [1.0 - min(len(ids), LIMIT) / LIMIT for ids in completion_ids]


def answer_letters(prompts, completions, answer, **kwargs) -> list[float]:
    """The share of a completion's letters that are letters of the row's answer word: varies from the first step
    (the 2-rank twins' runs use it, so every step has a gradient), rises slowly."""
    out = []
    for completion, word in zip(completions, answer):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        letters = [c for c in text.lower() if c.isalpha()]
        out.append(sum(c in word for c in letters) / len(letters) if letters else 0.0)
    return out
