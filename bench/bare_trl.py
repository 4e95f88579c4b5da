"""Baseline for `make bench`: recipes/tiny/lora.yaml's training settings in a bare TRL script (TRL's own chat
formatting, no sftrecipes). python bench/bare_trl.py OUTPUT_DIR [PACKING true|false] [MAX_STEPS]"""
import sys

from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

out, packing, steps = sys.argv[1], (sys.argv[2:3] or ["true"])[0] == "true", int((sys.argv[3:4] or [80])[0])
args = SFTConfig(output_dir=out, max_length=256, packing=packing, per_device_train_batch_size=8, learning_rate=1e-2,
                 lr_scheduler_type="constant", max_steps=steps, logging_steps=5, seed=42, save_strategy="no",
                 report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False)  # TRL defaults both on
lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
SFTTrainer(model=AutoModelForCausalLM.from_pretrained(".assets/tiny-llama"), args=args, peft_config=lora,
           train_dataset=load_dataset("json", data_files="data/tiny_chat/train.jsonl", split="train"),
           processing_class=AutoTokenizer.from_pretrained(".assets/tiny-llama")).train()
