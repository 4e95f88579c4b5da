"""Pre-flight: everything checked about a recipe before its processes start (its weights whole, the memory plan's
verdict, the GPUs it names) and again inside each rank before anything loads (its process count, the launcher's
accelerate config, what the hardware target cannot run).

Torch-free, even where it counts GPUs: `gpu_count` asks torch in a child process (train/devices.py), so launch, emit and
plan, which import this module, never load it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess

from sftrecipes.core import forks
from sftrecipes.core.errors import RecipeError
from sftrecipes.core.paths import ROOT
from sftrecipes.facts.folders import check_weights
from sftrecipes.launch.accelerate import accelerate_config
from sftrecipes.plan import verdict
from sftrecipes.recipe.target import render_target
from sftrecipes.recipe.online import check_vllm
from sftrecipes.recipe.typed import Recipe

# An accelerate config key -> the recipe key that renders it (accelerate.accelerate_config), where the recipe has one;
# the rest are the project's fixed choices. accelerate's launcher exports each as an environment variable
# (accelerate/utils/launch.py): FSDP_<KEY> for fsdp_config keys, ACCELERATE_DEEPSPEED_<KEY> for deepspeed_config keys.
RECIPE_KEY = {
    "zero_stage": "launch.zero_stage", "zero3_save_16bit_model": "launch.zero_stage",
    "offload_optimizer_device": "launch.offload_optimizer", "offload_param_device": "launch.offload_params",
    "zero3_init_flag": "launch.zero3_init", "gradient_clipping": "max_grad_norm",
    "fsdp_reshard_after_forward": "launch.fsdp_sharding_strategy",
}
DEEPSPEED_ENV = {"zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT", "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING"}
FSDP_ENV = {"fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP"}  # (not FSDP_<KEY> for this one)
NOT_EXPORTED = {"deepspeed_multinode_launcher"}  # read by the launcher itself, not by the ranks


def gpu_count() -> int:
    """The GPUs torch sees here (train/devices.gpu_count), asked of a child process so that this one stays torch-free."""
    res = subprocess.run(forks.python_argv(["-m", "sftrecipes.train.devices"]), cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0 or not res.stdout.split():
        said = (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1]
        raise RecipeError(f"launch: torch could not count this machine's GPUs ({said}); install the training stack "
                          "(pip install -r requirements.txt)")
    return int(res.stdout.split()[-1])


def before_launch(recipe: Recipe, force: bool = False) -> str:
    """Can this recipe start on this machine? First its weights (a local folder's safetensors files whole: the check
    every rank would make, made once before any starts), then the memory plan (does it fit the GPUs it names?), then
    the hardware (are those GPUs here?). Returns the text to print; a RecipeError (exit 2) says why not; --force skips
    the memory verdict (also a plan that cannot be made), never the weights or the hardware. (The tokenizer files are
    the ranks' check, folders.check_model_files: a folder holding only config.json still plans.)"""
    L = recipe.launch
    world = L.world_size
    check_weights(recipe.model.model_name_or_path)
    try:
        fits, plan_text = verdict(recipe)
    except RecipeError as e:  # the planner cannot plan this model: --force goes on, and loading will tell
        if not force:
            raise
        fits, plan_text = True, f"preflight: no memory plan ({e}); launching anyway (--force)"
    lines = [plan_text, "", f"preflight: {L.backend} on {L.num_machines} node(s) x {L.gpus_per_node} process(es), hardware {L.hardware}"]
    if not fits:
        if not force:
            print("\n".join(lines))
            raise RecipeError("preflight: the memory plan above says this recipe does not fit; pick a strategy from the table, or pass --force to launch anyway")
        lines.append("preflight: the plan says it does not fit; launching anyway (--force)")
    if render_target(recipe) == "gpu" and (world > 1 or L.backend != "none" or L.hardware == "gpu"):
        have = gpu_count()
        if have < L.gpus_per_node + L.vllm_server_gpus:
            mem = f" of {L.gpu_memory_gb:g} GB" if L.gpu_memory_gb else ""
            server = f" + {L.vllm_server_gpus} for its vLLM server (launch.vllm_server_gpus)" if L.vllm_server_gpus else ""
            raise RecipeError(
                f"launch: this recipe needs {L.gpus_per_node} GPU(s){mem} per node ({L.backend}, {world} processes in all)"
                f"{server} but this machine has {have}; run it on a GPU node (its CPU twin under recipes/tiny/ runs here)"
            )
        lines.append(f"preflight: {have} GPU(s) visible")
    return "\n".join(lines)


def in_run(recipe: Recipe, target: str) -> int:
    """Every rank, before anything is loaded or written: the process count, the launcher's config and the hardware
    target must be the recipe's. Returns the world size."""
    world = check_world_size(recipe)
    check_launcher_matches(recipe)
    check_liger(recipe, target)
    check_vllm(recipe, target)  # grpo/rloo use_vllm: a GPU and vLLM here
    return world


def check_world_size(recipe: Recipe) -> int:
    """The processes this run really has must be the ones the recipe's launch section describes."""
    want = recipe.launch.world_size
    have = int(os.environ.get("WORLD_SIZE", "1"))
    if have != want:
        raise RecipeError(
            f"launch: the recipe describes {want} processes (num_machines {recipe.launch.num_machines} x gpus_per_node "
            f"{recipe.launch.gpus_per_node}) but this run has {have}; start it with its launcher: python -m sftrecipes "
            f"launch {recipe.sources[-1] if recipe.sources else 'RECIPE.yaml'} [--key value ...] (or set --launch.gpus_per_node)"
        )
    return have


def check_launcher_matches(recipe: Recipe) -> None:
    """The accelerate launcher exports what its config file says (ACCELERATE_USE_DEEPSPEED, FSDP_STATE_DICT_TYPE,
    ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE, ...). A recipe whose launch keys were changed on the command line,
    or a config from another recipe (`accelerate launch --config_file X train.py RECIPE`), would otherwise run and
    save silently as the launcher's config says, not the recipe's: every key of the recipe's own accelerate config
    that the launcher exported must agree. (mixed_precision is left out: the training arguments' bf16/fp16 decide it.
    The layer classes FSDP wraps, when the recipe leaves them to the model, are derived and compared in the rank by
    model/wrapping.fsdp_wrap_classes, which needs the model's classes.)"""
    env = os.environ
    if int(env.get("WORLD_SIZE", "1")) == 1 and not any(k.startswith("ACCELERATE_USE_") for k in env):
        return  # not started by accelerate: nothing to compare
    L = recipe.launch
    ran = "deepspeed" if env.get("ACCELERATE_USE_DEEPSPEED") == "true" else "fsdp" if env.get("ACCELERATE_USE_FSDP") == "true" else None
    wants = L.backend if L.backend in ("deepspeed", "fsdp") else None
    fix = "start it with python -m sftrecipes launch RECIPE, which renders the launcher's config from the recipe"
    if ran != wants:
        raise RecipeError(f"launch.backend: the recipe says {L.backend} but the launcher's accelerate config runs "
                          f"{ran or 'neither DeepSpeed nor FSDP'}; {fix}")
    if ran is None:
        return
    section = accelerate_config(recipe)["deepspeed_config" if ran == "deepspeed" else "fsdp_config"]
    for key, want in section.items():
        if key in NOT_EXPORTED:
            continue
        name = (FSDP_ENV.get(key, f"FSDP_{key.removeprefix('fsdp_').upper()}") if ran == "fsdp"
                else DEEPSPEED_ENV.get(key, f"ACCELERATE_DEEPSPEED_{key.upper()}"))
        have = env.get(name)
        if have is not None and not _same(want, have):
            named = RECIPE_KEY.get(key, f"launch.{key}" if hasattr(L, key) else None)
            where = f"{named}: the recipe renders {key}: {want}" if named else f"{key}: the project renders {want}"
            raise RecipeError(f"{where} but the launcher's accelerate config says {have} ({name}); {fix}")


def _same(want, have: str) -> bool:
    """A rendered config value and the string accelerate's launcher exported for it (booleans and devices
    lower-cased, numbers as written)."""
    if isinstance(want, bool) or not isinstance(want, (int, float)):
        return str(want).lower() == have.lower()
    try:
        return float(want) == float(have)
    except ValueError:
        return False


def liger_installed() -> bool:
    """The liger-kernel package (requirements-gpu.txt) is importable here; it brings Triton kernels, GPU-only."""
    return importlib.util.find_spec("liger_kernel") is not None


def check_liger(recipe: Recipe, target: str) -> None:
    """use_liger_kernel needs a GPU and the liger-kernel package: refused in one line before any model is loaded
    (transformers would fail at trainer construction, after the model load, with an ImportError or a Triton error)."""
    if not recipe.trl_value("use_liger_kernel"):
        return
    if target == "cpu":
        raise RecipeError("use_liger_kernel: Liger's kernels are Triton GPU kernels and this run's hardware target is cpu; "
                          "set use_liger_kernel: false (or run on a GPU with launch.hardware: gpu)")
    if not liger_installed():
        raise RecipeError("use_liger_kernel: the liger-kernel package is not installed; pip install -r requirements-gpu.txt "
                          "(or set use_liger_kernel: false)")


