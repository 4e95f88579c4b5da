"""The vLLM server a grpo/rloo run generates with in vllm_mode server (launch.vllm_server_gpus): its command on GPUs of
its own and what the ranks are told of it (`plan`), started by `launch` before the ranks, waited for until its /health
answers and stopped, with every process it started, when the run ends (`serving`).

    <launch.vllm_server_python> -m trl.scripts.vllm_serve --model M --tensor_parallel_size T --data_parallel_size D
        --host 127.0.0.1 --port P [--dtype bfloat16] [--max_model_len N] [--vllm_model_impl I]

TRL's script runs vLLM's own server (`vllm serve` with the weight-transfer engine the trainer pushes its weights
through); it lives in an environment of its own (requirements-vllm.txt: vLLM's pins conflict with the training stack).
The server runs on machine 0, where global rank 0 is (the only rank TRL's client runs on), and listens on 127.0.0.1.
"""

from __future__ import annotations

import http.client
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from sftrecipes.core import procs
from sftrecipes.core.errors import RecipeError
from sftrecipes.core.paths import ROOT
from sftrecipes.facts.startmodel import weights_dir
from sftrecipes.recipe.serverkeys import server_parallel
from sftrecipes.recipe.target import mixed_dtype
from sftrecipes.recipe.typed import Recipe
from sftrecipes.run import lifecycle

HOST = "127.0.0.1"
HEALTH = "/health"  # what TRL's VLLMClient.check_server asks before it connects
LOG = "vllm_server.log"  # in output_dir, appended at every launch
STOP_GRACE_S = 30.0  # SIGTERM, then SIGKILL to whatever of the server is left
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


class ServerFailed(Exception):
    """The server ended or stayed silent before answering /health: `launch` prints the line and exits 1."""


class Interrupted(Exception):
    """A signal reached `launch` while the server started: nothing trained yet."""

    def __init__(self, sig: int):
        super().__init__(signal.Signals(sig).name)
        self.sig = sig


@dataclass
class Server:
    """One vLLM server to start: its argv, what it adds to the environment (its GPUs), its address and log."""

    argv: list[str]
    env: dict[str, str]
    url: str
    log: Path
    timeout: float
    gpus: list[str]

    def describe(self) -> str:
        return f"CUDA_VISIBLE_DEVICES={','.join(self.gpus)} {shlex.join(self.argv)}"


@dataclass
class Generation:
    """What `launch` does for a run's generation server: the server it starts (machine 0; None elsewhere or without
    one), the flags the ranks get (where it listens) and the environment they get (the GPUs left to them)."""

    server: Server | None = None
    rank_args: list[str] = field(default_factory=list)
    rank_env: dict[str, str] = field(default_factory=dict)


def python_path(recipe: Recipe) -> str:
    """launch.vllm_server_python, a relative path taken from the repository root."""
    p = Path(recipe.launch.vllm_server_python).expanduser()
    return str(p if p.is_absolute() else ROOT / p)


