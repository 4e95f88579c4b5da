"""Start training processes as forks of one that has imported the training stack already: for the test suite and the
compatibility sweep, which start hundreds of short runs whose every rank would otherwise spend ~8 s (2 cores) importing
torch, transformers, TRL, peft, DeepSpeed and bitsandbytes before its first line of work.

    python -m sftrecipes.forkserver SOCKET        # the server: imports once, then forks one child per request
    SFTRECIPES_FORK_SERVER=SOCKET python train.py ...   # train.py hands itself to the server (run_in_fork)
    SFTRECIPES_FORK_SERVER=SOCKET python -m sftrecipes.forkserver --run SOCKET -m accelerate.commands.launch ...
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
import runpy
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback

ENV = "SFTRECIPES_FORK_SERVER"
FORK_PID_ENV = "SFTRECIPES_FORK_PID"  # set in each fork to its own pid: in_fork() (its children see another pid)
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
    if path and not in_fork():
        code = run_in_fork(path, argv, keep_env=keep_env)
        if code is not None:
            sys.exit(code)


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
        from .procs import die_with_parent  # noqa: PLC0415 - ctypes: only ranks need it

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


def _child(conn: socket.socket, fds: list[int], req: dict, others: list[socket.socket]) -> None:
    """In the fork: become the requested process, run it, never return."""
    code = 1
    try:
        for s in others:
            s.close()
        os.setsid()
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in FORWARDED + (signal.SIGCHLD,):
            signal.signal(sig, signal.SIG_DFL)
        for sig in req.get("ignore", ()):
            signal.signal(sig, signal.SIG_IGN)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ[FORK_PID_ENV] = str(os.getpid())

        def watch() -> None:  # the caller gone (killed, whatever killed it): so is this process
            try:
                while conn.recv(64):
                    pass
            except OSError:
                pass
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="forkserver-caller", daemon=True).start()
        argv = req["argv"]
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                sys.path[0] = os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str) -> None:
    """Import the training stack, then answer requests on the unix socket `path` until stdin closes."""
    # what a rank imports first thing (here, not at the top: train.py's side of this module stays torch-free)
    import accelerate  # noqa: F401, PLC0415
    import datasets  # noqa: F401, PLC0415
    import peft  # noqa: F401, PLC0415
    import torch  # noqa: F401, PLC0415
    import transformers  # noqa: F401, PLC0415
    from trl import SFTTrainer  # noqa: F401, PLC0415

    try:
        import deepspeed  # noqa: F401, PLC0415
    except ImportError:
        pass
    from sftrecipes import (  # noqa: F401, PLC0415
        backends, checkpoints, cpumath, data, export, finalsave, hub, lora, metrics, model, nonfinite, precision,
        preflight, probes, quantload,
    )

    if cpumath.choice() == "fp32":  # the mode's first push imports torch._dynamo (~3 s a rank)
        import torch._dynamo  # noqa: F401, PLC0415

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)  # the owner closes stdin (or dies): the server ends
    children: dict[int, socket.socket] = {}
    print(json.dumps({"ready": os.getpid()}), flush=True)
    while True:
        for key, _ in sel.select(timeout=0.1):
            if key.fileobj is sys.stdin:
                if not sys.stdin.readline():
                    listener.close()
                    os.unlink(path)
                    return
                continue
            conn, _ = listener.accept()
            try:
                head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
                req = json.loads(_recv_exact(conn, _HEADER.unpack(head)[0]))
            except (OSError, ValueError, struct.error):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                _child(conn, fds, req, [listener, *children.values()])
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            try:
                _send_msg(conn, {"pid": pid})
            except OSError:
                pass
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                try:
                    _send_msg(conn, {"rc": rc})
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run"]:  # python -m sftrecipes.forkserver --run SOCKET ARGV...: a launcher, as a fork
        rc = run_in_fork(sys.argv[2], sys.argv[3:], keep_env=True)
        if rc is None:
            os.execv(sys.executable, [sys.executable, *sys.argv[3:]])
        sys.exit(rc)
    serve(sys.argv[1])
