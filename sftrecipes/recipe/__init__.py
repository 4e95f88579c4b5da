"""The recipe, torch-free: its options (schema, TRL's and peft's snapshots), coercion, validation, loading, copying."""
