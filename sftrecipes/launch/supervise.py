"""Starting any recipe on the processes it names: `launch` renders the run's accelerate config from the recipe and
its flags, checks it can start here (pre-flight), then runs train.py, standing guard over accelerate's processes.

    python -m sftrecipes launch RECIPE [--key value ...] [--dry-run] [--force]

`launch` runs from any directory (`python PATH/TO/sftrecipes launch ...` where the package is not importable): the
ranks run train.py in the caller's directory, so a recipe's relative paths mean what they mean there, except those
written in the shipped recipes under recipes/, which are relative to the repository root (recipe.from_repo_root).
The emitted scripts/run_*.sh and slurm_*.sh (emit.py) call it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml

from sftrecipes.core import forks as forkserver
from sftrecipes.core import procs
from sftrecipes.core.errors import RecipeError
from sftrecipes.core.paths import ROOT
from sftrecipes.facts import startmodel
from sftrecipes.launch import genserver
from sftrecipes.launch.accelerate import accelerate_config, launcher_env
from sftrecipes.launch.preflight import before_launch
from sftrecipes.recipe.evalonly import eval_only, summary_path
from sftrecipes.recipe.load import load_recipe, parse_argv
from sftrecipes.recipe.typed import Recipe
from sftrecipes.run import heartbeats, lifecycle, runlock
from sftrecipes.run.checkpoints import check_resume, finished_run

LAUNCH_CONFIG = "accelerate_config.yaml"  # where `launch` writes the run's accelerate config, in its output_dir


@dataclass
class Launch:
    """What `launch` starts: the command, the environment it adds to the caller's, and the accelerate config it
    writes first (None for a single plain process: backend none runs train.py itself)."""

    argv: list[str]
    env: dict[str, str]
    recipe: Recipe
    config: dict | None = None
    config_path: Path | None = None
    topology: str = "1 process"
    machine_rank: int = 0
    server: genserver.Server | None = None  # the vLLM server started first (launch.vllm_server_gpus, machine 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _slurm_first_node(environ: Mapping[str, str]) -> str:
    """The allocation's first host (SLURM numbers nodes in this order), as scripts/slurm_*.sh takes it."""
    nodes = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if nodes:
        try:
            res = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, timeout=60,
                                 env=dict(environ))
            if res.returncode == 0 and res.stdout.split():
                return res.stdout.split()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    raise RecipeError("launch: MAIN_PROCESS_IP is not set and SLURM's node list could not be read (scontrol show hostnames "
                      "$SLURM_JOB_NODELIST); export MAIN_PROCESS_IP=<machine 0's address> on every node")


def topology(recipe: Recipe, environ: Mapping[str, str]) -> tuple[int, str, int]:
    """(machine rank, main address, port) of this launcher. Rank and address from MACHINE_RANK / MAIN_PROCESS_IP, or
    SLURM's (SLURM_NODEID, the allocation's first host); the port from MAIN_PROCESS_PORT, else the recipe's when it
    sets one or spans machines (every node must agree), else a free one (several runs may share a host)."""
    L = recipe.launch
    machines = L.num_machines
    rank_text = environ.get("MACHINE_RANK") or (environ.get("SLURM_NODEID") if machines > 1 else None)
    if machines > 1 and rank_text is None:
        raise RecipeError(
            f"launch: the recipe spans launch.num_machines {machines} machines, so each needs its rank: start it on every "
            f"machine with MACHINE_RANK (0 to {machines - 1}) and MAIN_PROCESS_IP (machine 0's address) set, or under SLURM "
            "(sbatch scripts/slurm_<name>.sh, or srun)"
        )
    try:
        rank = int(rank_text or 0)
    except ValueError:
        raise RecipeError(f"launch: MACHINE_RANK={rank_text!r} is not a number; set it to 0..{machines - 1}") from None
    if not 0 <= rank < machines:
        raise RecipeError(f"launch: MACHINE_RANK {rank} is not a machine of this recipe (launch.num_machines {machines}: "
                          f"ranks 0 to {machines - 1}); fix MACHINE_RANK or launch.num_machines")
    if environ.get("MAIN_PROCESS_IP"):
        address = environ["MAIN_PROCESS_IP"]
    elif machines > 1 and not environ.get("MACHINE_RANK"):  # rank from SLURM: so is the address
        address = _slurm_first_node(environ)
    else:
        address = "127.0.0.1"
    port_text = environ.get("MAIN_PROCESS_PORT")
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise RecipeError(f"launch: MAIN_PROCESS_PORT={port_text!r} is not a port number (1-65535)")
        port = int(port_text)
    elif "launch.main_process_port" in recipe.explicit or machines > 1:
        port = L.main_process_port
    else:
        port = free_port()
    return rank, address, port


