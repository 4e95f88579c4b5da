"""A stand-in for TRL's `python -m trl.scripts.vllm_serve` (tests/launch/test_genserver.py): installed as
trl/scripts/vllm_serve.py in a folder of its own, beside an empty `vllm` package, that a wrapper `python` puts first on
the import path. It writes FAKE_SERVE_RECORD (JSON: its argv, CUDA_VISIBLE_DEVICES, its pid and the pid of a "worker"
child it starts, as vLLM starts its workers), then by FAKE_SERVE_MODE: `ok` serves GET /health with 200 (after
FAKE_SERVE_DELAY seconds) on --host/--port, `silent` never answers, `exit` prints a line and exits 3."""

import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main(argv: list[str]) -> int:
    opts = dict(zip(argv[::2], argv[1::2]))
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["FAKE_SERVE_RECORD"], "w") as f:
        json.dump({"argv": argv, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(),
                   "worker": worker.pid}, f)
    mode = os.environ.get("FAKE_SERVE_MODE", "ok")
    if mode == "exit":
        print("fake vllm_serve: cannot load the model", flush=True)
        return 3
    if mode == "silent":
        time.sleep(600)
        return 0
    time.sleep(float(os.environ.get("FAKE_SERVE_DELAY", "0")))

    class Health(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    ThreadingHTTPServer((opts["--host"], int(opts["--port"])), Health).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
