import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Tests live beside their stage (tests/<stage>/, as sftrecipes/<stage>/) and share helpers across stages
# (`from test_launch import sft`): every stage folder is importable, whichever file runs alone.
sys.path[1:1] = [str(d) for d in sorted(Path(__file__).resolve().parent.iterdir()) if d.is_dir() and any(d.glob("test_*.py"))]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite tests the CPU target: on a machine with a GPU, `hardware: auto` would otherwise resolve to gpu in this
# process and every run it starts. GPU-only checks are marked `gpu` and run only with SFT_GPU_TESTS=1, which leaves
# the GPU visible (bench/gpu_check.sh runs them).
GPU_TESTS = os.environ.get("SFT_GPU_TESTS") == "1"
if not GPU_TESTS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not GPU_TESTS:
            item.add_marker(pytest.mark.skip(reason="GPU-only (run with SFT_GPU_TESTS=1 on a machine with a CUDA GPU)"))
        elif GPU_TESTS and "gpu" not in item.keywords:
            item.add_marker(pytest.mark.skip(reason="SFT_GPU_TESTS=1 runs the GPU-marked tests only"))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny Llama in .assets/ (built once, by the same code `make assets` runs)."""
    from sftrecipes.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    """Recipes use paths relative to the repository root, as a user running `python train.py` from it does."""
    monkeypatch.chdir(ROOT)


# Training processes start as forks of one server that has imported torch, transformers, TRL, peft and DeepSpeed
# once (sftrecipes/core/forks.py): each rank of each run would otherwise spend ~8 s importing them, and `python -m
# sftrecipes launch` and torch's agent ~5 s each (both are forks too: sftrecipes/__main__.py, launch._start_agent). What a run computes, writes and logs is its own; what differs is the process: its parent, its libraries
# imported before it started. Tests about processes themselves (signals, kills, a frozen rank, SLURM) are marked
# `real_processes` and start every process as users do; tests about a rank's memory from its first byte, or its
# interpreter's start, are marked `real_ranks`: the ranks start as users start them, launch and its launcher are forks. The variable is
# set or cleared before each test's set-up, so the module and session fixtures made for it (shared runs) see the same.
FORK_SERVER_ENV = "SFTRECIPES_FORK_SERVER"
_fork_server: dict = {}


def _start_fork_server() -> str:
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="sftrecipes-forkserver-"))
    sock = str(tmp / "forkserver.sock")
    log = open(tmp / "forkserver.log", "w")  # noqa: SIM115 - open while the server lives
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop(FORK_SERVER_ENV, None)
    proc = subprocess.Popen([sys.executable, "-m", "sftrecipes.train.forkserver", sock], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
    line = proc.stdout.readline()  # {"ready": pid} once it has imported everything (~10 s)
    assert '"ready"' in line, f"the fork server did not start: {line!r}; see {tmp / 'forkserver.log'}"
    _fork_server.update(proc=proc, sock=sock, log=log, tmp=tmp)
    return sock


def fork_server_env() -> dict[str, str]:
    """The environment that makes a process started from a `real_processes` test a fork of the server after all: for
    the steps of such a test that are not about processes (a reference run, a resume whose weights are compared)."""
    return {FORK_SERVER_ENV: _fork_server.get("sock") or _start_fork_server()}


REAL_RANKS_ENV = "SFTRECIPES_REAL_RANKS"  # (core/forks.REAL_RANKS_ENV)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    os.environ.pop(REAL_RANKS_ENV, None)
    if item.get_closest_marker("real_processes") or os.environ.get("SFT_REAL_PROCESSES") == "1":
        os.environ.pop(FORK_SERVER_ENV, None)  # (SFT_REAL_PROCESSES=1: the whole suite as users start processes)
    else:
        os.environ.update(fork_server_env())
        if item.get_closest_marker("real_ranks"):  # the ranks as users start them; launch and its launcher forks
            os.environ[REAL_RANKS_ENV] = "1"


def pytest_terminal_summary(terminalreporter):
    """The machine the suite's times belong to, last (CI shows the tail of the output): cores, CPU capability (a CPU
    below AVX512 has no bf16 GEMM: sftrecipes/model/cpumath.py), SLURM present or not."""
    import platform
    import shutil

    import torch

    from sftrecipes.model import cpumath

    slurm = "slurm" if shutil.which("slurmctld") else "no slurm (its tests skipped)"
    terminalreporter.write_line(f"machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, torch CPU "
                                f"capability {torch.backends.cpu.get_cpu_capability()}, bf16 matmul {cpumath.choice()}, {slurm}")


def pytest_sessionfinish(session, exitstatus):
    proc = _fork_server.get("proc")
    if proc is not None:
        proc.stdin.close()  # the server ends when its stdin closes
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        import shutil

        shutil.rmtree(_fork_server["tmp"], ignore_errors=True)


def launcher_argv(argv: list[str]) -> list[str]:
    """`python ARGV` for a launcher (`-m accelerate.commands.launch ...`): as a fork of the fork server when the test
    uses it, so that the launcher's own import of torch is skipped too."""
    sock = os.environ.get(FORK_SERVER_ENV)
    return ["-m", "sftrecipes.core.forks", sock, *argv] if sock else list(argv)


