"""vLLM check (one GPU): a tiny LoRA run served by vLLM as the emitted serve scripts serve it -- the adapter on its
base (`--enable-lora --lora-modules`), then the merged export as a folder -- with the arguments
sftrecipes/launch/serve.py writes into scripts/serve_<name>.sh, and vLLM's greedy tokens for a few chat prompts
compared with transformers' greedy generate on the same weights (the adapter on its base through peft; the export).
Part of bench/gpu_check.sh; skipped, with the reason, where `vllm` is not on PATH or no CUDA GPU is visible.

    python bench/vllm_check.py [--run DIR] [--out DIR] [--budget-s 300] [--prompts 4] [--max-new-tokens 24]
    python bench/vllm_check.py --cpu-smoke --run DIR --out DIR   # the same code on CPU in fp32, against whatever
                                                                 # `vllm` is on PATH (tests/test_vllm_check.py: a stand-in)

--run: a trained LoRA run of recipes/tiny/lora.yaml (default: one trained here, 40 steps, into OUT/tiny-lora).
Writes OUT/vllm_check.json and prints one line per form: prompts whose tokens are identical, and tokens that agree
before the first difference. vLLM runs in 16 bits (--dtype bfloat16 after the script's own --dtype: the later flag
wins), as does the transformers reference.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECIPE = "recipes/tiny/lora.yaml"
NAME = "tiny-lora"
# what the check adds to the serve script's arguments: a port of its own, 16 bits, no CUDA graphs (start in seconds),
# a share of the GPU small enough for a tiny model
EXTRA = ["--host", "127.0.0.1", "--dtype", "bfloat16", "--enforce-eager", "--gpu-memory-utilization", "0.3",
         "--max-num-seqs", "8"]


def skip_reason(cpu: bool) -> str | None:
    if shutil.which("vllm") is None:
        return ("`vllm` is not on PATH (install it in an environment of its own: pip install 'vllm>=0.19.1'; put its "
                "bin/ on PATH)")
    import torch

    if not cpu and not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat_prompts(folder: Path, k: int) -> list[list[int]]:
    """The first user turn of the first k conversations of data/tiny_chat's test split, through the run's template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    rows = [json.loads(line) for line in (ROOT / "data/tiny_chat/test.jsonl").read_text().splitlines()[:k]]
    return [list(tok.apply_chat_template(r["messages"][:1], add_generation_prompt=True, tokenize=True, return_dict=False))
            for r in rows]


