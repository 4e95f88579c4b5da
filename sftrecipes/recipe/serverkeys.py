"""The vLLM server `launch` starts for a grpo/rloo run in vllm_mode server, as recipe keys (`ServerOptions`, a base of
schema.LaunchOptions: its GPUs, its environment's python) and their rules before torch loads (`check_server`), with
the tensor- and data-parallel sizes it serves with (`server_parallel`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sftrecipes.core.errors import RecipeError
from sftrecipes.facts.config import config_path, model_shape
from sftrecipes.recipe.lorarules import moe_experts

if TYPE_CHECKING:
    from sftrecipes.recipe.typed import Recipe

DEFAULT_PYTHON = ".venv-vllm/bin/python"  # where `make vllm-env` puts the server's environment (requirements-vllm.txt)
KEYS = ("launch.vllm_server_gpus", "launch.vllm_server_python")


def _opt(default, help_: str):
    return field(default=default, metadata={"help": help_})


@dataclass
class ServerOptions:
    """The launch keys of the vLLM server a grpo/rloo run generates with (a base of schema.LaunchOptions)."""

    vllm_server_gpus: int = _opt(
        0, "grpo/rloo with use_vllm: true and vllm_mode: server: GPUs of machine 0 that `launch` gives a vLLM server "
        "(TRL's trl.scripts.vllm_serve, run with launch.vllm_server_python) before the ranks start: the ranks take the "
        "first gpus_per_node GPUs (CUDA_VISIBLE_DEVICES, or the first of those it lists), the server the next "
        "vllm_server_gpus, so the node needs gpus_per_node + vllm_server_gpus. Its tensor-parallel size is "
        "vllm_tensor_parallel_size where the recipe sets it (the rest of the GPUs serve as data-parallel copies: "
        "mixture-of-experts models only), else all of its GPUs. `launch` waits until its /health answers (at most "
        "vllm_server_timeout seconds; its log: <output_dir>/vllm_server.log), points rank 0 at it "
        "(vllm_server_host/port) and stops it when the run ends. 0: no server started (vllm_mode server then needs "
        "vllm_server_base_url or vllm_server_host naming one already running).")
    vllm_server_python: str = _opt(
        DEFAULT_PYTHON, "launch.vllm_server_gpus: the python of the environment the vLLM server runs in, where trl and "
        "vllm are installed with vLLM's own pins (they conflict with the training stack's): `make vllm-env` creates the "
        "default from requirements-vllm.txt. A relative path is taken from the repository root.")


def _set(r: Recipe, key: str) -> bool:
    """A launch key the recipe gives a value other than its default."""
    name = key.split(".", 1)[1]
    return key in r.explicit and getattr(r.launch, name) != ServerOptions.__dataclass_fields__[name].default


def uses_server(r: Recipe, online: bool) -> bool:
    """The run generates through a vLLM server (use_vllm: true, vllm_mode: server)."""
    return online and bool(r.trl_value("use_vllm")) and r.trl_value("vllm_mode") == "server"


def server_parallel(r: Recipe) -> tuple[int, int]:
    """(tensor-parallel size, data-parallel size) of the server on launch.vllm_server_gpus GPUs."""
    gpus = r.launch.vllm_server_gpus
    tp = int(r.trl_value("vllm_tensor_parallel_size")) if "vllm_tensor_parallel_size" in r.trl else gpus
    return tp, gpus // tp if tp else 0


def check_server(r: Recipe, online: bool) -> None:
    """launch.vllm_server_gpus / vllm_server_python only where the run generates through a vLLM server; a server named
    (started by launch, or already running); the server's GPUs whole tensor-parallel groups of a split the model's
    attention heads allow; data-parallel copies only of a mixture-of-experts model (TRL's vllm_serve)."""
    L = r.launch
    if L.vllm_server_gpus < 0:
        raise RecipeError(f"launch.vllm_server_gpus: must be >= 0, got {L.vllm_server_gpus}; give the GPUs the vLLM server "
                          "takes (0: none started)")
    if not uses_server(r, online):
        stray = next((k for k in KEYS if _set(r, k)), None)
        if stray:
            why = (f"method {r.method} generates nothing" if not online else "use_vllm is false (transformers generates)"
                   if not r.trl_value("use_vllm") else "vllm_mode is colocate (vLLM runs inside each rank)")
            raise RecipeError(f"{stray}: starts a vLLM server for grpo/rloo with use_vllm: true and vllm_mode: server, "
                              f"and {why}; remove {stray} (or generate through a server: method grpo or rloo, use_vllm: "
                              "true, vllm_mode: server)")
        return
    external = r.trl_value("vllm_server_base_url") or "vllm_server_host" in r.trl
    if L.vllm_server_gpus == 0:
        if not external:
            raise RecipeError("vllm_mode: server generates on a vLLM server and the recipe names none; set "
                              "launch.vllm_server_gpus: N (launch starts one on N GPUs of its own beside the ranks), or "
                              "vllm_server_base_url for one already running, or set vllm_mode: colocate")
        return
    if external:
        key = "vllm_server_base_url" if r.trl_value("vllm_server_base_url") else "vllm_server_host"
        raise RecipeError(f"{key}: names a server already running, and launch.vllm_server_gpus starts one (on this node, "
                          f"at 127.0.0.1); keep one of them: remove {key}, or launch.vllm_server_gpus")
    if L.hardware == "cpu":
        raise RecipeError("launch.vllm_server_gpus: the vLLM server runs on GPUs and launch.hardware is cpu; remove it and "
                          "set use_vllm: false (transformers generates), or run on GPUs")
    tp, dp = server_parallel(r)
    if tp < 1 or L.vllm_server_gpus % tp:
        raise RecipeError(f"launch.vllm_server_gpus: {L.vllm_server_gpus} GPUs are not whole tensor-parallel groups of "
                          f"vllm_tensor_parallel_size {tp}; give the server a multiple of {max(tp, 1)} GPUs, or set "
                          f"vllm_tensor_parallel_size to a divisor of {L.vllm_server_gpus}")
    model = r.model.model_name_or_path
    if dp > 1 and moe_experts(model) == 0:
        raise RecipeError(f"vllm_tensor_parallel_size: {tp} on launch.vllm_server_gpus {L.vllm_server_gpus} makes {dp} "
                          "data-parallel copies, which vLLM refuses for a dense model (TRL's vllm_serve: keep "
                          f"data_parallel_size 1); set vllm_tensor_parallel_size: {L.vllm_server_gpus}, or remove it")
    if model and config_path(model).is_file():
        try:
            heads = sorted({lay.heads for lay in model_shape(model).decoder if lay.heads})
        except RecipeError:
            heads = []
        odd = [h for h in heads if h % tp]
        if odd:
            fits = [d for d in range(1, max(8, L.vllm_server_gpus) + 1) if all(h % d == 0 for h in heads)]
            raise RecipeError(f"vllm_tensor_parallel_size: vLLM splits the attention heads over the server's {tp} "
                              f"tensor-parallel GPUs, and {tp} does not divide the model's {odd[0]} heads; give the "
                              f"server a tensor-parallel size that does (launch.vllm_server_gpus, or "
                              f"vllm_tensor_parallel_size): one of {', '.join(map(str, fits))}")
