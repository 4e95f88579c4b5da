"""`eval`: a trained run (an adapter on its base through peft, as lm-evaluation-harness loads one) or a model folder
scored on benchmark tasks by lm-evaluation-harness used as a library (its hf backend), the results written as JSON into
the folder and shown as a table; with --compare-base, the base beside the fine-tuned model.

    python -m sftrecipes eval outputs/tiny-lora --tasks tinymc --include_path tests/use/tasks --compare-base
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from sftrecipes.core.errors import RecipeError
from sftrecipes.facts import startmodel
from sftrecipes.run.lifecycle import output_dir

RESULTS = "lm_eval_results.json"  # in the evaluated folder


def model_args(folder: Path) -> dict[str, str]:
    """lm-evaluation-harness's hf model arguments for a folder: an adapter as `peft=` on the base it names, with the
    run's own tokenizer (its template, its end of turn); a model folder as `pretrained=`."""
    adapter = startmodel.adapter_of(str(folder))
    if adapter is None:
        return {"pretrained": str(folder)}
    return {"pretrained": startmodel.base_of(adapter), "peft": str(adapter), "tokenizer": str(adapter)}


def check_tasks(tasks: list[str], include_path: str | None, keys: tuple[str, str] = ("--tasks", "--include_path")):
    """The TaskManager that knows `tasks` (lm-evaluation-harness's own, with include_path's); a task it does not know is
    one line naming the fix. Indexes the task folders only: nothing is loaded."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" in lm-evaluation-harness or {include_path}" if include_path else " in lm-evaluation-harness"
        raise RecipeError(f"{keys[0]}: no task {', '.join(repr(t) for t in unknown)}{where}; give a task folder with "
                          f"{keys[1]}, or a name lm-evaluation-harness lists (python -m lm_eval ls tasks)")
    return manager


def score(args: dict, tasks: list[str], manager, limit: float | None, chat: bool, fewshot: int | None,
          batch_size: int) -> dict:
    """lm_eval.simple_evaluate on one model, the tasks from `manager` (check_tasks)."""
    import torch
    from lm_eval import simple_evaluate

    return simple_evaluate(model="hf", model_args=args, tasks=tasks, limit=limit, apply_chat_template=chat,
                           num_fewshot=fewshot, batch_size=batch_size, task_manager=manager, log_samples=False,
                           device="cuda" if torch.cuda.is_available() else "cpu")


def rows(results: dict) -> dict[tuple[str, str], tuple[float, float | None]]:
    """(task, metric) -> (value, stderr) of lm_eval's results, for the metrics it computed (filters named as it names
    them: `acc,none` -> `acc`)."""
    out = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            name, comma, filt = key.partition(",")  # a metric is "name,filter"; others (alias, sample_len) are not
            if not comma or name.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            label = name if filt in ("", "none") else f"{name} ({filt})"
            stderr = metrics.get(f"{name}_stderr,{filt}")
            out[(task, label)] = (float(value), stderr if isinstance(stderr, (int, float)) else None)
    return out


def table(tuned: dict, base: dict | None) -> str:
    """The results as a table: task, metric, the fine-tuned value (± stderr), and with a base, its value and the change."""
    head = ["task", "metric", "fine-tuned"] + (["base", "change"] if base is not None else [])
    lines = [head]
    for (task, metric), (value, stderr) in sorted(tuned.items()):
        cell = f"{value:.4f}" + (f" ± {stderr:.4f}" if stderr is not None else "")
        line = [task, metric, cell]
        if base is not None:
            b = base.get((task, metric))
            line += [f"{b[0]:.4f}", f"{value - b[0]:+.4f}"] if b else ["-", "-"]
        lines.append(line)
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines)


def main(folder: Path, tasks: list[str], include_path: str | None, limit: float | None, chat: bool,
         compare_base: bool, base: str | None, fewshot: int | None, batch_size: int) -> dict:
    """Score, write RESULTS into `folder`, print the table; returns the record written."""
    started = time.time()
    args = model_args(folder)
    manager = check_tasks(tasks, include_path)  # built once: indexing every task folder takes seconds
    tuned = score(args, tasks, manager, limit, chat, fewshot, batch_size)
    record = {"folder": str(folder), "model_args": args, "tasks": tasks, "include_path": include_path, "limit": limit,
              "apply_chat_template": chat, "num_fewshot": fewshot, "results": tuned["results"],
              "n_samples": tuned.get("n-samples"), "versions": tuned.get("versions"),
              "lm_eval_version": _version()}
    base_rows = None
    if compare_base:
        base_args = {"pretrained": base or args["pretrained"]}
        base_res = score(base_args, tasks, manager, limit, chat, fewshot, batch_size)
        record["base"] = {"model_args": base_args, "results": base_res["results"]}
        base_rows = rows(base_res)
    record["seconds"] = round(time.time() - started, 1)
    out = folder / RESULTS
    out.write_text(json.dumps(record, indent=1, sort_keys=True, default=str) + "\n")
    print(table(rows(tuned), base_rows))
    print(f"eval: {', '.join(tasks)} on {folder}" + (f" (limit {limit})" if limit else "") + f" -> {out}")
    return record


def _version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def after_training(recipe) -> int:
    """`eval_tasks`: the run's output_dir scored as `eval` scores it, its figures added to run_summary.json (`lm_eval`:
    task -> metric -> value). Returns 0, or 1 after one line when the harness fails (the trained run stays as saved)."""
    run, out = recipe.run, output_dir(recipe)
    try:
        record = main(out, list(run.eval_tasks), run.eval_include_path, run.eval_limit, False, False, None, None, 1)
    except Exception as e:  # noqa: BLE001 - training is done and saved: the evaluation's failure is one line, exit 1
        print(f"error: eval_tasks: lm-evaluation-harness failed on {out} ({type(e).__name__}: {e}); the trained run is "
              f"saved: run `python -m sftrecipes eval {out} --tasks {','.join(run.eval_tasks)}` to try again", file=sys.stderr)
        return 1
    summary_path = out / "run_summary.json"
    summary = json.loads(summary_path.read_text())
    summary["lm_eval"] = {task: {k: v for k, v in metrics.items() if "," in k and isinstance(v, (int, float))}
                          for task, metrics in record["results"].items()}
    summary_path.write_text(json.dumps(summary, indent=1, default=str))
    return 0
