"""The emitted SLURM script under a real SLURM: scripts/slurm_tiny-multinode.sh (the 2-"machine" FSDP twin) submitted
with sbatch to slurmctld and two slurmd on this host (Debian's slurm-wlm 22.05, munge for authentication), all started
from a temporary folder of the test session on free ports (the jobs' rendezvous ports too: first_job_id) and stopped at
its end.

What it proves: the job trains on 2 nodes from any submit directory; two jobs on the same nodes at once never meet; a
node that fails before the rendezvous ends the job within a minute; a requeue (`scontrol requeue`, and the script's
own after the time-limit signal) resumes to exactly the weights of an uninterrupted run, with one log appended across
the attempts. Skipped only outside CI when SLURM is not installed (.ci/run installs it).
"""

import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, bindable, free_port
from sftrecipes.launch.emit import job_port_span
from sftrecipes.recipe.load import load_recipe

pytestmark = pytest.mark.real_processes  # SLURM starts and kills the processes

SCRIPT = ROOT / "scripts" / "slurm_tiny-multinode.sh"
RECIPE = ROOT / "recipes" / "tiny" / "multinode.yaml"  # the recipe SCRIPT was emitted from
# a short deterministic run that saves often (fp32, linear decay: resuming must restore optimizer and scheduler)
FLAGS = ["--max_steps", "24", "--save_strategy", "steps", "--save_steps", "4", "--save_total_limit", "2",
         "--lr_scheduler_type", "linear", "--learning_rate", "5e-3", "--bf16", "false", "--sample_max_new_tokens", "0"]
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel")


def _need_slurm():
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    why = (f"SLURM is not installed ({', '.join(missing)} missing)" if missing else
           "slurmd must run as root" if os.geteuid() != 0 else None)
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{why}: CI must run the SLURM tests (.ci/run installs slurmctld slurmd slurm-client munge as root)")
    pytest.skip(f"{why} and CI is not set; to run these: apt-get install slurmctld slurmd slurm-client munge (as root)")


def first_job_id(jobs: int = 8) -> int:
    """A first job id for the local cluster whose next `jobs` jobs (this module submits 4) find their rendezvous ports
    free on this host now. The script derives a job's port from its id (the recipe's port + id % job_port_span): with
    ids from 1 every test session on a host would use the same ports, and two sessions at once (CI beside other work)
    would meet. The place in the span is random, as two sessions may look at the same moment."""
    recipe = load_recipe([str(RECIPE)])
    base, span = recipe.launch.main_process_port, job_port_span(recipe)
    for offset in random.sample(range(span), span):
        if all(bindable(base + (offset + i) % span) for i in range(jobs)):
            return offset + span * random.randint(1, 999)
    raise RuntimeError(f"no {jobs} free ports in a row among {base}..{base + span - 1} for the local SLURM's jobs")


