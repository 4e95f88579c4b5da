"""A run's life around training (sftrecipes/train/runlife.py, run/lifecycle.py, launch's supervisor): one run per
output_dir, a frozen rank ends the run within heartbeat_timeout, a preemption save is bounded by preempt_timeout, and
the lock's rules.

Killing the launcher, preemption and the finished-run no-op run on every backend in tests/run/test_resume.py.
"""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT
from sftrecipes.run import heartbeats
from sftrecipes.core import procs
from sftrecipes.run import runlock
from sftrecipes.recipe.load import load_recipe
from test_resume import processes_of, ranks_of

pytestmark = pytest.mark.real_processes  # locks, signals, a frozen rank: the processes themselves


def lock_record(out: Path, **fields) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": procs.proc_start(os.getpid()),
              "since": "2026-01-01T00:00:00+00:00", "token": "theirs", **fields}
    (out / runlock.LOCK).write_text(json.dumps(record))


def test_lock_refuses_a_live_run_takes_over_a_dead_one_and_respects_other_hosts(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="sftrecipes")
    out = tmp_path / "run"
    lock = runlock.take_lock(out)
    held = json.loads((out / runlock.LOCK).read_text())
    assert (held["host"], held["pid"]) == (socket.gethostname(), os.getpid()) and held["since"]
    with pytest.raises(runlock.LockHeld) as e:  # this process is alive: a second run is refused, naming it
        runlock.take_lock(out, force=True)  # (force never overrides a live holder on this host)
    assert f"pid {os.getpid()}" in str(e.value) and "\n" not in str(e.value)
    runlock.check_lock(out, token=lock.token)  # ... but not the run the lock was taken for (launch's ranks)
    lock.release()
    assert not (out / runlock.LOCK).exists()

    dead = subprocess.Popen(["true"])
    dead.wait()
    for record in ({"pid": dead.pid}, {"pid_start": -1}):  # holder gone; our pid reused by another process
        lock_record(out, **record)
        mine = runlock.take_lock(out)
        assert json.loads((out / runlock.LOCK).read_text())["token"] == mine.token
        assert "taking over" in caplog.text and "its process is gone" in caplog.text
        caplog.clear()
        lock_record(out)  # a run that took the lock over after us keeps it: release removes only our own
        mine.release()
        assert json.loads((out / runlock.LOCK).read_text())["token"] == "theirs"

    lock_record(out, host="another-host")  # a shared filesystem: nobody here can tell whether that run lives
    with pytest.raises(runlock.LockHeld, match="another host .*host another-host.*force_lock: true"):
        runlock.take_lock(out)
    runlock.take_lock(out, force=True)
    assert "force_lock" in caplog.text
    (out / runlock.LOCK).write_text("{")
    with pytest.raises(runlock.LockHeld, match="unreadable"):
        runlock.check_lock(out)


def test_a_requeued_slurm_job_takes_over_its_earlier_attempts_lock(tmp_path, monkeypatch, caplog):
    """A requeued job may start on another node, where the lock its killed first attempt left is "another host's":
    the same job's later attempt takes it over; another job, or the same attempt, is still refused."""
    caplog.set_level(logging.INFO, logger="sftrecipes")
    out = tmp_path / "run"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock_record(out, host="node-a", slurm_job="4242", slurm_restart=1)  # this very attempt, elsewhere: refused
    with pytest.raises(runlock.LockHeld, match="another host"):
        runlock.take_lock(out)
    lock_record(out, host="node-a", slurm_job="4241", slurm_restart=0)  # another job: refused
    with pytest.raises(runlock.LockHeld, match="another host"):
        runlock.take_lock(out)
    lock_record(out, host="node-a", slurm_job="4242", slurm_restart=0)  # the first attempt: taken over
    mine = runlock.take_lock(out)
    held = json.loads((out / runlock.LOCK).read_text())
    assert held["token"] == mine.token and (held["slurm_job"], held["slurm_restart"]) == ("4242", 1)
    assert "earlier attempt of SLURM job 4242" in caplog.text