def launch_command(args: list[str], environ: Mapping[str, str] | None = None) -> Launch:
    """The command that starts RECIPE [--key value ...] (args as train.py takes them) from the current directory:
    `accelerate launch` with the config rendered from the recipe + flags, or plain train.py for backend none.
    Validates the recipe and the topology; writes and starts nothing."""
    environ = os.environ if environ is None else environ
    if not parse_argv(args)[0]:  # (flags are checked here too)
        raise RecipeError("launch: no recipe file given; write python -m sftrecipes launch RECIPE.yaml [--key value ...] "
                          "[--dry-run] [--force]")
    recipe = load_recipe(args)
    L = recipe.launch
    train = "train.py" if Path.cwd().resolve() == ROOT else str(ROOT / "train.py")
    env = launcher_env(recipe)
    if L.backend == "none":
        gen = genserver.plan(recipe, environ, 0, free_port)
        return Launch([sys.executable, train, *args, *gen.rank_args], {**env, **gen.rank_env}, recipe, server=gen.server)
    world = L.world_size
    rank, address, port = topology(recipe, environ)
    gen = genserver.plan(recipe, environ, rank, free_port)  # (its flags after the user's: where the server listens)
    env = {**env, **gen.rank_env}
    config_path = Path(recipe.trl["output_dir"]) / LAUNCH_CONFIG
    if eval_only(recipe):  # beside its summary: never over the config of a training run's results (evalonly.summary_path)
        config_path = summary_path(recipe.trl["output_dir"]).parent / LAUNCH_CONFIG
    job = environ.get("SLURM_JOB_ID", "") if L.num_machines > 1 else ""
    if job:
        # the rendezvous id (torch reads PET_RDZV_ID; its default is "none" for every job) prefixes every rendezvous
        # key in the store: another job's launcher that reaches this address and port (on a shared host one joined
        # as this job's machine 1) registers under its own id and never joins this job. Static rendezvous keeps
        # machine rank = node rank, so global rank 0 is on machine 0 (c10d orders nodes by host name and pid).
        env = {**env, "PET_RDZV_ID": f"slurm-{job}"}
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_path),
            "--num_machines", str(L.num_machines), "--num_processes", str(world), "--machine_rank", str(rank),
            "--main_process_ip", address, "--main_process_port", str(port), train, *args, *gen.rank_args]
    where = (f"{L.backend}, {world} process(es) on {L.num_machines} machine(s); this is machine {rank}, main process at "
             f"{address}:{port}" + (f", rendezvous id slurm-{job}" if job else ""))
    config = {**accelerate_config(recipe), "main_process_port": port}  # the port this run really uses
    return Launch(argv, env, recipe, config, config_path, where, rank, gen.server)


def write_launch_config(run: Launch) -> Path:
    """The run's accelerate config, in its output_dir beside what the run writes (a record of how it was started).
    Every node of a multi-node run writes the same text, each through its own temporary file."""
    path = run.config_path
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RecipeError(f"output_dir: cannot create '{path.parent}' for the run ({e.strerror}); set output_dir to a writable folder") from None
    tmp.write_text("# Rendered by `python -m sftrecipes launch` from the recipe and its command line "
                   "(launch/accelerate.accelerate_config); rewritten at every launch.\n"
                   + yaml.safe_dump(run.config, sort_keys=True, default_flow_style=False))
    tmp.replace(path)
    return path