def run_cli(args: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


class Zygote:
    """tests/zygote.py started once: run(argv, env) runs `python ARGV` from the repository root in a fork of a process
    that has imported torch, transformers and the training modules already, and returns what subprocess.run would
    (returncode, stdout, stderr). For many short processes whose errors come after torch loads."""

    def __init__(self, env: dict):
        self.env = env
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "zygote.py")], cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._read("ready", 300)

    def _read(self, key: str, timeout: float):
        import json
        import select

        deadline = time.time() + timeout
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.time()))
            if not ready:
                return None
            line = self.proc.stdout.readline()
            assert line, "tests/zygote.py ended"
            try:
                msg = json.loads(line)
            except ValueError:  # (a library's own print while importing)
                continue
            if isinstance(msg, dict) and key in msg:
                return msg[key]

    def run(self, argv: list[str], tmp: Path, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
        import json
        import signal

        out, err = tmp / "zygote.stdout", tmp / "zygote.stderr"
        self.proc.stdin.write(json.dumps({"argv": argv, "cwd": str(ROOT), "env": {**self.env, **(env or {})},
                                          "stdout": str(out), "stderr": str(err)}) + "\n")
        self.proc.stdin.flush()
        pid = self._read("pid", 30)
        rc = self._read("rc", timeout)
        if rc is None:
            os.kill(pid, signal.SIGKILL)
            self._read("rc", 30)
            raise AssertionError(f"{argv} ran over {timeout} s")
        res = subprocess.CompletedProcess(argv, rc, out.read_text(), err.read_text())
        out.unlink()
        err.unlink()
        return res

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(recipe: str, out, script: str, extra=(), accelerate_config=None):
    """Launch `script` on 2 processes as the twin launchers do (accelerate config + the recipe's env), on a free port."""
    import yaml

    from sftrecipes.launch.accelerate import accelerate_config as acc_cfg, launcher_env
    from sftrecipes.recipe.load import load_recipe

    args = [recipe, "--output_dir", str(out), *extra]
    r = load_recipe(args)
    if accelerate_config is None:
        accelerate_config = out.parent / (out.name + "-accelerate.yaml")
        accelerate_config.write_text(yaml.safe_dump(acc_cfg(r)))
    cmd = [sys.executable, *launcher_argv(["-m", "accelerate.commands.launch", "--config_file", str(accelerate_config),
           "--num_machines", "1", "--num_processes", "2", "--machine_rank", "0", "--main_process_ip", "127.0.0.1",
           "--main_process_port", str(free_port()), script, *args])]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **launcher_env(r)})
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    return res


def bindable(port: int) -> bool:
    """Whether `port` is free on this host now (a rendezvous binds every address)."""
    import socket

    with socket.socket() as s:
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def accelerate_command(argv: list[str], out: Path) -> tuple[list[str], dict]:
    """The command and environment scripts/run_*.sh would use, with an accelerate config rendered by `emit`'s code
    for this recipe + flags (launch keys of the flags included); plain train.py for a single-process recipe."""
    import sys

    import yaml

    from sftrecipes.launch.accelerate import accelerate_config, launcher_env
    from sftrecipes.recipe.load import load_recipe

    recipe = load_recipe(argv)
    if recipe.launch.backend == "none":
        return [sys.executable, "train.py", *argv, "--output_dir", str(out)], {}
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = out.parent / f"{out.name}.accelerate.yaml"
    cfg.write_text(yaml.safe_dump(accelerate_config(recipe)))
    world = recipe.launch.world_size
    return ([sys.executable, *launcher_argv(["-m", "accelerate.commands.launch", "--config_file", str(cfg), "--num_machines", "1",
             "--num_processes", str(world), "--machine_rank", "0", "--main_process_ip", "127.0.0.1",
             "--main_process_port", str(free_port()), "train.py", *argv, "--output_dir", str(out)])], launcher_env(recipe))


def accelerate_run(argv: list[str], out: Path, timeout: int = 600) -> dict:
    """Run a recipe + flags the way its launcher would (accelerate_command) and return its run summary. For tests
    that vary launch keys across runs."""
    import json

    cmd, env = accelerate_command(argv, out)
    res = run_cli(cmd[1:], timeout=timeout, env=env)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    return json.loads((out / "run_summary.json").read_text())


FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "qwen3_moe", "mixtral"]


@pytest.fixture(scope="session")
def family_models() -> dict[str, Path]:
    """Every tiny family model in .assets/tiny-<family> (built once): name -> folder."""
    from sftrecipes.tiny import FAMILIES as BUILT, ensure_family

    assert sorted(BUILT) == sorted(FAMILIES)
    return {name: ensure_family(name) for name in FAMILIES}


@pytest.fixture(scope="session")
def vision_models():
    """name -> .assets/tiny-<name>-vision (sftrecipes.model.tinyvision.VISION), each built on first use."""
    from sftrecipes.tiny import ensure_vision_family

    return ensure_vision_family


