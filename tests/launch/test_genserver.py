"""The vLLM server `launch` starts for a grpo recipe in vllm_mode server (launch.vllm_server_gpus, launch/genserver.py),
against a stand-in for TRL's `python -m trl.scripts.vllm_serve` (fake_vllm_serve.py, in an environment of its own as
launch.vllm_server_python) and a stand-in for the training command (training on CPU cannot use vLLM): the GPUs split
between the ranks and the server, the server's arguments, the wait for its /health before any rank starts, the ranks
pointed at it, and no process of it left after the run, after a server that never answers (one line, exit 1) and
after a signal during its start. The recipe rules are cases of tests/bad_inputs/cases.yaml."""

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT
from sftrecipes.launch import genserver, supervise
from sftrecipes.recipe.load import load_recipe

SHIPPED = "recipes/llama3.1-70b/grpo-lora.yaml"  # ZeRO-3 on 4 GPUs + a server on 4 (tensor parallel 4)
COLOCATE = "recipes/qwen3-8b/grpo-lora.yaml"  # one process; vLLM in it

STAND_IN = """import json, os, sys, urllib.request
args = sys.argv[1:]
url = "http://%s:%s/health" % (args[args.index("--vllm_server_host") + 1], args[args.index("--vllm_server_port") + 1])
status = urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=5).status
with open(os.environ["STAND_IN_RECORD"], "w") as f:
    json.dump({"health": status, "args": args, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
               "lock": os.environ.get("SFTRECIPES_LOCK")}, f)
"""


