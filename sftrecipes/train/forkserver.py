"""The fork server (core/forks.py is its caller's side): a process that imports the training stack once, then forks one
child per request, which becomes the requested `python ARGV` (its argv, folder, environment, stdin/stdout/stderr).

    python -m sftrecipes.train.forkserver SOCKET     # serve until stdin closes
"""

from __future__ import annotations

import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import threading
import traceback

from sftrecipes.core.forks import _HEADER, FORK_PID_ENV, FORWARDED, _recv_exact, _send_msg


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
    # what a rank imports first thing
    import accelerate  # noqa: F401
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from trl import SFTTrainer  # noqa: F401

    try:
        import deepspeed  # noqa: F401
    except ImportError:
        pass
    import sftrecipes.data.load  # noqa: F401
    import sftrecipes.export  # noqa: F401
    import sftrecipes.model.fallbacks  # noqa: F401
    import sftrecipes.model.load  # noqa: F401
    import sftrecipes.model.lora  # noqa: F401
    import sftrecipes.model.quantload  # noqa: F401
    import sftrecipes.model.wrapping  # noqa: F401
    import sftrecipes.plan  # noqa: F401 - the bulk of launch.preflight (train.py imports it; a stage above this one)
    import sftrecipes.run.checkpoints  # noqa: F401
    import sftrecipes.train.args  # noqa: F401
    import sftrecipes.train.devices  # noqa: F401
    import sftrecipes.train.finalsave  # noqa: F401
    import sftrecipes.train.hub  # noqa: F401
    import sftrecipes.train.metrics  # noqa: F401
    import sftrecipes.train.nonfinite  # noqa: F401
    import sftrecipes.train.precision  # noqa: F401
    import sftrecipes.train.probes  # noqa: F401
    import sftrecipes.train.saving  # noqa: F401
    from sftrecipes.model import cpumath

    if cpumath.choice() == "fp32":  # the mode's first push imports torch._dynamo (~3 s a rank)
        import torch._dynamo  # noqa: F401

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
    serve(sys.argv[1])
