"""`python -m sftrecipes eval` (sftrecipes/use/lmeval.py): lm-evaluation-harness used as a library gives the figures
lm-evaluation-harness gives when run directly on the same model and task -- an adapter as peft on its base with the
run's tokenizer, the base for --compare-base, prompts through the chat template with --apply_chat_template -- written
as JSON into the run folder and shown as a table; a task it does not know, or a folder it cannot load, is one line."""

import json

from conftest import ROOT, launcher_argv, run_cli

TASKS = "tests/use/tasks"  # tinymc: 20 multiple-choice questions, offline


def direct(model_args: str, out, *extra) -> dict:
    """lm-evaluation-harness's own command line on the same task (a fork of the suite's server, which has imported
    torch & co. already): its results for tinymc."""
    res = run_cli(launcher_argv(["-m", "lm_eval", "--model", "hf", "--model_args", model_args, "--tasks", "tinymc",
                                 "--include_path", TASKS, "--device", "cpu", "--output_path", str(out), *extra]))
    assert res.returncode == 0, res.stderr[-3000:]
    (path,) = out.rglob("results_*.json")
    return json.loads(path.read_text())["results"]["tinymc"]


def test_eval_gives_the_figures_lm_eval_gives_directly(twin_runs, tmp_path):
    run, _, _ = twin_runs("ddp")  # a LoRA adapter (chatml template) on the tiny Llama
    base = json.loads((run / "adapter_config.json").read_text())["base_model_name_or_path"]
    res = run_cli(["-m", "sftrecipes", "eval", str(run), "--tasks", "tinymc", "--include_path", TASKS, "--compare-base"])
    assert res.returncode == 0, res.stderr[-3000:]
    ours = json.loads((run / "lm_eval_results.json").read_text())
    tuned = direct(f"pretrained={base},peft={run},tokenizer={run}", tmp_path / "tuned")
    plain = direct(f"pretrained={base}", tmp_path / "base")
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tinymc"][metric] == tuned[metric], (metric, ours["results"]["tinymc"], tuned)
        assert ours["base"]["results"]["tinymc"][metric] == plain[metric], (metric, ours["base"]["results"], plain)
    line = next(x for x in res.stdout.splitlines() if x.startswith("tinymc") and " acc " in f" {x} ")
    assert f"{tuned['acc,none']:.4f}" in line and f"{plain['acc,none']:.4f}" in line, res.stdout
    assert f"{tuned['acc,none'] - plain['acc,none']:+.4f}" in line, res.stdout

    res = run_cli(["-m", "sftrecipes", "eval", str(run), "--tasks", "tinymc", "--include_path", TASKS, "--limit", "8",
                   "--apply_chat_template"])
    assert res.returncode == 0, res.stderr[-3000:]
    ours = json.loads((run / "lm_eval_results.json").read_text())
    templated = direct(f"pretrained={base},peft={run},tokenizer={run}", tmp_path / "chat", "--limit", "8",
                       "--apply_chat_template")
    assert ours["apply_chat_template"] and ours["limit"] == 8
    assert ours["results"]["tinymc"]["acc,none"] == templated["acc,none"], (ours["results"], templated)


def test_eval_tasks_after_a_two_rank_run_give_the_figures_lm_eval_gives(twin_runs, tmp_path):
    """The ddp twin (2 ranks) ran with eval_tasks tinymc, limit 8 (conftest TWIN_EXTRA): its run_summary.json holds what
    lm-evaluation-harness gives directly on the saved adapter, and its log says the evaluation ran once."""
    run, summary, log = twin_runs("ddp")
    base = json.loads((run / "adapter_config.json").read_text())["base_model_name_or_path"]
    want = direct(f"pretrained={base},peft={run},tokenizer={run}", tmp_path / "direct", "--limit", "8")
    for metric in ("acc,none", "acc_norm,none"):
        assert summary["lm_eval"]["tinymc"][metric] == want[metric], (metric, summary["lm_eval"], want)
    assert log.count("eval: tinymc on ") == 1, log[-3000:]  # once, by the main process


def test_eval_refuses_in_one_line(tiny_model, tmp_path):
    for args, says in (([str(tiny_model), "--tasks", "no_such_task", "--include_path", TASKS], "--tasks: no task 'no_such_task'"),
                       ([str(tiny_model), "--tasks", "tinymc", "--include_path", str(tmp_path / "nowhere")], "--include_path"),
                       ([str(tiny_model), "--tasks", "tinymc", "--compare-base"], "--compare-base"),
                       ([str(tmp_path / "missing"), "--tasks", "tinymc"], "is not a folder")):
        res = run_cli(["-m", "sftrecipes", "eval", *args])
        assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr, res.stderr[-1500:]
    assert not (ROOT / ".assets" / "tiny-llama" / "lm_eval_results.json").exists()
