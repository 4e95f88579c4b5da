"""A process that imports once what a training process imports (torch, transformers, TRL, peft, datasets and the
project's training modules: ~8 s on this machine), then runs each command it is sent in a fork of itself, as
`python ARGV...` would run it from the repository root: the child changes to the command's folder, takes its
environment, writes its stdout/stderr to the files named, runs the script (or `-m module`) as __main__ and exits
with its exit status. For tests that start many short processes whose error surfaces only after torch loads
(tests/test_bad_inputs.py's heavy cases); what they check -- the exit status, the last stderr line, the files
written -- is the command's own. Protocol: one JSON request per stdin line ({"argv", "cwd", "env", "stdout",
"stderr"}), answered by {"pid": ...} when the child starts and {"rc": ...} when it ends."""

import json
import os
import runpy
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)

import datasets  # noqa: E402,F401 - what the children would import first thing
import peft  # noqa: E402,F401
import torch  # noqa: E402,F401
import transformers  # noqa: E402,F401
from trl import SFTTrainer  # noqa: E402,F401

import sftrecipes.export  # noqa: E402,F401
import sftrecipes.train.args  # noqa: E402,F401
import sftrecipes.run.checkpoints  # noqa: E402,F401
import sftrecipes.train.saving  # noqa: E402,F401
import sftrecipes.data.load  # noqa: E402,F401
import sftrecipes.train.finalsave  # noqa: E402,F401
import sftrecipes.train.hub  # noqa: E402,F401
import sftrecipes.model.lora  # noqa: E402,F401
import sftrecipes.train.metrics  # noqa: E402,F401
import sftrecipes.model.load  # noqa: E402,F401
import sftrecipes.model.fallbacks  # noqa: E402,F401
import sftrecipes.model.wrapping  # noqa: E402,F401
import sftrecipes.train.devices  # noqa: E402,F401
import sftrecipes.train.nonfinite  # noqa: E402,F401
import sftrecipes.train.precision  # noqa: E402,F401
import sftrecipes.launch.preflight  # noqa: E402,F401
import sftrecipes.train.probes  # noqa: E402,F401


def child(req: dict) -> int:
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    argv = req["argv"]
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
        traceback.print_exc()
        return 1


def main() -> None:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = child(req)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
