"""`make bench-grpo` (bench/bench_grpo.py) end to end at its smallest: one run each of train.py and the bare TRL GRPO
script (bench/bare_grpo.py) on the tiny model, so the benchmark does not fail on code never executed, and what makes its
ratio mean something holds: both trainers are set up alike (arguments, model, LoRA, eos ids, generation kwargs, chat
template; only train.py's callbacks and bookkeeping differ) and generate the same completions, and the exit status
follows the goal."""

import json
import sys

from conftest import ROOT, run_cli

sys.path.insert(0, str(ROOT / "bench"))
import bench_grpo  # noqa: E402 - bench/ put on the path first


def test_grpo_bench_runs_both_scripts_on_the_same_work(tiny_model, tmp_path):
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    res = run_cli(["bench/bench_grpo.py", "--repeats", "1", "--steps", "6", "--warmup", "1", "--warmup_runs", "0",
                   "--rows", "answer_letters", "--no-docs", "--out", str(tmp_path)], timeout=600)
    assert res.returncode in (0, 1), res.stderr[-3000:]
    (record,) = tmp_path.glob("grpo-bench-*.json")
    got = json.loads(record.read_text())
    a, b = (got["rows"]["answer_letters"][w] for w in ("train.py", "bare_grpo.py"))
    assert len(a) == len(b) == 1
    for run in a + b:
        assert run["step_ms"] > 0 and run["cpu_ms"] > 0 and run["launch_to_first_step_s"] > 0
        assert [e["step"] for e in run["logged"]] == [5, 6]  # logging_steps 5 of the recipe and the last, in both
    diffs = bench_grpo.setup_differences(a[0]["setup"], b[0]["setup"])
    assert set(diffs) <= bench_grpo.EXPECTED, diffs  # the bare script still does what recipes/tiny/grpo.yaml does
    assert a[0]["setup"]["generation.eos_token_ids"] == b[0]["setup"]["generation.eos_token_ids"]
    assert {"ThroughputCallback", "CompletionLog"} <= set(diffs["callbacks"][0]) - set(diffs["callbacks"][1])
    assert bench_grpo.same_work(a, b)[0]  # same seed, same sampling: the same completion lengths and rewards
    # where train.py's extra time goes is measured, not assumed: its callbacks' events, the forward hook it puts on
    # the model, its threads (the RSS sampler); the bare script has none of them
    assert any(k.startswith("ThroughputCallback.") for k in a[0]["callbacks_ms"])
    assert any(k.startswith("hook ") for k in a[0]["callbacks_ms"])
    assert not any(k.startswith(("ThroughputCallback.", "CompletionLog.", "hook ")) for k in b[0]["callbacks_ms"])
    assert any(k.startswith("rss-sampler") for k in a[0]["threads_ms"]) and a[0]["other_threads_ms"] > 0
    text = (tmp_path / record.name.replace(".json", ".md")).read_text()
    assert text.startswith(bench_grpo.START) and "| answer_letters |" in text and "| yes |" in text
    ratio = a[0]["step_ms"] / b[0]["step_ms"]
    assert got["met"] == (ratio <= bench_grpo.GOAL_RATIO) and res.returncode == (0 if got["met"] else 1)
    assert (ROOT / "docs" / "benchmarks.md").read_text() == docs  # --no-docs