def launch_twin(name: str, out: Path, extra=(), env: dict | None = None, timeout: int = 900) -> tuple[dict, str]:
    """Run the CPU twin `name` through the launcher `emit` wrote for it (scripts/run_tiny-<name>.sh, 2 processes) with
    extra flags; (run summary, log)."""
    start = time.time()
    res = subprocess.run([f"scripts/run_tiny-{name}.sh", "--output_dir", str(out), *extra], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    log = res.stdout + res.stderr
    assert res.returncode == 0, f"{name} failed after {time.time() - start:.0f}s:\n{log[-4000:]}"
    return json.loads((out / "run_summary.json").read_text()), log


# The ddp twin prepares its data into a fresh datasets cache: its log shows which ranks tokenized.
TWIN_DATASETS_CACHE = {"ddp": "datasets-cache"}
# The ddp twin also scores itself after training (eval_tasks on 2 ranks: the main process, once both are done), on the
# local task tinymc limited to 8 questions: tests/use/test_lmeval.py compares the figures with lm_eval's own.
TWIN_EXTRA = {"ddp": ["--eval_tasks", "tinymc", "--eval_include_path", "tests/use/tasks", "--eval_limit", "8"]}


@pytest.fixture(scope="session")
def twin_runs(tiny_model, family_models, tmp_path_factory):
    """name -> (output_dir, run summary, log) of the CPU twin run once per session through its launcher, as shipped
    (the recipe's 6 steps, its sample reply) plus a checkpoint every 3 steps (checkpoint-3, checkpoint-6); launched on
    first use. Each is a 2-process run of ~15 s: test_twins checks the runs themselves, test_export and test_faults
    read their checkpoints instead of training the same twin again."""
    root = tmp_path_factory.mktemp("twins")
    done = {}

    def get(name: str) -> tuple[Path, dict, str]:
        if name not in done:
            out = root / name
            env = {"MAIN_PROCESS_PORT": str(free_port())}
            if name in TWIN_DATASETS_CACHE:
                env["HF_DATASETS_CACHE"] = str(root / TWIN_DATASETS_CACHE[name])
            summary, log = launch_twin(name, out, ["--save_strategy", "steps", "--save_steps", "3", *TWIN_EXTRA.get(name, ())], env=env)
            done[name] = out, summary, log
        return done[name]

    return get


# Models users build offline from transformers' config classes (issue 18): tiny, random-init (tiny_archs.tiny_config: any
# architecture's config class with its size keys set small), saved with the tiny Llama's tokenizer, so they load
# through the same code as hub checkpoints. Not tiny.FAMILIES: no tokenizer habits or templates of their own.


@pytest.fixture(scope="session")
def arch_models(tiny_model, tmp_path_factory):
    """(architecture, vision-config keys) -> a saved tiny random-init model of it with the tiny Llama's tokenizer,
    built on first use: arch_models("granite"), arch_models("gemma3", vision_use_head=False); pad: embedding rows
    past the tokenizer, as hub checkpoints pad their vocabularies (Qwen3: 151936 rows for 151669 tokens)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from sftrecipes.tiny_archs import tiny_config

    tok = AutoTokenizer.from_pretrained(tiny_model)
    root, built = tmp_path_factory.mktemp("archs"), {}

    def get(mt: str, pad: int = 0, **vision) -> Path:
        key = (mt, tuple(sorted(vision.items())) + ((("pad", pad),) if pad else ()))
        if key not in built:
            c = tiny_config(mt, vocab_size=len(tok) + pad, token_ids=(tok.bos_token_id, tok.eos_token_id, tok.pad_token_id),
                            vision=vision)
            out = root / "-".join([mt, *(f"{k}{v}" for k, v in key[1])])
            torch.manual_seed(0)
            cfg = AutoConfig.for_model(**c)
            model = AutoModelForCausalLM.from_config(cfg)
            saved = set(model.state_dict())
            for name, buffer in model.named_buffers():  # saved buffers (a router's bias, layer scalars) off their
                if name in saved and buffer.is_floating_point():  # constant init: a load that loses one shows
                    buffer.add_(0.01 * torch.randn_like(buffer))
            model.save_pretrained(out)
            if model.config.model_type != cfg.model_type:  # Mllama's CausalLM saves its text config, which no auto
                cfg.save_pretrained(out)                   # class maps: the hub's checkpoints carry the whole one
            tok.save_pretrained(out)
            built[key] = out
        return built[key]

    return get


@pytest.fixture(scope="session")
def gpt_oss_model(arch_models) -> Path:
    """GPT-OSS (GptOssConfig): attention sinks (a `sinks` parameter per layer), sliding-window layers, no sdpa path;
    4 experts."""
    return arch_models("gpt_oss")


@pytest.fixture(scope="session")
def gemma3_multimodal_model(arch_models) -> Path:
    """Gemma-3 as gemma-3-4b-it ships: Gemma3Config with a text_config and a SigLIP vision_config (no pooling head),
    which AutoModelForCausalLM loads as Gemma3ForConditionalGeneration (no flash attention; the SigLIP tower declares
    layer classes, its pooling head among them, that the model does not have)."""
    return arch_models("gemma3", vision_use_head=False)
