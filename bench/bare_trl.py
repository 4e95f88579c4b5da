"""Baseline for `make bench`: recipes/tiny/{lora,full}.yaml's training settings in a bare TRL script (TRL's own chat
formatting; of sftrecipes only its packed-attention kernel when `--attn_implementation sft_varlen` asks for it, as
train.py's auto does for packed batches), each grid setting a flag (the same names as train.py's keys). With
`--method dpo`: recipes/tiny/dpo.yaml's settings (data/tiny_dpo, beta 0.1) in TRL's DPOTrainer.

    python bench/bare_trl.py OUTPUT_DIR [--packing true] [--max_steps 80] [--per_device_train_batch_size 8]
        [--gradient_checkpointing false] [--use_peft_lora true] [--learning_rate 1e-2] [--attn_implementation sdpa]
        [--method sft|dpo]"""
import argparse
import sys
from pathlib import Path

from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

flag = lambda s: s.lower() == "true"  # noqa: E731
p = argparse.ArgumentParser()
p.add_argument("output_dir")
p.add_argument("--packing", type=flag, default=True)
p.add_argument("--max_steps", type=int, default=80)
p.add_argument("--per_device_train_batch_size", type=int, default=8)
p.add_argument("--gradient_checkpointing", type=flag, default=False)
p.add_argument("--use_peft_lora", type=flag, default=True)
p.add_argument("--learning_rate", type=float, default=1e-2)
p.add_argument("--attn_implementation", default="sdpa")
p.add_argument("--model", default=".assets/tiny-llama")
p.add_argument("--method", default="sft", choices=("sft", "dpo"))
a = p.parse_args()

common = dict(output_dir=a.output_dir, max_length=256, learning_rate=a.learning_rate,
              per_device_train_batch_size=a.per_device_train_batch_size, lr_scheduler_type="constant",
              max_steps=a.max_steps, logging_steps=5, seed=42, save_strategy="no", report_to="none", use_cpu=True,
              bf16=False, gradient_checkpointing=a.gradient_checkpointing)  # TRL's defaults: both on
args = SFTConfig(packing=a.packing, **common) if a.method == "sft" else DPOConfig(beta=0.1, **common)
lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
if a.attn_implementation == "sft_varlen":  # the project's packed-attention kernel (what train.py's auto picks packed)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from sftrecipes.model.attention import register

    register()
model = AutoModelForCausalLM.from_pretrained(a.model, attn_implementation=a.attn_implementation)
Trainer, data = (SFTTrainer, "data/tiny_chat") if a.method == "sft" else (DPOTrainer, "data/tiny_dpo")
Trainer(model=model, args=args, peft_config=lora if a.use_peft_lora else None,
        train_dataset=load_dataset("json", data_files=f"{data}/train.jsonl", split="train"),
        processing_class=AutoTokenizer.from_pretrained(a.model)).train()