def test_heartbeat_watch_judges_this_runs_ranks_by_their_own_silence(tmp_path):
    folder = tmp_path / "hb"
    beat = heartbeats.Heartbeat(folder, rank=1)
    leftover = heartbeats.Heartbeat(folder, rank=5)  # an earlier run on more processes left it: it never changes
    watch = heartbeats.Watch(folder, timeout=8, own_rank=0, world=2)
    assert watch.stale(now=0) == []
    assert watch.stale(now=7.9) == []  # silent since first seen for 7.9 s < 8
    (silent,) = watch.stale(now=8)  # frozen before its first beat: judged all the same
    assert (silent["rank"], silent["pid"], silent["step"], silent["silent"]) == (1, os.getpid(), 0, 8)
    beat.beat(step=3)
    assert watch.stale(now=9) == [] and watch.stale(now=16.9) == []  # beats again: silent from its last beat on
    assert watch.stale(now=17)[0]["step"] == 3
    beat.beat(step=4, done=True)  # left its run on purpose (a peer may still push to the hub): never judged
    assert watch.stale(now=18) == [] and watch.stale(now=100) == []
    assert leftover.count == 0  # rank 5 >= world: never judged
    launch_side = heartbeats.Watch(folder, timeout=8, pids=lambda: {123})  # launch: its own ranks only (pid 123)
    assert launch_side.stale(now=0) == [] and launch_side.stale(now=100) == []


def fake_agent_preemption(tmp_path, preempt_timeout: int) -> tuple[int, float, str]:
    """launch.supervise over a stand-in for torch's agent that ignores SIGTERM and never ends: SIGTERM to this process
    (the command a user started) asks for a save; supervise gives up after preempt_timeout. Returns (exit code,
    seconds from the signal to the end, TORCH_ELASTIC_SHUTDOWN_TIMEOUT as the agent saw it)."""
    from sftrecipes.launch.supervise import Launch, launch_command, supervise

    out = tmp_path / "fake"
    args = ["recipes/tiny/ddp.yaml", "--output_dir", str(out), "--preempt_timeout", str(preempt_timeout)]
    env = launch_command(args).env  # (supervise adds TORCH_ELASTIC_SHUTDOWN_TIMEOUT for torch's agent)
    seen = tmp_path / "agent-env"
    agent = [sys.executable, "-c", "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             f"open({str(seen)!r}, 'w').write(os.environ['TORCH_ELASTIC_SHUTDOWN_TIMEOUT']); time.sleep(600)"]
    sent = []
    timer = threading.Timer(1.0, lambda: (sent.append(time.time()), os.kill(os.getpid(), signal.SIGTERM)))
    timer.start()
    code = supervise(Launch(agent, env, load_recipe(args)))
    timer.cancel()
    return code, time.time() - sent[0], seen.read_text()


def test_preempt_timeout_bounds_the_wait_for_a_save(tmp_path, capfd):
    code, waited, shutdown_timeout = fake_agent_preemption(tmp_path, preempt_timeout=3)
    assert code == 1 and 3 <= waited < 5, (code, waited)
    assert shutdown_timeout == "3"  # torch's agent waits as long before it SIGKILLs the ranks
    assert "did not save and exit within preempt_timeout 3s" in capfd.readouterr().err


def test_lock_is_released_when_the_run_fails(tiny_model, tmp_path, capsys):
    """train.py's own lock (a single process, no `launch`): a run that fails after taking it leaves none behind (nor
    the output_dir taking it created, so bad input still writes nothing)."""
    import train

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"neither": "messages nor text"}\n' * 4)
    out = tmp_path / "run"
    code = train.main(["recipes/tiny/lora.yaml", "--dataset_name", str(bad), "--splits", "train", "--output_dir", str(out)])
    assert code == 2 and "error: dataset_format" in capsys.readouterr().err  # (data is read after the lock)
    assert not out.exists()  # the lock released, and the folder it created (empty again) removed: nothing written


