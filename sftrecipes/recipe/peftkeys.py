"""Which of peft's LoraConfig fields are not recipe keys (each with the reason), and what the project adds to the help
of those that are; schema.py builds the option table from them."""

from __future__ import annotations

# peft's LoraConfig fields that are not recipe keys, and why. Every other field is a recipe key of the same name
# (owner "peft"; it needs use_peft_lora and goes to LoraConfig as given). tests/recipe/test_schema_and_assets.py fails when
# a field of the installed peft is in neither group, so a field peft adds is placed on purpose.
PEFT_NOT_EXPOSED: dict[str, str] = {
    # the project's own keys, spelled as the PEFT SFT guide's flags
    "r": "the project's key lora_r",
    "lora_alpha": "the project's key lora_alpha",
    "lora_dropout": "the project's key lora_dropout",
    "target_modules": "the project's key lora_target_modules (expert parameters and the router: lora_target_router)",
    # set by the project or by peft itself
    "task_type": "set by the project (CAUSAL_LM)",
    "peft_type": "LoraConfig's own (LORA)",
    "auto_mapping": "peft's bookkeeping for custom model classes",
    "peft_version": "written by peft when it saves the adapter",
    "base_model_name_or_path": "written by peft from the model loaded (model_name_or_path)",
    "revision": "the base model's revision is part of model_name_or_path's loading, not of the adapter",
    "inference_mode": "a training run needs it off; peft turns it on in the saved config",
    "trainable_token_indices": "set by the project for the tokens a chat template adds (chat_template_format)",
    "runtime_config": "run-time only (ephemeral GPU offload when loading), never saved",
    "megatron_config": "Megatron-LM tensor-parallel layers; the project trains transformers models",
    "megatron_core": "Megatron-LM tensor-parallel layers; the project trains transformers models",
    # adapters the streaming merge, or the models trained here, cannot take
    "fan_in_fan_out": "GPT-2 style Conv1D weights; the models here use nn.Linear, where peft turns it off",
    "lora_bias": "adds a bias to layers that have none in Llama-class models: the merged model would not load as the "
                 "base architecture (and peft's expert-parameter wrapper refuses it)",
    "layer_replication": "duplicates decoder layers: the merged model would have more layers than its config",
    "use_qalora": "QALoRA is for GPTQ-quantized bases; the project quantizes with bitsandbytes",
    "qalora_group_size": "QALoRA is for GPTQ-quantized bases; the project quantizes with bitsandbytes",
    "alora_invocation_tokens": "activated LoRA acts only after its invocation tokens, so it cannot be merged into weights",
    "arrow_config": "Arrow routes among several adapters per token: nothing to merge",
    "kasa_config": "KaSA truncates the base weights when the adapter is created; the merge reads the original base",
    "use_bdlora": "block-diagonal LoRA factors for multi-adapter serving; the streaming merge reads plain factors",
    "monteclora_config": "Monte Carlo sampling around the adapter; the streaming merge reads plain factors",
    "velora_config": "a memory-saving backward pass configured by an object; not settable from a recipe",
    "ensure_weight_tying": "ties adapters on tied embeddings; the project trains added-token rows through "
                           "trainable_token_indices and never targets the tied embeddings",
    "loftq_config": "configures init_lora_weights: loftq, which rewrites the base weights (refused)",
    "eva_config": "configures init_lora_weights: eva, which needs a pass over the data before training (refused)",
    "corda_config": "configures init_lora_weights: corda, which rewrites the base weights from calibration data (refused)",
    "lora_ga_config": "configures init_lora_weights: lora_ga, which needs gradients before training (refused)",
}


# What the project adds to peft's help of an exposed field (shown in --help and docs/generated/options.md).
PEFT_NOTES: dict[str, str] = {
    "init_lora_weights": "sftrecipes: true, false, gaussian and orthogonal train and export; eva, olora, pissa*, corda, "
                         "loftq and mica are refused when the recipe is read (they need data before training, rewrite the "
                         "base weights, or leave lora_B out of the adapter).",
    "exclude_modules": "sftrecipes: a YAML list (or several words after the flag) is names; one string is a regex that "
                       "must match the whole module name. Also excludes expert parameters.",
    "layers_to_transform": "sftrecipes: also selects among the expert parameters of mixture-of-experts models.",
    "target_parameters": "sftrecipes: mixture-of-experts expert tensors need no entry: lora_target_modules (all-linear, "
                         "gate_up_proj, down_proj, ...) and lora_target_router adapt them. No lora_dropout, no DoRA here.",
    "use_dora": "sftrecipes: merged by the streaming export; not with expert parameters or target_parameters.",
}