def split_gpus(recipe: Recipe, environ: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(the ranks' GPUs, the server's): the first gpus_per_node of CUDA_VISIBLE_DEVICES (else of 0, 1, ...), then the
    next vllm_server_gpus."""
    L = recipe.launch
    need = L.gpus_per_node + L.vllm_server_gpus
    listed = (environ.get("CUDA_VISIBLE_DEVICES") or "").strip()
    ids = [x.strip() for x in listed.split(",") if x.strip()] if listed else [str(i) for i in range(need)]
    if len(ids) < need:
        raise RecipeError(f"launch.vllm_server_gpus: CUDA_VISIBLE_DEVICES={listed} lists {len(ids)} GPU(s) and the run "
                          f"needs {need} (gpus_per_node {L.gpus_per_node} for the ranks + vllm_server_gpus "
                          f"{L.vllm_server_gpus} for the vLLM server); make {need} visible, or lower them")
    return ids[:L.gpus_per_node], ids[L.gpus_per_node:need]


def plan(recipe: Recipe, environ: Mapping[str, str], machine_rank: int, free_port: Callable[[], int]) -> Generation:
    """The server of a recipe with launch.vllm_server_gpus (nothing for the others): on machine 0 on the recipe's
    vllm_server_port where it sets one, else a free port; the ranks of every machine on the first GPUs."""
    L = recipe.launch
    if not L.vllm_server_gpus:
        return Generation()
    ranks, gpus = split_gpus(recipe, environ)
    rank_env = {"CUDA_VISIBLE_DEVICES": ",".join(ranks)}
    if machine_rank != 0:
        return Generation(rank_env=rank_env)
    port = int(recipe.trl["vllm_server_port"]) if "vllm_server_port" in recipe.trl else free_port()
    tp, dp = server_parallel(recipe)
    argv = [python_path(recipe), "-m", "trl.scripts.vllm_serve", "--model", weights_dir(recipe.model.model_name_or_path),
            "--tensor_parallel_size", str(tp), "--data_parallel_size", str(dp), "--host", HOST, "--port", str(port)]
    if mixed_dtype(recipe):  # the dtype the trainer computes in, and pushes its weights in
        argv += ["--dtype", mixed_dtype(recipe)]
    if recipe.trl_value("vllm_max_model_length") is not None:
        argv += ["--max_model_len", str(recipe.trl_value("vllm_max_model_length"))]
    if "vllm_model_impl" in recipe.trl:
        argv += ["--vllm_model_impl", str(recipe.trl["vllm_model_impl"])]
    server = Server(argv, {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}, f"http://{HOST}:{port}",
                    lifecycle.output_dir(recipe) / LOG, float(recipe.trl_value("vllm_server_timeout")), gpus)
    return Generation(server, ["--vllm_server_host", HOST, "--vllm_server_port", str(port)], rank_env)


def check_environment(server: Server) -> None:
    """The server's python exists and has vllm and TRL's script (asked without importing vLLM): else one line, exit 2,
    before anything starts."""
    py = server.argv[0]
    fix = ("create it with `make vllm-env` (requirements-vllm.txt), or set launch.vllm_server_python to the python of an "
           "environment with trl and vllm")
    if not (os.path.isfile(py) and os.access(py, os.X_OK)):
        raise RecipeError(f"launch.vllm_server_python: {py} is not an executable python; {fix}")
    probe = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('vllm') and u.find_spec('trl.scripts.vllm_serve') else 3)"
    try:
        res = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RecipeError(f"launch.vllm_server_python: {py} could not be asked for vllm ({e}); {fix}") from None
    if res.returncode != 0:
        raise RecipeError(f"launch.vllm_server_python: {py} has no vllm or no trl.scripts.vllm_serve; {fix}")


def _session_child(parent: int):
    def setup():
        procs.die_with_parent(parent)  # launch killed outright: the server's main process goes with it
    return setup


def start(server: Server) -> subprocess.Popen:
    """The server in a session of its own (its process group is everything it starts), its output appended to its log."""
    server.log.parent.mkdir(parents=True, exist_ok=True)
    with open(server.log, "ab") as log:
        log.write(f"# launch ({procs.now_iso()}): {server.describe()}\n".encode())
        log.flush()
        return subprocess.Popen(server.argv, env={**os.environ, **server.env}, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_session_child(os.getpid()))


def _last_line(log: Path) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [x.strip() for x in f.read().decode(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return f" (its last line: {lines[-1][:200]})" if lines and not lines[-1].startswith("# launch") else ""


def healthy(url: str) -> bool:
    """GET url/health answers 200 (straight to the address: no proxy)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url + HEALTH, timeout=2) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):
        return False


def wait_healthy(proc: subprocess.Popen, server: Server, poll_s: float = 0.5) -> float:
    """Until the server's /health answers (seconds waited); ServerFailed when it exits first or stays silent past
    vllm_server_timeout; Interrupted when `launch` is signalled meanwhile."""
    def interrupt(sig, _frame):
        raise Interrupted(sig)

    handlers = {s: signal.signal(s, interrupt) for s in SIGNALS}
    started = time.monotonic()
    try:
        while True:
            code = proc.poll()
            if code is not None:
                raise ServerFailed(f"the vLLM server exited with status {code} before {server.url}{HEALTH} answered; its "
                                   f"log: {server.log}{_last_line(server.log)}")
            if healthy(server.url):
                return time.monotonic() - started
            if time.monotonic() - started > server.timeout:
                raise ServerFailed(f"the vLLM server did not answer {server.url}{HEALTH} within vllm_server_timeout "
                                   f"{server.timeout:g} s (raise it for a large model); its log: {server.log}"
                                   f"{_last_line(server.log)}")
            time.sleep(poll_s)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """The server and everything it started: SIGTERM to its process group, SIGKILL to what is left after grace_s (its
    descendants that left the group too), then reaped."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        family = []
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)
    for p in family:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.wait()
    psutil.wait_procs(family, timeout=5)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@contextmanager
def serving(server: Server | None) -> Iterator[None]:
    """The server started, healthy, for the block; stopped after it, however it ends (also when it never became
    healthy). Nothing without a server."""
    if server is None:
        yield
        return
    proc = start(server)
    try:
        waited = wait_healthy(proc, server)
        print(f"launch: the vLLM server answers at {server.url} (GPUs {','.join(server.gpus)}; {waited:.0f} s to start); "
              f"its log: {server.log}", flush=True, file=sys.stderr)
        yield
    finally:
        stop(proc)


def run_beside(argv: list[str], env: dict[str, str]) -> int:
    """A single-process run (backend none) beside the server: train.py as a child, not exec'd, so that `launch`
    outlives it to stop the server; in a session of its own, the signals `launch` gets passed on (train.py saves and
    exits 75 on SIGTERM/SIGUSR1 itself); its exit code."""
    asked: list[int] = []
    handlers = {s: signal.signal(s, lambda sig, _frame: asked.append(sig)) for s in SIGNALS}
    try:
        child = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_session_child(os.getpid()))
        handled = 0
        while True:
            try:
                return child.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
            for sig in asked[handled:]:
                handled += 1
                child.send_signal(sig)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
