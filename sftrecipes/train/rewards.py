"""The reward functions of a grpo/rloo run as TRL's trainer takes them: the built-ins (recipe/rewards.BUILTINS), the
user's own functions imported from their file or module, a reward model's folder passed as TRL loads it; and the
completions with their rewards logged at each logging step."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import math
import re
import sys
from pathlib import Path

from transformers import TrainerCallback
from trl.rewards import get_soft_overlong_punishment

from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.rewards import check_rewards
from sftrecipes.recipe.typed import Recipe

log = logging.getLogger("sftrecipes")

NUMBER = re.compile(r"[-+]?(?:\d+(?:[.,]\d+)*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def completion_text(completion) -> str:
    """A completion as text: a string, or the content of a conversational completion's messages."""
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion)
    return str(completion)


def final_answer(text: str) -> str:
    """The answer a completion gives: the text of its last <answer>...</answer>, else the whole completion, stripped."""
    tagged = ANSWER_TAG.findall(text)
    return (tagged[-1] if tagged else text).strip()


def as_number(text) -> float | None:
    """A number written as text (thousands separators dropped), or None."""
    try:
        return float(str(text).strip().replace(",", ""))
    except ValueError:
        return None


def last_number(text: str) -> float | None:
    """The answer a math completion gives: its last \\boxed{...} when it has one, else its last number."""
    boxed = BOXED.findall(text)
    if boxed:
        found = as_number(boxed[-1])
        if found is not None:
            return found
    numbers = NUMBER.findall(final_answer(text))
    return as_number(numbers[-1]) if numbers else None


def _answers(kwargs: dict, column: str, n: int, name: str) -> list:
    if column not in kwargs:
        raise RecipeError(f"reward_answer_column: reward {name} reads the column '{column}', which the training rows "
                          f"lack (they have {', '.join(sorted(k for k in kwargs if k not in TRL_ARGS)) or 'no other column'}); "
                          "set reward_answer_column to the column with each prompt's answer")
    return list(kwargs[column])[:n]


ANSWER_BUILTINS = ("exact_answer", "numeric_answer")  # the built-ins that read reward_answer_column
TRL_ARGS = ("trainer_state", "log_extra", "log_metric", "completion_ids", "prompts", "completions")


def exact_answer(column: str):
    def exact_answer(prompts, completions, **kwargs) -> list[float]:
        answers = _answers(kwargs, column, len(completions), "exact_answer")
        return [float(final_answer(completion_text(c)) == str(a).strip()) if a is not None else None
                for c, a in zip(completions, answers)]
    return exact_answer


def numeric_answer(column: str):
    def numeric_answer(prompts, completions, **kwargs) -> list[float]:
        answers = _answers(kwargs, column, len(completions), "numeric_answer")
        out = []
        for c, a in zip(completions, answers):
            want = None if a is None else as_number(a) if as_number(a) is not None else last_number(str(a))  # "... #### 72"
            if want is None:
                out.append(None)  # TRL leaves a None out of the reward (no answer to compare with)
                continue
            got = last_number(completion_text(c))
            out.append(float(got is not None and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)))
        return out
    return numeric_answer


def format_reward(pattern: str):
    compiled = re.compile(pattern, re.DOTALL)

    def format(prompts, completions, **kwargs) -> list[float]:  # noqa: A001 - the metric's name
        return [float(compiled.fullmatch(completion_text(c).strip()) is not None) for c in completions]
    return format


def length_reward(max_completion_length: int, cache: int):
    punish = get_soft_overlong_punishment(max_completion_length, cache)

    def length(prompts, completions, completion_ids, **kwargs) -> list[float]:
        return punish(completion_ids)
    return length


def _import_file(path: str, function: str, entry: str):
    name = f"sftrecipes_reward_{abs(hash(str(Path(path).resolve())))}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - the user's file: named in one line
            del sys.modules[name]
            raise RecipeError(f"reward_funcs: {entry}: importing {path} failed ({type(e).__name__}: {e}); fix the file") from None
    return getattr(module, function)


