"""What torch sees of this machine: the hardware target `launch.hardware: auto` resolves to in a rank, and the GPUs
visible here, which launch's pre-flight asks in a child process (`python -m sftrecipes.train.devices`) so that the
launcher itself never imports torch."""

from __future__ import annotations

import torch

from sftrecipes.recipe.typed import Recipe


def hardware(recipe: Recipe) -> str:
    """'cpu' or 'gpu': the recipe's launch.hardware; `auto` asks torch whether CUDA is available."""
    if recipe.launch.hardware != "auto":
        return recipe.launch.hardware
    return "gpu" if torch.cuda.is_available() else "cpu"


def gpu_count() -> int:
    """The GPUs torch can use in this process (CUDA_VISIBLE_DEVICES applied), 0 where CUDA is not available."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


if __name__ == "__main__":  # launch/preflight.py's question, answered on stdout
    print(gpu_count())
