"""The model a recipe describes: loaded (dtype, 4-bit, attention kernel), built on the meta device, LoRA, upstream shims."""
