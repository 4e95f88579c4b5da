"""`make demo`: a tiny LoRA fine-tune on CPU, end to end, through the same entry points a user runs.

build tiny assets -> python train.py recipes/tiny/lora.yaml -> streaming merge of the adapter ->
plain AutoModelForCausalLM.from_pretrained on the merged folder -> generate a reply -> summary.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from transformers import AutoModelForCausalLM, AutoTokenizer

from sftrecipes.core.paths import ROOT
from sftrecipes.export import merge_lora
from sftrecipes.tiny import ensure_tiny_model

RECIPE = "recipes/tiny/lora.yaml"
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def demo() -> int:
    start = time.time()
    ensure_tiny_model()
    out = ROOT / "outputs" / "tiny-lora"
    merged = ROOT / "outputs" / "tiny-lora-merged"
    rc = subprocess.call([sys.executable, str(ROOT / "train.py"), RECIPE, "--output_dir", str(out)], cwd=ROOT)
    if rc != 0:
        print(f"demo: training failed (exit {rc})", file=sys.stderr)
        return rc
    summary = json.loads((out / "run_summary.json").read_text())

    merge_lora(out, merged)
    tok = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged)
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    gen = model.generate(**ids, max_new_tokens=24, do_sample=False)
    reply = tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)

    fell = summary["last_loss"] < summary["first_loss"]
    print("\n=== demo summary ===")
    print(f"recipe        {RECIPE}")
    print(f"steps         {summary['steps']} in {summary['seconds']:.1f}s of training ({time.time() - start:.0f}s in all)")
    print(f"loss          {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} ({'fell' if fell else 'DID NOT FALL'})")
    t = summary["throughput"]
    mfu = "n/a on CPU (no peak given)" if t["mfu"] is None else f"{t['mfu']:.2f}"
    print(f"throughput    {t['tokens_per_s_per_device']:.0f} real tokens/s/device, {t['step_time_s'] * 1e3:.0f} ms/step, "
          f"real-token share {t['real_token_share']:.2f}, MFU {mfu}")
    print(f"precision     {', '.join(f'{k}: {v}' for k, v in summary['precision'].items())}")
    print(f"metrics       {out / 'metrics.png'}, TensorBoard: tensorboard --logdir {out / 'runs'}")
    print(f"adapter       {out}  ({summary['saved_tensors']} tensors)")
    print(f"merged model  {merged}  (loaded with AutoModelForCausalLM.from_pretrained)")
    print(f"prompt        {PROMPT[0]['content']}")
    print(f"reply         {reply!r}")
    return 0 if fell else 1