@pytest.fixture
def server_env(tmp_path, monkeypatch):
    """A python whose `trl.scripts.vllm_serve` is the stand-in (and `vllm` an empty package), the records' paths, and
    `launch` with its pre-flight (the GPUs torch counts) skipped and train.py replaced by the stand-in command."""
    site = tmp_path / "vllm-env" / "site"
    (site / "trl" / "scripts").mkdir(parents=True)
    (site / "vllm").mkdir()
    for init in (site / "trl" / "__init__.py", site / "trl" / "scripts" / "__init__.py", site / "vllm" / "__init__.py"):
        init.write_text("")
    (site / "trl" / "scripts" / "vllm_serve.py").write_text((ROOT / "tests" / "launch" / "fake_vllm_serve.py").read_text())
    python = tmp_path / "vllm-env" / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={shlex.quote(str(site))} exec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN)
    records = {"server": tmp_path / "server.json", "ranks": tmp_path / "ranks.json"}
    monkeypatch.setenv("FAKE_SERVE_RECORD", str(records["server"]))
    monkeypatch.setenv("STAND_IN_RECORD", str(records["ranks"]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(supervise, "before_launch", lambda recipe, force=False: "preflight: (skipped by the test)")
    real = supervise.launch_command

    def with_stand_in(args, environ=None):
        run = real(args, environ)
        i = next(i for i, a in enumerate(run.argv) if a.endswith("train.py"))
        run.argv = [sys.executable, str(stand_in), *run.argv[i + 1:]]
        return run

    monkeypatch.setattr(supervise, "launch_command", with_stand_in)
    return python, records


def gone(pid: int, within: float = 10.0) -> bool:
    """The process has ended (a zombie not yet reaped by init counts as ended)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_dry_run_gives_the_ranks_and_the_server_gpus_of_their_own():
    """The command line as users see it: the ranks on GPUs 0-3 pointed at the server's port, the server's command on
    GPUs 4-7 with tensor parallel 4; a colocate recipe starts no server."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    res = subprocess.run([sys.executable, "-m", "sftrecipes", "launch", SHIPPED, "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    export, command = res.stdout.strip().splitlines()
    assert export == "export CUDA_VISIBLE_DEVICES=0,1,2,3"
    argv = shlex.split(command)
    assert argv[-5:-4] == [SHIPPED] and argv[-4:-2] == ["--vllm_server_host", "127.0.0.1"]
    port = argv[-1]
    [server] = [ln for ln in res.stderr.splitlines() if "trl.scripts.vllm_serve" in ln]
    words = shlex.split(server.split("; the server: ", 1)[1])
    assert words[0] == "CUDA_VISIBLE_DEVICES=4,5,6,7" and words[1] == str(ROOT / ".venv-vllm/bin/python")
    assert words[2:] == ["-m", "trl.scripts.vllm_serve", "--model", "meta-llama/Llama-3.1-70B-Instruct",
                         "--tensor_parallel_size", "4", "--data_parallel_size", "1", "--host", "127.0.0.1", "--port", port,
                         "--dtype", "bfloat16", "--max_model_len", "1280"]
    res = subprocess.run([sys.executable, "-m", "sftrecipes", "launch", COLOCATE, "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "vllm_serve" not in res.stdout + res.stderr and "CUDA_VISIBLE_DEVICES" not in res.stdout


def test_the_gpus_split_where_cuda_visible_devices_lists_them():
    """The ranks take the first gpus_per_node of the GPUs the job was given, the server the next; too few is one
    line; machines other than 0 start no server (their ranks keep the first GPUs); the recipe's port is kept."""
    visible = {"CUDA_VISIBLE_DEVICES": "3,5,7,9,11,13,15,17,19"}
    run = supervise.launch_command([SHIPPED, "--vllm_server_port", "8123"], visible)
    assert run.env["CUDA_VISIBLE_DEVICES"] == "3,5,7,9" and run.server.env == {"CUDA_VISIBLE_DEVICES": "11,13,15,17"}
    assert run.argv[-4:] == ["--vllm_server_host", "127.0.0.1", "--vllm_server_port", "8123"]
    assert run.server.url == "http://127.0.0.1:8123" and run.server.timeout == 1800
    with pytest.raises(Exception, match=r"^launch.vllm_server_gpus: CUDA_VISIBLE_DEVICES=0,1,2 lists 3 GPU\(s\) and the "
                                        r"run needs 8 .*make 8 visible"):
        supervise.launch_command([SHIPPED], {"CUDA_VISIBLE_DEVICES": "0,1,2"})
    other = supervise.launch_command([SHIPPED, "--launch.num_machines", "2"],
                                     {"MACHINE_RANK": "1", "MAIN_PROCESS_IP": "10.0.0.1"})
    assert other.server is None and other.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and "--vllm_server_port" not in other.argv


def test_a_run_from_an_sft_adapter_serves_the_merged_model(tmp_path):
    """SFT -> GRPO: the server loads the merged start (export/startfrom.py writes it beside the adapter before the
    server starts), not the adapter folder vLLM could not load as a model."""
    adapter = tmp_path / "sft-out"
    adapter.mkdir()
    base = str(ROOT / ".assets" / "tiny-llama3")
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base, "peft_type": "LORA", "r": 4,
                                                             "lora_alpha": 8, "target_modules": ["q_proj"]}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    run = supervise.launch_command([SHIPPED, "--model_name_or_path", str(adapter), "--launch.vllm_server_gpus", "2",
                                    "--output_dir", str(tmp_path / "grpo")], {})
    model = run.server.argv[run.server.argv.index("--model") + 1]
    assert model == str(tmp_path / "sft-out-merged")
    assert run.server.argv[run.server.argv.index("--tensor_parallel_size") + 1] == "2"  # all of its GPUs (4 heads)


@pytest.mark.parametrize("recipe", [SHIPPED, COLOCATE])
def test_launch_starts_the_server_before_the_ranks_and_stops_it_after(server_env, tmp_path, monkeypatch, recipe):
    """Through `launch` (main): the server's environment checked, the server started on its GPUs and healthy before the
    training command starts (which reaches its /health at the port it was given, on the ranks' GPUs), stopped with its
    worker after the run: accelerate's processes under supervise (ZeRO-3 recipe) or one process beside it (backend
    none, the colocate recipe turned to server mode on 1 + 1 GPUs)."""
    python, records = server_env
    flags = ["--launch.vllm_server_python", str(python), "--output_dir", str(tmp_path / "out")]
    if recipe == COLOCATE:
        flags += ["--vllm_mode", "server", "--launch.vllm_server_gpus", "1"]
    monkeypatch.setenv("FAKE_SERVE_DELAY", "1.0")  # not healthy at once: launch must wait for it
    assert supervise.main([recipe, *flags]) == 0
    server, ranks = (json.loads(records[k].read_text()) for k in ("server", "ranks"))
    port = ranks["args"][ranks["args"].index("--vllm_server_port") + 1]
    assert ranks["health"] == 200 and ranks["args"][ranks["args"].index("--vllm_server_host") + 1] == "127.0.0.1"
    want = ("0,1,2,3", "4,5,6,7", "4") if recipe == SHIPPED else ("0", "1", "1")
    assert (ranks["cuda"], server["cuda"]) == want[:2]
    assert server["argv"][:8] == ["--model", load_recipe([recipe]).model.model_name_or_path, "--tensor_parallel_size",
                                  want[2], "--data_parallel_size", "1", "--host", "127.0.0.1"]
    assert server["argv"][8:10] == ["--port", port]
    if recipe == COLOCATE:  # launch held the output_dir's lock and handed it to the one process
        assert ranks["lock"]
    assert gone(server["pid"]) and gone(server["worker"])
    log = (tmp_path / "out" / genserver.LOG).read_text()
    assert "trl.scripts.vllm_serve" in log.splitlines()[0]


@pytest.mark.parametrize("mode", ["silent", "exit"])
def test_a_server_that_never_answers_ends_launch_in_one_line(server_env, tmp_path, capsys, monkeypatch, mode):
    """A server that stays silent past vllm_server_timeout, or exits first: one line naming its log (and its last
    line), exit 1, no rank started, nothing of the server left."""
    python, records = server_env
    monkeypatch.setenv("FAKE_SERVE_MODE", mode)
    capsys.readouterr()
    code = supervise.main([SHIPPED, "--launch.vllm_server_python", str(python), "--vllm_server_timeout", "1.5",
                           "--output_dir", str(tmp_path / "out")])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    log = tmp_path / "out" / genserver.LOG
    assert code == 1 and len(err) == 1, err
    if mode == "silent":
        assert err[0].startswith("launch: the vLLM server did not answer http://127.0.0.1:") and "/health within " \
            f"vllm_server_timeout 1.5 s (raise it for a large model); its log: {log}" in err[0], err
    else:
        assert err[0].startswith("launch: the vLLM server exited with status 3 before http://127.0.0.1:") and err[0].endswith(
            f"/health answered; its log: {log} (its last line: fake vllm_serve: cannot load the model)"), err
    assert not records["ranks"].exists()
    server = json.loads(records["server"].read_text())
    assert gone(server["pid"]) and gone(server["worker"])


def test_a_signal_while_the_server_starts_stops_it(server_env, tmp_path, capsys, monkeypatch):
    """SIGTERM (a scheduler's preemption) while `launch` waits for the server: the server stopped, no rank started,
    exit 75 (nothing trained: a requeued job runs it again)."""
    python, records = server_env
    monkeypatch.setenv("FAKE_SERVE_MODE", "silent")
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        code = supervise.main([SHIPPED, "--launch.vllm_server_python", str(python), "--output_dir", str(tmp_path / "out")])
    finally:
        timer.cancel()
    assert code == 75 and "launch: SIGTERM while the vLLM server started: stopped it" in capsys.readouterr().err
    assert not records["ranks"].exists()
    server = json.loads(records["server"].read_text())
    assert gone(server["pid"]) and gone(server["worker"])


def test_the_server_environment_is_checked_before_anything_starts(tmp_path):
    """launch.vllm_server_python missing, or a python without vllm: one line, exit 2, nothing written."""
    out = tmp_path / "out"
    for python, said in ((tmp_path / "nope" / "python", "is not an executable python"),
                         (Path(sys.executable), "has no vllm or no trl.scripts.vllm_serve")):
        res = subprocess.run([sys.executable, "-m", "sftrecipes", "launch", SHIPPED, "--launch.vllm_server_python",
                              str(python), "--output_dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.returncode == 2 and len(lines) == 1 and said in lines[0] and "make vllm-env" in lines[0], res.stderr
    assert not out.exists()


def test_the_emitted_launchers_start_the_server_through_launch():
    """scripts/run_*.sh calls `launch` (which starts the server) and says so; a SLURM job asks each node for the ranks'
    GPUs and the server's."""
    from sftrecipes.launch import emit

    recipe = load_recipe([SHIPPED])
    run = emit.run_script(recipe, SHIPPED, "llama3.1-70b-grpo-lora")
    assert run.rstrip().endswith(f'-m sftrecipes launch {SHIPPED} "$@"') and "launch starts a vLLM server" in run
    assert "--gres=gpu:8" in emit.slurm_script(load_recipe([SHIPPED, "--launch.num_machines", "2"]), SHIPPED, "x")
    assert "vLLM server" not in emit.run_script(load_recipe([COLOCATE]), COLOCATE, "qwen3-8b-grpo-lora")


def test_the_grpo_twins_are_their_shipped_recipes_without_vllm():
    """Each CPU twin extends its shipped recipe and keeps its method, LoRA, reference (beta) and backend (the one-GPU
    recipe's twin: DDP on 2 ranks); what it leaves out is vLLM (no server, transformers generates), the hub's data and
    its rewards: its own reward varies from the first step."""
    for twin, shipped, backend in (("llama3-grpo-zero3", SHIPPED, "deepspeed"), ("qwen3-grpo", COLOCATE, "ddp")):
        t, s = load_recipe([f"recipes/tiny/{twin}.yaml"]), load_recipe([shipped])
        assert t.sources[0].endswith(shipped) and t.launch.hardware == "cpu" and t.launch.world_size == 2
        assert t.launch.backend == backend and (t.method, t.trl_value("beta")) == (s.method, s.trl_value("beta"))
        assert (t.model.use_peft_lora, t.model.lora_r, t.model.lora_target_modules) == (
            s.model.use_peft_lora, s.model.lora_r, s.model.lora_target_modules)
        assert s.trl_value("use_vllm") and not t.trl_value("use_vllm") and t.launch.vllm_server_gpus == 0
        assert t.run.reward_funcs == ["recipes/tiny/rewards.py:answer_letters"]
