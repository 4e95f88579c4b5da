"""The suite's fork server (sftrecipes/core/forks.py) starts a process as `python ARGV` would: its argv, folder,
environment, stdio and own session; signals sent to the stand-in reach it, the stand-in ends as it ended (its exit
status, or the signal that killed it), and it ends when the stand-in is SIGKILLed."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import FORK_SERVER_ENV, ROOT

SCRIPT = r"""
import json, os, signal, sys, time
print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "argv": sys.argv[1:], "cwd": os.getcwd(),
                  "probe": os.environ.get("PROBE"), "torch_loaded": "torch" in sys.modules}), flush=True)
mode = sys.argv[1]
if mode == "exit":
    print("to stderr", file=sys.stderr)
    sys.exit(3)
if mode == "term":
    signal.signal(signal.SIGTERM, lambda *a: (print("got", a[0], flush=True), sys.exit(7)))
time.sleep(60)
"""


def start(tmp_path, mode: str) -> subprocess.Popen:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    return subprocess.Popen([sys.executable, "-m", "sftrecipes.core.forks", os.environ[FORK_SERVER_ENV],
                             str(script), mode], cwd=tmp_path, env={**os.environ, "PROBE": mode, "PYTHONPATH": str(ROOT)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def gone(pid: int, within: float) -> bool:
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_fork_is_the_process_it_stands_for(tmp_path):
    proc = start(tmp_path, "exit")
    out, err = proc.communicate(timeout=60)
    assert out, (proc.returncode, err)
    me = json.loads(out.splitlines()[0])
    assert proc.returncode == 3 and err.strip().endswith("to stderr"), (proc.returncode, err)
    assert me["argv"] == ["exit"] and me["cwd"] == str(tmp_path) and me["probe"] == "exit"
    assert me["pid"] != proc.pid and me["sid"] == me["pid"]  # a fork, in its own session as torch's agent starts ranks
    assert me["torch_loaded"]  # the point: the server imported it once


@pytest.mark.parametrize("how", ["forwarded", "default", "stand-in killed"])
def test_signals_reach_the_fork_and_its_end_is_the_stand_ins(tmp_path, how):
    proc = start(tmp_path, "term" if how == "forwarded" else "sleep")
    me = json.loads(proc.stdout.readline())
    time.sleep(0.3)  # its handler set
    if how == "stand-in killed":
        proc.kill()
        proc.wait(timeout=10)
        assert gone(me["pid"], 5), "the fork outlived its SIGKILLed stand-in"
        return
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    if how == "forwarded":
        assert proc.returncode == 7 and "got 15" in out, (proc.returncode, out)
    else:  # killed by the signal: so is the stand-in
        assert proc.returncode == -signal.SIGTERM, proc.returncode
    assert gone(me["pid"], 5)


@pytest.mark.real_processes
def test_without_a_server_the_process_runs_itself(tmp_path):
    """train.py with the variable set but nobody listening: it says so and runs as usual (--help: no torch)."""
    res = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, FORK_SERVER_ENV: str(tmp_path / "nobody.sock")})
    assert res.returncode == 0 and "running in this process" in res.stderr and "--use_peft_lora" in res.stdout, res.stderr


def test_a_forked_launcher_is_held_as_popen_holds_a_child(tmp_path):
    """forkserver.Forked, which `launch` holds torch's agent with under the server: the pid is the fork's own (its
    children are the ranks `launch` watches), in a session of its own; wait(timeout) raises TimeoutExpired while it
    runs; the signals in `ignore` are ignored (SIGUSR1 would end a default process); kill ends it; and
    `python -m sftrecipes VERB` hands itself to the server but does not hand itself over again inside the fork."""
    from sftrecipes.core.forks import Forked

    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    child = Forked(os.environ[FORK_SERVER_ENV], [str(script), "sleep"], {**os.environ, "PROBE": "held"},
                   ignore=(signal.SIGUSR1,))
    deadline = time.time() + 10  # (the fork sets its session up first thing)
    while os.getsid(child.pid) != child.pid and time.time() < deadline:
        time.sleep(0.02)
    assert os.getsid(child.pid) == child.pid and child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    time.sleep(0.3)  # (its signals set up)
    child.send_signal(signal.SIGUSR1)
    assert not gone(child.pid, 1) and child.poll() is None
    child.kill()
    assert child.wait(timeout=10) == -signal.SIGKILL and child.poll() == -signal.SIGKILL
    res = subprocess.run([sys.executable, "-m", "sftrecipes", "cp", "tiny/lora", str(tmp_path / "mine.yaml")], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and (tmp_path / "mine.yaml").is_file(), res.stderr