def main(argv: list[str]) -> int:
    """`launch RECIPE [--key value ...] [--dry-run] [--force]`: the output_dir's lock (another run: exit 2), a finished
    run's no-op (resume 'auto': exit 0, nothing written), pre-flight, config, then the run: one plain process is exec'd
    (it is the run: signals reach it, its exit code is the command's); accelerate runs as a child that `supervise`
    stands guard over; a vLLM server (launch.vllm_server_gpus) first, until it answers, and stopped after the run
    (genserver.py; one that never answers: exit 1). Exit codes: 0 done, 1 training failed, 2 bad input, 75 preempted
    (resumable). --dry-run prints the environment and the command (stdout) and starts nothing."""
    dry_run, force = "--dry-run" in argv, "--force" in argv
    run = launch_command([a for a in argv if a not in ("--dry-run", "--force")])
    if dry_run:
        for k, v in run.env.items():
            print(f"export {k}={shlex.quote(v)}")
        print(shlex.join(run.argv))
        if run.server is not None:
            print(f"# dry run: launch first starts the vLLM server and waits for its {genserver.HEALTH} (log: "
                  f"{run.server.log}); the server: {run.server.describe()}", file=sys.stderr)
        if run.config is not None:
            print(f"# dry run: nothing started; {run.topology}; at launch this accelerate config is written to "
                  f"{run.config_path}:", file=sys.stderr)
            print("\n".join("#   " + line for line in yaml.safe_dump(run.config, sort_keys=True).splitlines()), file=sys.stderr)
        return 0
    if run.server is not None:
        genserver.check_environment(run.server)  # exit 2: no such python, or no vllm there
    out, main_machine = lifecycle.output_dir(run.recipe), run.machine_rank == 0
    if main_machine:  # (other machines cannot tell their own job's lock from another's: machine 0 guards the folder)
        runlock.check_lock(out, run.recipe.run.force_lock)
    done = finished_run(run.recipe)
    if done:
        print(done, file=sys.stderr)
        return 0
    print(before_launch(run.recipe, force=force))  # exit 2 with the reason (memory plan, GPUs)
    check_resume(run.recipe)  # exit 2 if the checkpoint to resume cannot continue at this process count or backend
    if run.config is None and run.server is None:  # one plain process: train.py takes the lock itself (same pid after exec)
        print(f"launch: {run.topology}: {shlex.join(run.argv)}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        env = {**os.environ, **run.env}
        env.pop(forkserver.FORK_PID_ENV, None)  # (a fork of the suite's server: the new interpreter is none, it asks again)
        os.execve(run.argv[0], run.argv, env)
    lock = runlock.take_lock(out, run.recipe.run.force_lock) if main_machine else None  # before anything is written
    try:
        # an adapter as model_name_or_path: merged into its base once, here, before the ranks start (they then find it);
        # an evaluation-only run evaluates the adapter on its base (evaluate.py): no merged copy
        if not eval_only(run.recipe) and startmodel.adapter_of(run.recipe.model.model_name_or_path) is not None:
            from sftrecipes.export import startfrom  # (torch: only for a run that starts from an adapter)

            startfrom.ensure(run.recipe.model.model_name_or_path, run.recipe.run.heartbeat_timeout)
        if run.config is not None:
            write_launch_config(run)
        return _with_server(run, lock)
    finally:
        if lock is not None:
            lock.release()


def _with_server(run: Launch, lock: runlock.Lock | None) -> int:
    """The run, after its vLLM server where it has one (started and healthy first, stopped after it, whatever ends it):
    accelerate's processes under `supervise`, or the one plain process as a child (genserver.run_beside)."""
    try:
        with genserver.serving(run.server):
            print(f"launch: {run.topology}: {shlex.join(run.argv)}", file=sys.stderr)
            if run.config is not None:
                return supervise(run, lock)
            token = {lifecycle.LOCK_ENV: lock.token} if lock is not None else {}
            return genserver.run_beside(run.argv, {**os.environ, **run.env, **token})
    except genserver.ServerFailed as e:
        print(f"launch: {e}", file=sys.stderr, flush=True)
        return 1
    except genserver.Interrupted as e:
        print(f"launch: {e} while the vLLM server started: stopped it; nothing trained (exit 75: run it again)",
              file=sys.stderr, flush=True)
        return lifecycle.EXIT_PREEMPTED


def _ranks(agent: int) -> list:
    """The processes torch's agent started (the ranks), each in a session of its own."""

    try:
        return psutil.Process(agent).children()
    except psutil.Error:
        return []


def _started(proc) -> float:
    try:
        return proc.create_time()
    except Exception:  # noqa: BLE001 - gone meanwhile
        return 0.0


def _signal_all(procs: list, sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except Exception:  # noqa: BLE001 - gone meanwhile (psutil.NoSuchProcess) or not ours
            pass


def _kill_run(agent: subprocess.Popen, why: str, code: int = 1) -> int:
    print(f"launch: {why}", file=sys.stderr, flush=True)
    _signal_all(_ranks(agent.pid), signal.SIGKILL)
    agent.kill()
    agent.wait()
    return code


def _agent_setup(parent: int):
    """Runs in the agent's process before exec: SIGKILL when `launch` dies (its ranks follow: they ask the same of the
    agent), and SIGUSR1 ignored (torch's agent would die on it and orphan the ranks; `launch` translates it)."""
    def setup():
        procs.die_with_parent(parent)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    return setup


def _start_agent(argv: list[str], env: dict):
    """accelerate's launcher as a child in a session of its own (`_agent_setup`). Under the test suite's fork server
    (forkserver.ENV set, as train.py honours it) the launcher is a fork of the server instead, held the same way
    (forkserver.Forked: its pid is the agent's, whose children are the ranks; it ends with this process; SIGUSR1
    ignored), so that it does not import torch again."""
    sock = os.environ.get(forkserver.ENV)
    if sock and argv[0] == sys.executable and argv[1:2] == ["-m"]:  # (accelerate.commands.launch)
        try:
            return forkserver.Forked(sock, argv[1:], env, ignore=(signal.SIGUSR1,))
        except OSError:  # no server answers there (any more): a process of its own, as without it
            pass
    return subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_agent_setup(os.getpid()))


def supervise(run: Launch, lock: runlock.Lock | None = None) -> int:
    """Run accelerate's launcher (torch's elastic agent) as a child in a session of its own and stand between it and
    the signals a user or scheduler sends this command:

    - SIGTERM, SIGUSR1, SIGINT, SIGHUP: the ranks are asked to stop (SIGTERM/SIGUSR1 as received, the others as
      SIGTERM): each finishes its optimizer step, they save a complete checkpoint together and exit; rank 0 writes
      preempted.json; this command exits 75. If they have not ended within preempt_timeout, or at a second Ctrl-C,
      everything is killed (exit 1, 130).
    - SIGKILL of this command: Linux kills the agent (die_with_parent), whose ranks die with it the same way.
    - A rank of this node whose heartbeat stopped (heartbeat_timeout) ends this node's part of the run with a line
      naming it (exit 1); the ranks watch each other across nodes (and under launchers other than this one).
    - Every rank of this node refused the recipe (a RecipeError inside the ranks, each exiting 2 with its one line,
      left in a temporary folder outside output_dir: lifecycle.note_refusal) or stopped after training (a streamed
      row it could not read), or some did and the agent stopped the others: exit 2, as for bad input found here.
    - An evaluation-only run signalled: its ranks leave that line and exit; this command says it and exits 75.
    Returns the exit code (outcome()): 75 when preempted.json was written during this run and this command was
    signalled or the ranks all ended well, else the agent's 0, else 2 (the recipe refused), else 1."""
    recipe = run.recipe
    out, timeout = lifecycle.output_dir(recipe), recipe.run.preempt_timeout
    env = {**os.environ, **run.env, lifecycle.SUPERVISED_ENV: "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(timeout)}
    if lock is not None:
        env[lifecycle.LOCK_ENV] = lock.token
    refused = Path(tempfile.mkdtemp(prefix="sftrecipes-refused-"))  # outside output_dir: a refusal writes nothing there
    env[lifecycle.REFUSED_ENV] = str(refused)
    try:
        return _supervise(run, agent_env=env, out=out, timeout=timeout, refused=refused)
    finally:
        shutil.rmtree(refused, ignore_errors=True)


def _supervise(run: Launch, agent_env: dict, out: Path, timeout: int, refused: Path) -> int:
    """supervise's loop: the agent started with agent_env, watched until it ends; its exit code as supervise says."""
    recipe, env = run.recipe, agent_env
    asked: list[int] = []
    handlers = {s: signal.signal(s, lambda sig, _frame: asked.append(sig))
                for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)}
    started = time.time()
    try:
        agent = _start_agent(run.argv, env)
    except BaseException:
        for s, h in handlers.items():
            signal.signal(s, h)
        raise
    watch = (heartbeats.Watch(out / heartbeats.HEARTBEATS, recipe.run.heartbeat_timeout, pids=lambda: {p.pid for p in _ranks(agent.pid)})
             if recipe.run.heartbeat_timeout else None)  # this node's ranks (the ranks watch the others)
    handled, deadline, code, asked_ranks, next_watch = 0, None, None, set(), 0.0
    try:
        while True:
            try:  # a signal is passed on within 0.1 s (a fast run does several steps in 0.5 s)
                code = agent.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            for sig in asked[handled:]:
                handled += 1
                if deadline is None:
                    deadline = time.time() + timeout
                    what = ("stop the evaluation (nothing to save)" if eval_only(recipe) else
                            "finish their step, save a checkpoint and exit")
                    print(f"launch: {signal.Signals(sig).name}: asking the ranks to {what} (up to preempt_timeout "
                          f"{timeout}s)", file=sys.stderr, flush=True)
                elif sig == signal.SIGINT:
                    return _kill_run(agent, "second SIGINT: killing the run now (no checkpoint)", 130)
            if deadline is not None:  # every rank once, also one the agent starts later (once its handlers are set)
                forward = asked[0] if asked[0] in (signal.SIGTERM, signal.SIGUSR1) else signal.SIGTERM
                young = time.time() - 2.0
                ranks = [p for p in _ranks(agent.pid) if p.pid not in asked_ranks and _started(p) < young]
                _signal_all(ranks, forward)
                asked_ranks.update(p.pid for p in ranks)
                if time.time() > deadline:
                    return _kill_run(agent, f"the ranks did not save and exit within preempt_timeout {timeout}s; killing "
                                     "them (the latest complete checkpoint stays; raise preempt_timeout if saves take longer)")
            stale = []
            if watch and time.monotonic() >= next_watch:  # (the heartbeat files and /proc twice a second)
                stale, next_watch = watch.stale(), time.monotonic() + 0.5
            if stale:  # a rank stopped beating: collectives cannot complete; end this node's part now
                return _kill_run(agent, "\nlaunch: ".join(heartbeats.describe_silent(r, recipe.run.heartbeat_timeout) for r in stale))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    record = lifecycle.read_preempted(out, since=started)
    code, line = outcome(code, asked=bool(asked), preempted=record, refused=lifecycle.refusals(refused),
                         ranks=recipe.launch.gpus_per_node, stopped=lifecycle.refusals(refused, "stopped"),
                         interrupted=lifecycle.refusals(refused, "interrupted"))
    if line:
        print(f"launch: {line}", file=sys.stderr, flush=True)
    if record and code != lifecycle.EXIT_PREEMPTED:
        (out / lifecycle.PREEMPTED).unlink(missing_ok=True)  # written by a rank the agent stopped: no preemption
    return code


def outcome(agent_code: int, asked: bool, preempted: dict | None, refused: list[str], ranks: int,
            stopped: list[str] = (), interrupted: list[str] = ()) -> tuple[int, str | None]:
    """launch's exit code and its last line, from what the run left: the agent's exit code, whether this command was
    signalled (asked), the preempted.json rank 0 wrote during the run, the lines of this node's ranks that refused the
    recipe, stopped after training (a streamed row they could not read: a complete checkpoint of the steps trained)
    or interrupted an evaluation-only run (lifecycle.note_refusal).

    A rank signalled before training writes preempted.json and exits 0 (under launch); a rank of an evaluation-only
    run leaves its line instead (nothing to resume: run it again; 75 all the same, so a requeue runs it again). torch's
    agent sends SIGTERM to every rank when one fails, so a rank that refused the recipe (exit 2) or crashed while
    another still loaded or waited for the data leaves that record too: it is a preemption only when this command was
    signalled or every rank ended well; otherwise the failure is the outcome: 2 when every rank refused or stopped, or
    some did and the agent stopped the others (nobody asked), else 1."""
    if preempted and (asked or agent_code == 0):
        return lifecycle.EXIT_PREEMPTED, (f"preempted by {preempted['signal']} at step {preempted['step']}: "
                                          f"{preempted['checkpoint']} is complete; resume with resume_from_checkpoint: auto "
                                          "(exit 75)")
    if interrupted and (asked or agent_code == 0):
        return lifecycle.EXIT_PREEMPTED, interrupted[0]
    if agent_code == 0:
        return 0, None
    if (refused or stopped) and len(refused) + len(stopped) >= ranks:
        if refused:
            return 2, f"every rank refused the recipe (exit 2): {refused[0]}"
        return 2, f"every rank stopped (exit 2): {stopped[0]}"
    if (refused or stopped) and not asked:
        what = "refused the recipe" if refused else "stopped"
        return 2, (f"{len(refused or stopped)} of {ranks} ranks {what} and torch's agent stopped the others (exit 2): "
                   f"{(refused or stopped)[0]}")
    if asked:
        return 1, "the ranks ended without saving a preemption checkpoint; the latest complete checkpoint stays"
    return 1, None