class Cluster:
    """munged, slurmctld and two slurmd (nodes named after this host and `localhost`, both 127.0.0.1) in `home`."""

    def __init__(self, home: Path):
        self.home = home
        self.procs: list[subprocess.Popen] = []
        short = socket.gethostname().split(".")[0]
        if short == "localhost" or not _resolves(short):
            raise RuntimeError(f"this host's short name {short!r} must resolve to an address (the nodes are {short!r} and "
                               "'localhost', and the script uses the first node's name as the rendezvous address)")
        # this host's name first: slurmctld refuses a second node whose NodeHostname (localhost) came first
        self.nodes = [short, "localhost"]
        (home / "munge").mkdir()
        (home / "munge" / "key").write_bytes(os.urandom(1024))
        (home / "munge" / "key").chmod(0o600)
        for sub in ("state", "log", *(f"spool/{n}" for n in self.nodes)):
            (home / sub).mkdir(parents=True)
        self.socket = home / "munge" / "sock"
        ports = [free_port() for _ in range(3)]
        self.conf = home / "slurm.conf"
        self.conf.write_text("\n".join([
            "ClusterName=sftrecipes-test",
            f"FirstJobId={first_job_id()}",  # (its jobs' rendezvous ports free on this host)
            f"SlurmctldHost={short}(127.0.0.1)",
            f"SlurmctldPort={ports[0]}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={home}/state", f"SlurmdSpoolDir={home}/spool/%n",
            f"SlurmctldPidFile={home}/slurmctld.pid", f"SlurmdPidFile={home}/slurmd.%n.pid",
            f"SlurmctldLogFile={home}/log/slurmctld.log", f"SlurmdLogFile={home}/log/slurmd.%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU_Memory",
            "SlurmdParameters=config_overrides",  # the nodes' CPUs/memory below, whatever this machine has
            "ReturnToService=2", "MinJobAge=3600",  # finished jobs stay visible to scontrol (no accounting daemon)
            "KillWait=10", "InactiveLimit=0", "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            *(f"NodeName={n} NodeAddr=127.0.0.1 Port={p} CPUs=2 RealMemory=8000 State=UNKNOWN"
              for n, p in zip(self.nodes, ports[1:])),
            "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))},
                    "SLURM_CONF": str(self.conf)}

    def start(self):
        self._spawn("munged", ["munged", "-F", "-f", f"--socket={self.socket}", f"--key-file={self.home}/munge/key",
                               f"--pid-file={self.home}/munge/pid", f"--seed-file={self.home}/munge/seed"])
        self._wait(lambda: self.socket.exists(), "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for n in self.nodes:
            self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(self.conf)])
        self._wait(lambda: self.run("sinfo", "-h", "-o", "%T %D").stdout.split() == ["idle", "2"], "two idle nodes")

    def _spawn(self, name, argv):
        log = open(self.home / "log" / f"{name}.out", "w")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))

    def _wait(self, ready, what, timeout=60):
        deadline = time.time() + timeout
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.time() > deadline:
                why = "exited: " + ", ".join(dead) if dead else "timeout"
                raise RuntimeError(f"local SLURM: no {what} ({why})\n{self.log_tail()}")
            time.sleep(0.2)

    def run(self, *argv, check=False, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=kw.pop("env", self.env), capture_output=True, text=True, timeout=60,
                              check=check, **kw)

    def job(self, job_id: str) -> dict[str, str]:
        line = self.run("scontrol", "-o", "show", "job", job_id, check=True).stdout
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait_job(self, job_id, until, timeout=300) -> dict[str, str]:
        deadline = time.time() + timeout
        while not until(info := self.job(job_id)):
            assert time.time() < deadline, f"job {job_id} stuck: {info}\n{self.log_tail()}"
            time.sleep(0.2)
        return info

    def log_tail(self) -> str:
        return "\n".join(f"== {f.name}\n{f.read_text()[-1500:]}" for f in sorted((self.home / "log").iterdir()))

    def requeued(self, job_id, restarts: int):
        """Wait until the job is pending again after its n-th restart, then make it eligible now rather than in ~2
        minutes (SLURM's guard against reusing the job's revoked launch credential; slurmd refuses a credential made
        in the same second as the revocation, hence the 2 s)."""
        self.wait_job(job_id, lambda j: j["Restarts"] == str(restarts) and j["JobState"] == "PENDING")
        time.sleep(2)
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=True)

    def stop(self):
        """Cancel what still runs, wait for the job processes to end, then stop the daemons: nothing stays running."""
        if len(self.procs) > 1 and self.procs[1].poll() is None:  # slurmctld answers
            self.run("scancel", "--user=root")
            deadline = time.time() + 60
            while self.run("squeue", "-h", "-t", "RUNNING,COMPLETING").stdout.strip() and time.time() < deadline:
                time.sleep(0.5)
        for p in reversed(self.procs):  # slurmd, slurmctld, then munged
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _resolves(name: str) -> bool:
    try:
        socket.gethostbyname(name)
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    _need_slurm()
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def sbatch(cluster, args, cwd, env=None, wait=True) -> tuple[subprocess.Popen, str]:
    """`sbatch [--wait] SCRIPT args` from `cwd`, left running; returns it and the job id."""
    proc = subprocess.Popen(["sbatch", *(["--wait"] if wait else []), str(SCRIPT), *args], cwd=cwd,
                            env={**cluster.env, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = proc.stdout.readline()
    m = re.match(r"Submitted batch job (\d+)", first)
    assert m, first + proc.stdout.read()
    return proc, m.group(1)


def finish(proc, timeout=600) -> int:
    try:
        proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    from sftrecipes.export import export

    return load_file(export(out, out.parent / (out.name + "-export")) / "model.safetensors")


def assert_same_weights(a: dict, b: dict):
    assert a.keys() == b.keys() and len(a) > 0
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= 1e-6, worst


def newest_complete(out: Path) -> int:
    done = [int(p.parent.name.split("-")[1]) for p in out.glob("checkpoint-*/checkpoint.complete.json")]
    return max(done, default=0)


@pytest.fixture(scope="module")
def reference(slurm, tmp_path_factory):
    """Two jobs of the same run submitted together from a folder outside the repository, on the same two nodes at
    once (each takes 1 of the 2 CPUs per node). Returns (their output folders, job ids, submit folder)."""
    base = tmp_path_factory.mktemp("slurm-jobs")
    submit = base / "elsewhere"
    submit.mkdir()
    outs = [base / "a", base / "b"]
    jobs = [sbatch(slurm, [*FLAGS, "--output_dir", str(out)], cwd=submit) for out in outs]
    codes = [finish(proc) for proc, _ in jobs]
    ids = [job_id for _, job_id in jobs]
    logs = {job_id: (submit / f"tiny-multinode-{job_id}.out") for job_id in ids}
    assert codes == [0, 0], "\n".join(f"== job {j}\n{p.read_text()[-3000:] if p.exists() else '(no log)'}"
                                      for j, p in logs.items())
    return outs, ids, submit


def test_two_nodes_from_any_directory_and_two_jobs_at_once_never_meet(slurm, reference):
    """Submitted from a folder outside the repository (the script runs from SLURM's spool copy), both jobs train
    on 2 nodes and exit 0; their logs are in the submit folder. They ran at the same time on the same two nodes: had
    one job's launcher joined the other's rendezvous (the fixed port with static rendezvous did), one would have failed
    or trained with the other's ranks, and the two results would differ."""
    outs, ids, submit = reference
    recipe = load_recipe([str(RECIPE)])
    starts, ends = [], []
    for out, job_id in zip(outs, ids):
        info = slurm.job(job_id)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", info
        hosts = slurm.run("scontrol", "show", "hostnames", info["NodeList"], check=True).stdout.split()
        assert sorted(hosts) == sorted(slurm.nodes), info
        starts.append(info["StartTime"])
        ends.append(info["EndTime"])
        summary = json.loads((out / "run_summary.json").read_text())
        assert summary["backend"]["world_size"] == 2 and summary["backend"]["distributed_type"] == "FSDP"
        log = (submit / f"tiny-multinode-{job_id}.out").read_text()
        assert "done: 24 steps" in log
        port = recipe.launch.main_process_port + int(job_id) % job_port_span(recipe)  # the script's port for this job
        assert log.count(f":{port}, rendezvous id slurm-{job_id}") == 2, log[-3000:]  # both nodes on it
    assert max(starts) < min(ends), (starts, ends)  # they overlapped
    assert_same_weights(final_weights(outs[0]), final_weights(outs[1]))


def test_a_node_failing_before_rendezvous_ends_the_job_within_a_minute(slurm, tmp_path):
    """Node 1's launcher dies at start (its python exits 3); node 0's waits in the rendezvous for a node that never
    comes. srun --kill-on-bad-exit ends the job at once; without it node 0 waited until the time limit."""
    fake = tmp_path / "python-node1-fails"
    fake.write_text("#!/bin/bash\n"
                    'if [ "$SLURM_NODEID" = 1 ]; then echo "node 1: dies before the rendezvous" >&2; exit 3; fi\n'
                    f'exec {ROOT / ".venv/bin/python"} "$@"\n')
    fake.chmod(0o755)
    start = time.time()
    proc, job_id = sbatch(slurm, [*FLAGS, "--output_dir", str(tmp_path / "out")], cwd=tmp_path, env={"PYTHON": str(fake)})
    code = finish(proc, timeout=90)
    took = time.time() - start
    info = slurm.job(job_id)
    log = (tmp_path / f"tiny-multinode-{job_id}.out").read_text()
    assert code != 0 and info["JobState"] == "FAILED", (info, log[-2000:])
    # node 1's own line, or srun's report of it: srun may end the step before it forwards the task's last stderr line
    assert "node 1: dies before the rendezvous" in log or "task 1: Exited with exit code 3" in log, log[-2000:]
    assert took < 60, f"the job took {took:.0f}s to end after its node 1 failed"


def test_requeue_resumes_to_the_uninterrupted_weights(slurm, reference, tmp_path):
    """One job interrupted twice mid-run: `scontrol requeue` (as an admin or a node failure does), then the
    time-limit warning (USR1 to the batch script, as --signal sends it), after which the script stops every node and
    requeues its job itself. Each attempt resumes from the newest complete checkpoint (the script adds
    --resume_from_checkpoint auto to a restarted job) and the final weights equal the uninterrupted run's. The log
    (--open-mode=append) holds all three attempts."""
    out = tmp_path / "out"
    # sbatch --wait may return while a requeued job passes through a finished-looking state: follow the job instead
    _, job_id = sbatch(slurm, [*FLAGS, "--output_dir", str(out)], cwd=tmp_path, wait=False)
    log = tmp_path / f"tiny-multinode-{job_id}.out"

    def interrupt(how, restarts):
        seen = newest_complete(out)
        deadline = time.time() + 300
        while newest_complete(out) <= seen:
            assert time.time() < deadline, (how, log.read_text()[-3000:] if log.exists() else "")
            time.sleep(0.1)
        assert slurm.job(job_id)["JobState"] == "RUNNING"
        slurm.run(*how, check=True)
        slurm.requeued(job_id, restarts)
        assert not (out / "run_summary.json").exists()  # it really stopped mid-run
        return newest_complete(out)

    first = interrupt(["scontrol", "requeue", job_id], 1)
    second = interrupt(["scancel", "--batch", "--signal=USR1", job_id], 2)
    info = slurm.wait_job(job_id, lambda j: j["JobState"] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"))
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "2", \
        (info, text[-3000:], slurm.log_tail())
    assert text.count(f"rendezvous id slurm-{job_id}") == 2 * 3  # both nodes' launch, in each attempt's log
    resumes = [int(n) for n in re.findall(r"resume: from \S*checkpoint-(\d+)", text)]  # logged by every node/rank
    assert [n for n, _ in itertools.groupby(resumes)] == [first, second] and second > first, resumes
    assert json.loads((out / "run_summary.json").read_text())["resumed_from"].endswith(f"checkpoint-{second}")
    # the ranks saved, then left: a node's launch reports the save and exits 75; srun may report another code, as
    # --kill-on-bad-exit ends the other node once the first has exited 75 (its ranks had finished the same save)
    assert re.search(r"launch: preempted by SIG\w+ at step \d+: \S*checkpoint-\d+ is complete", text), text[-3000:]
    assert re.search(rf"slurm: preempted \(exit \d+\): requeueing job {job_id}\b", text), text[-3000:]
    assert text.count("done: 24 steps") == 1
    assert_same_weights(final_weights(reference[0][0]), final_weights(out))