def _import_module(module: str, function: str, entry: str):
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        raise RecipeError(f"reward_funcs: {entry}: no module {module} here ({e}); install it or give its file "
                          "(path/to/file.py:function)") from None
    if not hasattr(found, function):
        raise RecipeError(f"reward_funcs: {entry}: module {module} has no {function!r}; name one of its functions")
    return getattr(found, function)


def _checked(func, entry: str):
    if not callable(func):
        raise RecipeError(f"reward_funcs: {entry} is a {type(func).__name__}, not a function; name a function")
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return func
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        raise RecipeError(f"reward_funcs: {entry} takes no **kwargs; TRL calls it with prompts=, completions=, "
                          "completion_ids= and every dataset column as keywords: def f(prompts, completions, **kwargs)")
    return func


def check_columns(recipe: Recipe, funcs: list, columns: list[str]) -> None:
    """Before training: every column a reward function reads is in the training rows (the built-ins' answer column; a
    function's own named parameters without a default), else one line naming it; TRL would fail at the first step."""
    have = set(columns) | set(TRL_ARGS)
    for spec, func in zip(recipe.run.reward_funcs, funcs):
        if isinstance(func, str):
            continue
        if spec in ANSWER_BUILTINS:
            wanted = [recipe.run.reward_answer_column]
        else:
            try:
                params = inspect.signature(func).parameters.values()
            except (TypeError, ValueError):
                continue
            wanted = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        missing = [c for c in wanted if c not in have]
        if missing:
            key = "reward_answer_column" if spec in ANSWER_BUILTINS else "reward_funcs"
            raise RecipeError(f"{key}: reward {spec} reads the column '{missing[0]}', which the training rows lack (they "
                              f"have {', '.join(c for c in columns if c != 'prompt') or 'only prompt'}); "
                              + ("set reward_answer_column to the column with each prompt's answer" if key != "reward_funcs"
                                 else "give the data that column (a datasets entry's columns: {your_column: "
                                      f"{missing[0]}}}) or a default to the parameter"))


def reward_functions(recipe: Recipe) -> list:
    """What GRPOTrainer/RLOOTrainer's reward_funcs get, in the recipe's order: callables, and model folders as paths."""
    run = recipe.run
    out = []
    for spec in check_rewards(recipe, online=True):
        if spec.kind == "builtin":
            out.append({"exact_answer": lambda: exact_answer(run.reward_answer_column),
                        "numeric_answer": lambda: numeric_answer(run.reward_answer_column),
                        "format": lambda: format_reward(run.reward_format_regex),
                        "length": lambda: length_reward(int(recipe.trl_value("max_completion_length")),
                                                        run.reward_length_cache)}[spec.entry]())
        elif spec.kind == "file":
            out.append(_checked(_import_file(spec.where, spec.function, spec.entry), spec.entry))
        elif spec.kind == "module":
            out.append(_checked(_import_module(spec.where, spec.function, spec.entry), spec.entry))
        else:
            out.append(spec.where)  # TRL loads it: AutoModelForSequenceClassification, num_labels=1
    return out


class CompletionLog(TrainerCallback):
    """At each logging step of the main process: a few of the step's completions with their rewards, in the log, and
    the last ones kept for run_summary.json."""

    def __init__(self, shown: int = 2):
        self.shown = shown
        self.trainer = None
        self.last: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.trainer is None or not state.is_world_process_zero or not logs or "reward" not in logs:
            return
        got = self.trainer._logs
        prompts, completions = list(got["prompt"]), list(got["completion"])
        rewards = {name: list(values) for name, values in got["rewards"].items()}
        rows = []
        for i in range(max(0, len(completions) - self.shown), len(completions)):
            rows.append({"prompt": completion_text(prompts[i]), "completion": completion_text(completions[i]),
                         "rewards": {name: values[i] for name, values in rewards.items() if i < len(values)}})
        for row in rows:
            shown = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) and not math.isnan(v) else f"{k} {v}"
                              for k, v in row["rewards"].items())
            log.info("completion (step %d): %r -> %r [%s]", state.global_step, row["prompt"][-80:],
                     row["completion"][:120], shown)
        self.last = [{"step": state.global_step, **row} for row in rows]
