"""Baseline for `make bench-grpo`: recipes/tiny/grpo.yaml's training settings in a bare TRL script (GRPOConfig,
GRPOTrainer, peft's LoraConfig; nothing of sftrecipes). The reward function is the recipe folder's own
(recipes/tiny/rewards.py), imported as a user's script would; the one line a chatml model needs besides: the end of
turn as eos, so generation stops where train.py's does.

    python bench/bare_grpo.py OUTPUT_DIR [--reward answer_letters|brevity] [--max_steps 40] [--model .assets/tiny-llama]"""
import argparse
import sys
from pathlib import Path

from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

p = argparse.ArgumentParser()
p.add_argument("output_dir")
p.add_argument("--reward", default="answer_letters", choices=("answer_letters", "brevity"))
p.add_argument("--max_steps", type=int, default=40)
p.add_argument("--model", default=".assets/tiny-llama")
a = p.parse_args()

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes" / "tiny"))
import rewards  # noqa: E402 - recipes/tiny/rewards.py, the user's file

args = GRPOConfig(output_dir=a.output_dir, num_generations=4, max_completion_length=12, temperature=1.0,
                  learning_rate=5e-2, per_device_train_batch_size=16, lr_scheduler_type="constant", max_steps=a.max_steps,
                  logging_steps=5, seed=42, save_strategy="no", report_to="none", use_cpu=True,
                  bf16=False, gradient_checkpointing=False)  # TRL's defaults: checkpointing on (bf16 on with a GPU)
lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
tokenizer = AutoTokenizer.from_pretrained(a.model)
tokenizer.eos_token = "<|im_end|>"  # the chatml end of turn: a completion ends there
model = AutoModelForCausalLM.from_pretrained(a.model, attn_implementation="sdpa")
GRPOTrainer(model=model, args=args, reward_funcs=getattr(rewards, a.reward), peft_config=lora, processing_class=tokenizer,
            train_dataset=load_dataset("json", data_files="data/tiny_grpo/train.jsonl", split="train")).train()
