"""Starting a recipe's processes, torch-free: the accelerate config, pre-flight, the supervisor, the emitted files."""