def test_a_second_run_is_refused_and_a_frozen_rank_ends_the_run(tiny_model, tmp_path):
    """Two runs on one folder: the second (2 ranks through launch, or one process through train.py) exits 2 at once
    with one line naming the first (host, pid, since) and touches nothing; it used to run, mixing both runs' files.
    Then one rank of the first is frozen (SIGSTOP): the run ends within heartbeat_timeout + 2 beats (+ a margin for
    this shared CPU), naming the rank, instead of hanging for the collective timeout."""
    out = tmp_path / "run"
    timeout = 8
    log = open(tmp_path / "run.log", "w")
    first = subprocess.Popen([sys.executable, "-m", "sftrecipes", "launch", "recipes/tiny/ddp.yaml", "--output_dir", str(out),
                              "--max_steps", "2000", "--save_strategy", "steps", "--save_steps", "5", "--sample_max_new_tokens",
                              "0", "--heartbeat_timeout", str(timeout)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while not ((out / "checkpoint-5" / "checkpoint.complete.json").exists() and len(list((out / heartbeats.HEARTBEATS).glob("rank-*.json"))) == 2):
            assert first.poll() is None and time.time() < deadline, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.1)
        held = json.loads((out / runlock.LOCK).read_text())
        assert held["pid"] == first.pid
        config = out / "accelerate_config.yaml"
        before = (config.read_text(), config.stat().st_mtime_ns, (out / runlock.LOCK).read_text())
        for second in (["-m", "sftrecipes", "launch", "recipes/tiny/ddp.yaml"], ["train.py", "recipes/tiny/lora.yaml"]):
            t = time.time()
            res = subprocess.run([sys.executable, *second, "--output_dir", str(out)], cwd=ROOT, capture_output=True, text=True,
                                 timeout=120)
            lines = [line for line in res.stderr.splitlines() if line.strip()]
            assert res.returncode == 2 and len(lines) == 1, (res.returncode, res.stderr[-2000:])
            assert f"in use by another run (host {held['host']}, pid {first.pid}, since {held['since']})" in lines[0]
            assert time.time() - t < 30  # refused before torch is imported or anything loads
        assert (config.read_text(), config.stat().st_mtime_ns, (out / runlock.LOCK).read_text()) == before
        assert len(ranks_of(out)) == 2  # the first run's, nothing started beside them

        rank1 = json.loads((out / heartbeats.HEARTBEATS / "rank-1.json").read_bytes())
        assert rank1["pid"] in ranks_of(out)
        os.kill(rank1["pid"], signal.SIGSTOP)
        stopped = time.time()
        code = first.wait(timeout=120)
        took = time.time() - stopped
        text = (tmp_path / "run.log").read_text()
        assert code == 1, text[-3000:]
        assert took <= timeout + 2 * heartbeats.beat_interval(timeout) + 10, took
        assert f"rank 1 (host {socket.gethostname()}, pid {rank1['pid']}) has not beaten" in text and "stopped" in text
        assert not processes_of(out)  # the frozen rank too
        assert not (out / runlock.LOCK).exists()  # released, also on failure
    finally:
        for pid in processes_of(out):
            os.kill(pid, signal.SIGKILL)
        first.kill()


def test_error_lines_of_ranks_writing_at_once_are_never_glued():
    """Every rank that refuses a recipe says `error: ...` to the same pipe at once (CI once read two ranks' lines glued
    into one). Eight processes each say 300 lines of 450 bytes to one pipe: every line read back is whole."""
    code = ("import sys; from sftrecipes.core.errors import say_error\n"
            "for i in range(300): say_error(sys.argv[1] * 440 + f' {i:04d}')\n")
    r, w = os.pipe()
    procs_ = [subprocess.Popen([sys.executable, "-c", code, chr(ord("a") + k)], stderr=w, cwd=ROOT) for k in range(8)]
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    assert [p.wait() for p in procs_] == [0] * 8
    lines = out.splitlines()
    assert len(lines) == 8 * 300
    for k in range(8):
        c = chr(ord("a") + k)
        mine = [line for line in lines if line.startswith(f"error: {c}")]
        assert mine == [f"error: {c * 440} {i:04d}" for i in range(300)], [m for m in mine if len(m) != 451][:2]
