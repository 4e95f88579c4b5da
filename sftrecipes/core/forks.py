"""The caller's side of the fork server (train/forkserver.py), torch-free. Start training processes as forks of one that has imported the training stack already: for the test suite and the
compatibility sweep, which start hundreds of short runs whose every rank would otherwise spend ~8 s (2 cores) importing
torch, transformers, TRL, peft, DeepSpeed and bitsandbytes before its first line of work.

    python -m sftrecipes.train.forkserver SOCKET  # the server: imports once, then forks one child per request
    SFTRECIPES_FORK_SERVER=SOCKET python train.py ...   # train.py hands itself to the server (run_in_fork)
    SFTRECIPES_FORK_SERVER=SOCKET python -m sftrecipes.core.forks SOCKET -m accelerate.commands.launch ...
                                                  # a launcher as a fork too; its ranks (train.py) are forks as well

Every launcher stays what it is (`python train.py`, accelerate's launcher, torch's elastic agent, `launch`): only the
process that train.py's interpreter would have become is a fork of the server instead. That process gets the caller's
argv, working directory, environment and its stdin/stdout/stderr (passed over the socket), starts its own session as
torch's agent starts a rank, and ends when its caller ends (SIGKILL included: it watches the connection). The caller
stays as a small stand-in: it passes on the signals a launcher sends (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2) and
ends the way the fork ended (its exit status, or the same signal). Values libraries read from the environment when
they are imported are the server's; the server is started with the environment the runs share.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys

ENV = "SFTRECIPES_FORK_SERVER"
FORK_PID_ENV = "SFTRECIPES_FORK_PID"  # set in each fork to its own pid: in_fork() (its children see another pid)
REAL_RANKS_ENV = "SFTRECIPES_REAL_RANKS"  # "1": a launch's ranks start as users start them while launch and accelerate's
#                                          launcher are forks (tests of a rank's memory, or its interpreter's start)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_HEADER = struct.Struct("!I")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return buf


def _send_msg(sock: socket.socket, msg: dict) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_msg(sock: socket.socket) -> dict:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return json.loads(_recv_exact(sock, n))


# ------------------------------------------------------------------------------------------------------ the caller


def in_fork() -> bool:
    """This process is a fork the server started (not a process its fork started in turn)."""
    return os.environ.get(FORK_PID_ENV) == str(os.getpid())


def exit_in_fork(argv: list[str], keep_env: bool = False) -> None:
    """Where ENV names a server (the test suite, the sweep) and this process is not that server's fork already: run
    `python ARGV` as a fork of it (run_in_fork) and exit as it ended. Returns where there is nothing to hand over, or no
    server answers: this process then runs ARGV itself."""
    path = os.environ.get(ENV)
    real_rank = "LOCAL_RANK" in os.environ and os.environ.get(REAL_RANKS_ENV) == "1"
    if path and not in_fork() and not real_rank:
        code = run_in_fork(path, argv, keep_env=keep_env)
        if code is not None:
            sys.exit(code)


def python_argv(argv: list[str]) -> list[str]:
    """The command line for a child `python ARGV` (`-m MODULE ...`): where ENV names a server (the test suite, the
    sweep), a small stand-in that has the server fork it instead, so that the child's imports of torch & co. are skipped
    (export's converter and its check in llama.cpp, a few seconds each); otherwise `python ARGV` as is."""
    path = os.environ.get(ENV)
    return [sys.executable, *(["-m", "sftrecipes.core.forks", path] if path else []), *argv]


def _request(sock: socket.socket, argv: list[str], env: dict, ignore: tuple = ()) -> int:
    """Ask the server on the connected `sock` for `python ARGV` in this folder with `env`, this process's
    stdin/stdout/stderr and the signals in `ignore` ignored; returns the fork's pid."""
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": env, "ignore": [int(s) for s in ignore]}).encode()
    socket.send_fds(sock, [_HEADER.pack(len(request))], [0, 1, 2])
    sock.sendall(request)
    return _recv_msg(sock)["pid"]


def run_in_fork(path: str, argv: list[str], keep_env: bool = False) -> int | None:
    """Have the server at `path` run `python ARGV` (a script, or `-m MODULE ...`) as this process would, and end as it
    ended. Returns its exit status (a fork killed by a signal: this process is killed by the same signal), or None when
    no server answers at `path` (the caller then runs it itself). keep_env:
    the fork's environment keeps SFTRECIPES_FORK_SERVER (a launcher whose ranks are to be forks too)."""
    env = {k: v for k, v in os.environ.items() if keep_env or k != ENV}
    if "LOCAL_RANK" in env:  # a rank: it ends with its launcher, as RunLife makes a rank do (then the fork ends too)
        from sftrecipes.core.procs import die_with_parent

        die_with_parent(os.getppid())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as e:  # no server there (any more): the caller runs the script itself
        print(f"fork server {path}: {e.strerror}; running in this process", file=sys.stderr)
        return None
    pid = _request(sock, argv, env)

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            rc = _recv_msg(sock)["rc"]
            break
        except InterruptedError:
            continue
    if rc < 0:  # killed by a signal: so is this process, so its launcher sees what it would have seen
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    return rc


class Forked:
    """`python ARGV` started by the server at `path` and held as subprocess.Popen holds a child (pid, poll, wait,
    send_signal, kill, returncode): for a caller that watches the process itself (`launch` watching torch's agent and
    its ranks, which are the fork's children). The fork runs in a session of its own, as with
    Popen(start_new_session=True), with this process's stdin/stdout/stderr and `env`; the signals in `ignore` are
    ignored in it; it is SIGKILLed when this process ends (it watches the connection, as a stand-in's fork does)."""

    def __init__(self, path: str, argv: list[str], env: dict, ignore: tuple = ()):
        self.args = argv
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self.pid = _request(self._sock, argv, env, ignore)
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            ready, _, _ = select.select([self._sock], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            try:
                self.returncode = _recv_msg(self._sock)["rc"]
            except (ConnectionError, OSError, ValueError):  # the server went away without a word: as a kill
                self.returncode = -signal.SIGKILL
            self._sock.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ------------------------------------------------------------------------------------------------------ the server


if __name__ == "__main__":  # python -m sftrecipes.core.forks SOCKET ARGV...: a launcher, as a fork of the server
    rc = run_in_fork(sys.argv[1], sys.argv[2:], keep_env=True)
    if rc is None:
        os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
    sys.exit(rc)
