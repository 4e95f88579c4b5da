"""`launch` and `cp`: any recipe, copied anywhere, started from any directory on the processes it names.

The copy-edit-launch flow of the README ("Your own recipe") runs here for real on 2 CPU processes from a folder outside
the repository, and an emitted launcher is shown to start the backend its command-line flags ask for. Bad inputs
(missing recipe, unknown key, cp onto a file) are also in the bad-input corpus (tests/bad_inputs/cases.yaml).
"""

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, bindable, free_port
from sftrecipes import cli
from sftrecipes.recipe.load import load_recipe

PKG = str(ROOT / "sftrecipes")  # `python PATH/TO/sftrecipes VERB`: the command line from any directory


def sft(args, cwd, env=None, timeout=120, module=False):
    """The command line as a user outside the repository calls it (the package folder, or -m with PYTHONPATH)."""
    topology = ("MACHINE_RANK", "MAIN_PROCESS_IP", "MAIN_PROCESS_PORT")  # only what the test gives
    env = {**{k: v for k, v in os.environ.items() if k not in topology and not k.startswith("SLURM_")}, **(env or {})}
    head = [sys.executable, "-m", "sftrecipes"] if module else [sys.executable, PKG]
    if module:
        env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([*head, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def one_error_line(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stdout + res.stderr
    return lines[0]


def dry_run(res) -> tuple[dict, list[str]]:
    """(exported environment, command) from --dry-run's stdout: export lines, then the command (shlex-quoted)."""
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    env = dict(shlex.split(ln)[1].split("=", 1) for ln in lines[:-1])
    assert all(ln.startswith("export ") for ln in lines[:-1]), res.stdout
    return env, shlex.split(lines[-1])


def opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# ----------------------------------------------------------------------------------------------- the verbs


def test_every_verb_answers_help_and_a_mistyped_verb_names_the_nearest(tmp_path, capsys):
    """cli.VERBS is the one table of verbs: each answers --help with its own usage (exit 0, nothing run), also the
    verbs that take a recipe as train.py does; a mistyped verb is one error line naming the nearest, exit 2."""
    for verb in cli.VERBS:
        try:
            code = cli.main([verb, "--help"])
        except SystemExit as e:  # argparse's --help
            code = e.code
        out = capsys.readouterr().out
        assert code == 0 and f"python -m sftrecipes {verb}" in out.splitlines()[0], (verb, out)
    line = one_error_line(sft(["lanch", "recipes/tiny/ddp.yaml"], cwd=tmp_path))
    assert "unknown verb 'lanch'" in line and "did you mean launch?" in line
    res = sft([], cwd=tmp_path)
    assert res.returncode == 2 and all(f"python -m sftrecipes {v} " in res.stderr for v in cli.VERBS), res.stderr


# ----------------------------------------------------------------------------------------------- cp


def test_cp_by_name_keeps_the_recipe_and_rewrites_its_bases(tmp_path, monkeypatch):
    """`cp tiny/ddp sub/my.yaml` from a folder outside the repository: comments kept, `base:` relative to the copy's
    folder, and the copy loads (from its folder) to the same recipe as the original from the repository root —
    except output_dir, which now means a folder under the launching directory."""
    res = sft(["cp", "tiny/ddp", "sub/my.yaml"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    copy = tmp_path / "sub" / "my.yaml"
    assert "launch sub/my.yaml" in res.stdout.splitlines()[-1]  # the next command, runnable from here
    source = (ROOT / "recipes/tiny/ddp.yaml").read_text()
    text = copy.read_text()
    assert text.splitlines()[:2] == source.splitlines()[:2]  # the header comments
    bases = yaml.safe_load(text)["base"]
    assert all(not os.path.isabs(b) for b in bases)
    assert [os.path.normpath(copy.parent / b) for b in bases] == [str(ROOT / "recipes/llama2-7b/ddp.yaml"), str(ROOT / "recipes/tiny/_twin.yaml")]

    original = load_recipe(["recipes/tiny/ddp.yaml"])  # from the repository root (the test's cwd)
    monkeypatch.chdir(tmp_path)
    mine = load_recipe(["sub/my.yaml"])
    a, b = original.as_dict(), mine.as_dict()
    for key in ("model_name_or_path", "dataset_name"):  # the repository's assets, whatever the cwd
        assert os.path.abspath(b.pop(key)) == str(ROOT / a.pop(key))
    assert b.pop("output_dir") == a.pop("output_dir") == "outputs/tiny-ddp"  # relative to where it is launched
    assert a == b


def test_cp_makes_a_shipped_recipes_local_paths_absolute(tmp_path, monkeypatch):
    """A shipped recipe's own relative input paths are relative to the repository root; in the copy they become
    absolute so that the copy reads the same model and data from any directory."""
    res = sft(["cp", str(ROOT / "recipes/tiny/_base.yaml"), str(tmp_path)], cwd=tmp_path)  # a folder: keeps the name
    assert res.returncode == 0, res.stderr
    data = yaml.safe_load((tmp_path / "_base.yaml").read_text())
    assert data["model_name_or_path"] == str(ROOT / ".assets/tiny-llama")
    assert data["dataset_name"] == str(ROOT / "data/tiny_chat")
    assert data["max_seq_len"] == 256 and data["eval_strategy"] == "no"  # the rest as written (alias, quoted "no")
    monkeypatch.chdir(tmp_path.parent)
    r = load_recipe([str(tmp_path / "_base.yaml"), "--output_dir", "o"])
    assert Path(r.model.model_name_or_path).is_dir() and Path(r.data.dataset_name).is_dir()


def test_cp_refuses_to_overwrite_without_force(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("learning_rate: 1.0e-3\n")
    line = one_error_line(sft(["cp", "tiny/fsdp", "mine.yaml"], cwd=tmp_path))
    assert "--force" in line and mine.read_text() == "learning_rate: 1.0e-3\n"
    res = sft(["cp", "tiny/fsdp", "mine.yaml", "--force"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load(mine.read_text())["output_dir"] == "outputs/tiny-fsdp"


# ----------------------------------------------------------------------------------------------- launch --dry-run


@pytest.mark.parametrize("module", [False, True], ids=["package-folder", "python-m"])
def test_dry_run_of_an_outside_copy_from_its_folder(tmp_path, module):
    """2 processes through accelerate, train.py of the repository, the recipe as the user named it, a free port
    (several single-node runs may share a host), the cpu target's environment — and nothing written or started."""
    assert sft(["cp", "tiny/ddp", "my-ddp.yaml"], cwd=tmp_path).returncode == 0
    before = sorted(tmp_path.rglob("*"))
    env, argv = dry_run(sft(["launch", "my-ddp.yaml", "--dry-run", "--learning_rate", "1e-3"], cwd=tmp_path, module=module))
    assert argv[1:3] == ["-m", "accelerate.commands.launch"]
    assert opt(argv, "--num_processes") == "2" and opt(argv, "--num_machines") == "1" and opt(argv, "--machine_rank") == "0"
    port = int(opt(argv, "--main_process_port"))
    assert port != 29500 and bindable(port)  # not the recipe's default: a port free on this host
    assert argv[-4:] == [str(ROOT / "train.py"), "my-ddp.yaml", "--learning_rate", "1e-3"]
    assert opt(argv, "--config_file") == "outputs/tiny-ddp/accelerate_config.yaml"  # the copy's output_dir, from here
    assert env == {"DS_ACCELERATOR": "cpu"}  # threads: each rank counts its cores (recipe/target.cpu_threads)
    assert sorted(tmp_path.rglob("*")) == before


def test_port_set_by_the_user_is_kept(tmp_path):
    assert sft(["cp", "tiny/ddp", "my.yaml"], cwd=tmp_path).returncode == 0
    port = free_port()
    _, argv = dry_run(sft(["launch", "my.yaml", "--dry-run", "--launch.main_process_port", str(port)], cwd=tmp_path))
    assert opt(argv, "--main_process_port") == str(port)
    port = free_port()
    _, argv = dry_run(sft(["launch", "my.yaml", "--dry-run"], cwd=tmp_path, env={"MAIN_PROCESS_PORT": str(port)}))
    assert opt(argv, "--main_process_port") == str(port)


def test_single_process_recipe_runs_plain_train_py(tmp_path):
    assert sft(["cp", "tiny/lora", "lora.yaml"], cwd=tmp_path).returncode == 0
    env, argv = dry_run(sft(["launch", "lora.yaml", "--dry-run"], cwd=tmp_path))
    assert argv == [sys.executable, str(ROOT / "train.py"), "lora.yaml"] and env == {}  # hardware auto: the rank decides


def test_multinode_rank_and_address_from_slurm(tmp_path):
    """Under SLURM without MACHINE_RANK/MAIN_PROCESS_IP: the rank is SLURM_NODEID, the address the allocation's first
    host (scontrol, a stand-in here), the port the recipe's (all nodes must agree). A rank outside the recipe's
    machines is refused, and so is a multi-node launch that knows no rank at all."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/sh\n[ \"$1 $2 $3\" = 'show hostnames node-[4-5]' ] && printf 'node-4\\nnode-5\\n'\n")
    scontrol.chmod(0o755)
    slurm = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[4-5]", "SLURM_NODEID": "1"}
    port = str(free_port())  # every node reads the same recipe and flags: the port they meet on
    recipe = str(ROOT / "recipes/tiny/multinode.yaml")
    _, argv = dry_run(sft(["launch", recipe, "--dry-run", "--launch.main_process_port", port], cwd=tmp_path, env=slurm))
    assert (opt(argv, "--machine_rank"), opt(argv, "--main_process_ip"), opt(argv, "--main_process_port")) == ("1", "node-4", port)
    assert opt(argv, "--num_machines") == "2" and opt(argv, "--num_processes") == "2"
    free = ["--dry-run", "--launch.main_process_port", port]  # never the recipe's fixed port: runs share this host
    _, argv = dry_run(sft(["launch", recipe, *free], cwd=tmp_path, env={"MACHINE_RANK": "0", "MAIN_PROCESS_IP": "10.0.0.7"}))
    assert (opt(argv, "--machine_rank"), opt(argv, "--main_process_ip"), opt(argv, "--main_process_port")) == ("0", "10.0.0.7", port)
    assert "MACHINE_RANK" in one_error_line(sft(["launch", recipe, *free], cwd=tmp_path, env={**slurm, "SLURM_NODEID": "2"}))
    assert "MACHINE_RANK" in one_error_line(sft(["launch", recipe, *free], cwd=tmp_path))


def test_every_verb_takes_an_outside_recipe(tmp_path):
    """Each verb that reads a recipe, given one outside the repository: a result or one line, never a traceback.
    emit cannot name files after it and says what to do instead."""
    assert sft(["cp", "tiny/zero3", "z3.yaml"], cwd=tmp_path).returncode == 0
    for verb in (["plan"], ["env"], ["preflight"], ["launch", "--dry-run"], ["prepare", "--dry-run"]):
        res = sft([verb[0], "z3.yaml", *verb[1:]], cwd=tmp_path)
        assert res.returncode == 0 and "Traceback" not in res.stderr, (verb, res.stderr[-2000:])
    assert "VERDICT" in sft(["preflight", "z3.yaml"], cwd=tmp_path).stdout
    for args in (["emit", "z3.yaml"], ["emit", "--check", str(tmp_path / "z3.yaml")]):
        line = one_error_line(sft(args, cwd=tmp_path))
        assert "not under recipes/" in line and "python -m sftrecipes launch" in line
    assert sft(["cp", "z3.yaml", "again.yaml"], cwd=tmp_path).returncode == 0  # a copy of a copy
    assert yaml.safe_load((tmp_path / "again.yaml").read_text())["base"] == yaml.safe_load((tmp_path / "z3.yaml").read_text())["base"]
    assert "not found" in one_error_line(sft(["launch", "missing.yaml"], cwd=tmp_path))
    assert "did you mean learning_rate" in one_error_line(sft(["launch", "z3.yaml", "--learning_rat", "1"], cwd=tmp_path))


# ----------------------------------------------------------------------------------------------- real runs (2 ranks)


def test_copy_edit_launch_from_its_own_folder(tiny_model, tmp_path):
    """The README's "Your own recipe", as written there: copy the DDP twin, point it at data in the run's folder,
    launch from that folder. Both ranks train on the user's data (a relative path from there) with the repository's
    tiny model (a relative path in the shipped base), and the run writes under the run's folder."""
    rows = (ROOT / "data/tiny_chat/train.jsonl").read_text().splitlines()[:64]
    (tmp_path / "my_chat").mkdir()
    (tmp_path / "my_chat/train.jsonl").write_text("\n".join(rows) + "\n")
    shutil.copy(ROOT / "data/tiny_chat/test.jsonl", tmp_path / "my_chat/test.jsonl")

    assert sft(["cp", "tiny/ddp", "my-ddp.yaml"], cwd=tmp_path).returncode == 0
    with open(tmp_path / "my-ddp.yaml", "a") as f:
        f.write("dataset_name: my_chat\n")
    res = sft(["launch", "my-ddp.yaml", "--max_steps", "2", "--sample_max_new_tokens", "0"], cwd=tmp_path, timeout=600)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    out = tmp_path / "outputs/tiny-ddp"
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["backend"]["world_size"] == 2 and summary["backend"]["wrapper"] == "DistributedDataParallel"
    assert summary["steps"] == 2 and len(summary["losses"]) == 2
    assert summary["data"]["train"]["read"] == 64 and summary["data"]["eval"]["read"] == 40, summary["data"]  # the user's rows
    assert "my_chat" in log and "data: train split: 64 read" in log
    assert yaml.safe_load((out / "accelerate_config.yaml").read_text())["num_processes"] == 2
    assert (out / "adapter_model.safetensors").is_file()


def test_launcher_flags_choose_the_backend_that_runs(tmp_path):
    """scripts/run_tiny-ddp.sh with --launch.backend fsdp: the accelerate config is rendered from the recipe + flags,
    so FSDP really runs (parameters sharded across the 2 ranks, read from the live model), not the DDP config emitted
    for the recipe."""
    out = tmp_path / "fsdp"
    res = subprocess.run(["scripts/run_tiny-ddp.sh", "--launch.backend", "fsdp", "--output_dir", str(out), "--max_steps", "2",
                          "--sample_max_new_tokens", "0"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    backend = json.loads((out / "run_summary.json").read_text())["backend"]
    assert backend["distributed_type"] == "FSDP" and backend["world_size"] == 2
    assert backend["param_elements_local"] * 2 == pytest.approx(backend["param_elements_full"], rel=0.02)
    assert yaml.safe_load((out / "accelerate_config.yaml").read_text())["distributed_type"] == "FSDP"
    assert yaml.safe_load((ROOT / "configs/tiny-ddp.yaml").read_text())["distributed_type"] == "MULTI_GPU"


@pytest.mark.parametrize("agent_code, asked, preempted, refused, expected", [
    (0, True, True, [], (75, "preempted by SIGTERM at step 3")),       # a preemption, every rank saved and ended
    (1, True, True, [], (75, "preempted by SIGTERM at step 3")),       # a rank failed after the checkpoint was complete
    (0, False, True, [], (75, "preempted by SIGTERM at step 3")),      # the ranks were signalled, not launch
    # CI: rank 1 refused its data (exit 2), the agent sent SIGTERM to rank 0 while it waited for that data, and rank 0
    # wrote preempted.json: launch said "preempted" (exit 75), and resume would have refused again
    (1, False, True, ["bad data"], (2, "1 of 2 ranks refused the recipe and torch's agent stopped the others (exit 2): bad data")),
    (1, False, True, [], (1, None)),                                    # a rank crashed; the agent stopped rank 0 in setup
    (1, False, False, ["bad data", "bad data"], (2, "every rank refused the recipe (exit 2): bad data")),
    (1, True, False, ["bad data"], (1, "the ranks ended without saving a preemption checkpoint")),
    (0, False, False, [], (0, None)),
])
def test_launch_outcome_tells_a_preemption_from_a_rank_the_agent_stopped(agent_code, asked, preempted, refused, expected):
    from sftrecipes.launch.supervise import outcome

    record = {"signal": "SIGTERM", "step": 3, "checkpoint": "out/checkpoint-3"} if preempted else None
    code, line = outcome(agent_code, asked=asked, preempted=record, refused=refused, ranks=2)
    assert code == expected[0] and (line is None if expected[1] is None else line.startswith(expected[1])), (code, line)


STOPPED = ("dataset_name: cut.jsonl line 4 cannot be read; training stopped after step 3: out/checkpoint-3 is complete; "
           "once the data is fixed, resume with resume_from_checkpoint: auto")
INTERRUPTED = "evaluation interrupted by SIGTERM before it finished: nothing was written (...); run it again (exit 75)"


@pytest.mark.parametrize("agent_code, asked, refused, stopped, interrupted, expected", [
    # every rank stopped on a streamed row it could not read, after training, with a complete checkpoint: not a refusal
    (1, False, [], [STOPPED, STOPPED], [], (2, f"every rank stopped (exit 2): {STOPPED}")),
    (1, False, [], [STOPPED], [], (2, f"1 of 2 ranks stopped and torch's agent stopped the others (exit 2): {STOPPED}")),
    (1, False, ["bad data", "bad data"], [], [], (2, "every rank refused the recipe (exit 2): bad data")),
    # an evaluation-only run signalled (launch, or the ranks by the scheduler): 75, no checkpoint, run it again
    (0, True, [], [], [INTERRUPTED, INTERRUPTED], (75, INTERRUPTED)),
    (0, False, [], [], [INTERRUPTED, INTERRUPTED], (75, INTERRUPTED)),
    # a rank refused, and torch's agent's SIGTERM reached the other in its evaluation: the refusal is the outcome
    (1, False, ["bad data"], [], [INTERRUPTED], (2, "1 of 2 ranks refused the recipe and torch's agent stopped the others")),
])
def test_launch_outcome_words_a_stop_after_training_and_an_interrupted_evaluation(agent_code, asked, refused, stopped,
                                                                                   interrupted, expected):
    from sftrecipes.launch.supervise import outcome

    code, line = outcome(agent_code, asked=asked, preempted=None, refused=refused, ranks=2, stopped=stopped,
                         interrupted=interrupted)
    assert code == expected[0] and line.startswith(expected[1]), (code, line)