def stop_ids(tokenizer_folder: Path, config_folder: Path) -> list[int]:
    """What vLLM stops on: the served tokenizer's eos and the model folder's generation_config eos ids."""
    from transformers import AutoTokenizer, GenerationConfig

    ids = {AutoTokenizer.from_pretrained(tokenizer_folder).eos_token_id}
    try:
        eos = GenerationConfig.from_pretrained(config_folder).eos_token_id
    except OSError:
        eos = None
    ids |= set(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


def hf_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], n: int, stops: list[int],
              device: str) -> list[list[int]]:
    """transformers' greedy generate (bfloat16 on CUDA, float32 on CPU): the folder `base`, with `adapter` on it
    through peft."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, attn_implementation="sdpa")
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model = model.to(device).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                               eos_token_id=stops, pad_token_id=stops[0])
            out.append(y[0, len(ids):].tolist())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


class Server:
    """`vllm serve ARGS` in a session of its own, ready when /v1/models answers; stopped (TERM, then KILL) on exit."""

    def __init__(self, args: list[str], port: int, log: Path, deadline: float):
        self.port, self.log = port, log
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # vLLM's own environment, not the check's
        self.proc = subprocess.Popen(["vllm", "serve", *args, "--port", str(port)], cwd=ROOT, env=env,
                                     stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.proc.returncode} before it answered (log: {log})")
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"vllm serve did not answer within the budget (log: {log})")
            try:
                self.models = [m["id"] for m in self.get("/v1/models")["data"]]
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(2)

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False


def vllm_greedy(server: Server, model: str, prompts: list[list[int]], n: int) -> list[dict]:
    """Each prompt's completion at temperature 0: its token ids (vLLM's return_tokens_as_token_ids) and text."""
    out = []
    for ids in prompts:
        r = server.post("/v1/completions", {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0,
                                            "logprobs": 1, "return_tokens_as_token_ids": True})
        choice = r["choices"][0]
        tokens = (choice.get("logprobs") or {}).get("tokens") or []
        ids_out = [int(t.split(":", 1)[1]) for t in tokens if t.startswith("token_id:")]
        out.append({"ids": ids_out if len(ids_out) == len(tokens) and tokens else None, "text": choice["text"]})
    return out


def compare(ref: list[list[int]], got: list[dict], stops: list[int], decode) -> dict:
    """Prompts whose greedy tokens are identical (a trailing stop token left out on both sides) and tokens that agree
    before the first difference; by text where vLLM gave no token ids."""
    same, agree, total, rows = 0, 0, 0, []
    for r, g in zip(ref, got):
        r = r[:-1] if r and r[-1] in stops else r
        if g["ids"] is None:
            ok = decode(r) == g["text"]
            rows.append({"ref_text": decode(r), "vllm_text": g["text"], "identical": ok})
            same += ok
            continue
        v = g["ids"][:-1] if g["ids"] and g["ids"][-1] in stops else g["ids"]
        k = next((i for i, (a, b) in enumerate(zip(r, v)) if a != b), min(len(r), len(v)))
        rows.append({"ref": r, "vllm": v, "identical": r == v, "first_difference": None if r == v else k})
        same += r == v
        agree, total = agree + k, total + max(len(r), len(v))
    return {"prompts": len(ref), "identical": same, "tokens_agreeing": agree, "tokens": total, "rows": rows}


def train_run(out: Path) -> Path:
    run = out / NAME
    subprocess.run([sys.executable, "train.py", RECIPE, "--output_dir", str(run), "--max_steps", "40"], cwd=ROOT,
                   check=True)
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", help="a trained LoRA run of recipes/tiny/lora.yaml (default: train one)")
    p.add_argument("--out", default=str(ROOT / "bench/results/vllm-check"))
    p.add_argument("--budget-s", type=int, default=300, help="the most the two servers may take, starts included")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--cpu-smoke", action="store_true", help="transformers on CPU in fp32 (the `vllm` on PATH as it is)")
    a = p.parse_args(argv)
    why = skip_reason(a.cpu_smoke)
    if why:
        print(f"vllm check: skipped: {why}")
        return 0
    from transformers import AutoTokenizer

    from sftrecipes.launch.serve import export_args, lora_args, serve_plan
    from sftrecipes.recipe.load import load_recipe

    from sftrecipes.tiny import ensure_tiny_model

    ensure_tiny_model()  # the recipe's base, .assets/tiny-llama
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    run = Path(a.run).resolve() if a.run else train_run(out)
    export = out / f"{NAME}-export"
    subprocess.run([sys.executable, "-m", "sftrecipes", "export", str(run), str(export)], cwd=ROOT, check=True)
    plan = serve_plan(load_recipe([RECIPE, "--output_dir", str(run)]))
    base = (ROOT / plan.base).resolve()
    prompts = chat_prompts(run, a.prompts)
    tok = AutoTokenizer.from_pretrained(run)
    try:
        version = subprocess.run(["vllm", "--version"], capture_output=True, text=True, timeout=120).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        version = f"unknown ({type(e).__name__})"
    report = {"vllm": version, "run": str(run), "export": str(export), "forms": {}}
    deadline = time.time() + a.budget_s
    forms = [("lora", lora_args(plan, NAME, str(run)), NAME, base, run, run, base),
             ("export", export_args(plan, NAME, str(export)), NAME, export, None, export, export)]
    for form, args, model, ref_base, ref_adapter, tok_folder, cfg_folder in forms:
        stops = stop_ids(tok_folder, cfg_folder)
        ref = hf_greedy(ref_base, ref_adapter, prompts, a.max_new_tokens, stops, "cpu" if a.cpu_smoke else "cuda")
        port = free_port()
        try:
            with Server([*args, *EXTRA], port, out / f"vllm-{form}.log", deadline) as server:
                got = vllm_greedy(server, model, prompts, a.max_new_tokens)
                result = compare(ref, got, stops, lambda ids: tok.decode(ids, skip_special_tokens=True))
                result["served"] = server.models
        except (RuntimeError, urllib.error.URLError, OSError, KeyError, ValueError) as e:
            result = {"error": f"{type(e).__name__}: {e}"}
        result["argv"] = ["vllm", "serve", *args, *EXTRA]
        report["forms"][form] = result
        if "error" in result:
            print(f"vllm check ({form}): {result['error']}")
        else:
            print(f"vllm check ({form}): {result['identical']}/{result['prompts']} prompts give identical greedy tokens "
                  f"to transformers; {result['tokens_agreeing']}/{result['tokens']} tokens agree before the first "
                  f"difference (vLLM {version})")
    (out / "vllm_check.json").write_text(json.dumps(report, indent=1))
    print(f"vllm check: {out / 'vllm_check.json'}")
    return 0 if all("error" not in f for f in report["forms"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
