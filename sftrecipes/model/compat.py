"""Narrow compatibility shims for upstream gaps: each applied only where it is needed (train/args.apply_process_env) and
only on the upstream versions it was written against (SHIMS).

Each shim names the upstream code it works around and the versions it was written for (the pins in requirements.txt,
to the minor release). On another version it is not applied: one warning line names it and what to check. Each has a
canary in tests/model/test_compat.py that runs the upstream code without it and expects the upstream failure: when a new
upstream release fixes the gap, the canary fails and says to drop the shim. tests/launch/test_twins.py and
tests/export/test_export.py train through the shims (FSDP on CPU, adapters under wrappers, trainable-token heads).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from dataclasses import dataclass
from importlib.metadata import version
from typing import Callable

import peft.tuners.tuners_utils as tu
import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from packaging.specifiers import SpecifierSet
from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
from peft.utils.other import TrainableTokensWrapper
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

log = logging.getLogger("sftrecipes")


@dataclass(frozen=True)
class Shim:
    """One shim: its name (the function that applies it), the upstream gap it covers in one line, and the versions
    it was written against as (distribution, PEP 440 specifier) pairs."""
    name: str
    gap: str
    written_for: tuple[tuple[str, str], ...]
    apply: Callable[[], None]


SHIMS: dict[str, Shim] = {}
_APPLIED: dict[str, list[tuple[object, str, object]]] = {}  # name -> (owner, attribute, upstream value or _MISSING)
_MISSING = object()


def installed_version(dist: str) -> str:
    """The installed version of a distribution (one place, so a test can pretend another one)."""
    return version(dist)


def out_of_range(shim: Shim) -> str | None:
    """Why this shim does not fit the installed upstream versions ('peft 0.22.0, written for ~=0.21.2'), or None."""
    for package, spec in shim.written_for:
        have = installed_version(package)
        if have not in SpecifierSet(spec):
            return f"{package} {have}, written for {package}{spec}"
    return None


def _shim(gap: str, **written_for: str):
    """Register a shim; the decorated function patches upstream through _patch and runs at most once, and only when
    every distribution it was written for is in range."""
    def register(body):
        name = body.__name__

        @functools.wraps(body)
        def apply() -> None:
            if name in _APPLIED:
                return
            why = out_of_range(SHIMS[name])
            if why is not None:
                log.warning("compat: shim %s NOT applied (%s): it covers %s; check whether that still fails "
                            "(pytest tests/model/test_compat.py -k %s): if not, drop the shim, else re-check it and widen "
                            "its range in sftrecipes/model/compat.py", name, why, gap, name)
                return
            _APPLIED[name] = []
            body()

        SHIMS[name] = Shim(name, gap, tuple(written_for.items()), apply)
        return apply

    return register


def _patch(name: str, owner: object, attr: str, value: object) -> None:
    """Replace owner.attr for shim `name`, remembering the upstream value so restore() can put it back."""
    _APPLIED[name].append((owner, attr, vars(owner).get(attr, _MISSING)))
    setattr(owner, attr, value)


def restore(name: str) -> None:
    """Put the upstream code back that shim `name` replaced (nothing if it is not applied)."""
    for owner, attr, old in reversed(_APPLIED.pop(name, [])):
        if old is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, old)


@contextlib.contextmanager
def upstream(name: str):
    """Run the upstream code without shim `name` inside the block (the canaries); afterwards the shim is applied
    exactly when it was before."""
    was = name in _APPLIED
    restore(name)
    try:
        yield SHIMS[name]
    finally:
        restore(name)
        if was:
            SHIMS[name].apply()


@_shim("accelerate drops the FSDP plugin of a CPU run (MULTI_CPU), which then runs as DDP", accelerate="~=1.15.0")
def enable_fsdp_on_cpu() -> None:
    """accelerate 1.15 promotes a run to FSDP only for GPU-family distributed types (accelerate/state.py,
    AcceleratorState.__init__: `elif self.distributed_type in [MULTI_GPU, MULTI_XPU, ...]`). A CPU run is MULTI_CPU,
    so the FSDP plugin is dropped and the model is silently wrapped in DDP. After the original constructor, do what
    the GPU branch does. FSDP1 also needs the device without an index ("cpu", not "cpu:0"), or torch's FSDP init
    raises "Inconsistent compute device and `device_id`"."""
    original = AcceleratorState.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is None or self.distributed_type != DistributedType.MULTI_CPU:
            return
        if self._mixed_precision != "no":
            plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = plugin
        self.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # the GPU branch keeps them in sync too
        if self.device is not None and self.device.type == "cpu" and self.device.index is not None:
            self.device = torch.device("cpu")
            PartialState._shared_state["device"] = self.device

    _patch("enable_fsdp_on_cpu", AcceleratorState, "__init__", functools.wraps(original)(init))
    log.info("compat: FSDP enabled on CPU (accelerate promotes only GPU distributed types)")


@_shim("peft saves a LoRA adapter with 0 tensors under FSDP1 nesting or checkpoint wrappers", peft="~=0.21.2")
def fix_peft_prefixes_under_wrappers() -> None:
    """peft 0.21 finds adapter tensors by module-name prefixes (tuners_utils._get_tuner_state_dict_key_prefixes) and
    strips only a leading `_fsdp_wrapped_module.`; the state dict it filters has every wrapper segment removed. Under
    FSDP1 nested wrapping or activation-checkpoint wrappers no key matches and the adapter is saved with 0 tensors.
    Strip the wrapper segments wherever they are."""
    original = tu._get_tuner_state_dict_key_prefixes
    segments = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")

    def prefixes(model, adapter_name=None):
        out = set()
        for p in original(model, adapter_name=adapter_name):
            for seg in segments:
                p = p.replace(seg, "")
            out.add(p)
        return out

    _patch("fix_peft_prefixes_under_wrappers", tu, "_get_tuner_state_dict_key_prefixes", prefixes)


def _is_dtensor(t) -> bool:

    return isinstance(t, DTensor)


def _merged_full(wrapper):
    """The wrapped head's weight with the trained token rows in place, as a plain tensor: FSDP2 leaves the head's
    parameters sharded (DTensors) outside its own forward, and peft's merge would mix them with plain index tensors.
    full_tensor() gathers and is differentiable (its backward reduce-scatters into the shards)."""
    layer = wrapper.token_adapter
    w = layer.base_layer.weight
    w = w.full_tensor() if _is_dtensor(w) else w
    for name in layer.active_adapters:
        rows = layer.trainable_tokens_delta[name]
        rows = rows.full_tensor() if _is_dtensor(rows) else rows
        w = w.index_copy(0, torch.tensor(layer.token_indices[name], device=w.device), rows.to(w))
    return w


@_shim("TRL's fused LM head reads lm_head.bias, which peft's TrainableTokensWrapper lacks (AttributeError every step)",
       peft="~=0.21.2", trl="~=1.16.0")
def trainable_token_heads_for_trl() -> None:
    """TRL 1.16's fused LM head (trl.trainer.utils.add_fused_lm_head, always on in SFTTrainer) reads
    `lm_head.weight` and `lm_head.bias` instead of calling the head. When new tokens make peft wrap the head in a
    TrainableTokensWrapper (lora.lora_config: trainable_token_indices), `.weight` is the merged weight (base rows +
    the trained delta rows, differentiable) but `.bias` does not exist: every step fails with AttributeError. Give the
    wrapper the bias of the module it wraps; under ZeRO-3 merge the weight gathered, under FSDP2 from full tensors."""
    has, get = TrainableTokensWrapper._hasattr_wrapped, TrainableTokensWrapper._getattr_wrapped

    def hasattr_wrapped(self, name, modules):
        return name == "bias" or has(self, name, modules)

    def getattr_wrapped(self, name, modules):
        if name == "bias":
            return getattr(self.original_module, "bias", None)
        base = getattr(self.original_module, "weight", None)
        if name == "weight" and _is_dtensor(base):
            return _merged_full(self)
        if name != "weight" or not hasattr(base, "ds_id"):
            return get(self, name, modules)
        # ZeRO-3: the base weight is partitioned unless a hook gathered it. Merge it gathered (index_copy makes a new
        # full tensor, valid after the partition is given back), and mark the result available, as TRL's gather
        # helper (maybe_gather_lm_head_ctx) asks every head weight for its ZeRO status.
        import deepspeed
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        layer = self.token_adapter  # its delta rows are partitioned too unless small enough to persist
        params = [base, *(layer.trainable_tokens_delta[a] for a in layer.active_adapters)]
        absent = [p for p in params if hasattr(p, "ds_id") and p.ds_status != ZeroParamStatus.AVAILABLE]
        with deepspeed.zero.GatheredParameters(absent, modifier_rank=None, enabled=bool(absent)):
            merged = get(self, name, modules)
        merged.ds_status = ZeroParamStatus.AVAILABLE
        return merged

    _patch("trainable_token_heads_for_trl", TrainableTokensWrapper, "_hasattr_wrapped", hasattr_wrapped)
    _patch("trainable_token_heads_for_trl", TrainableTokensWrapper, "_getattr_wrapped", getattr_wrapped)


@_shim("peft builds the ZeRO-3 trainable-token broadcast buffer on CUDA, which the cpu target lacks", peft="~=0.21.2")
def trainable_tokens_init_under_zero3_on_cpu() -> None:
    """peft 0.21 initialises the new token rows of a ZeRO-3 partitioned embedding in
    TrainableTokensLayer._collect_token_weights: rank 0 gathers the weight and copies the rows, the others receive them
    by broadcast into a buffer it always builds on CUDA. On the cpu target that fails ("Torch not compiled with CUDA");
    build the buffer on the weight's own device instead (same gather, same broadcast)."""
    import deepspeed

    def collect(self, weight, rows, embed_dim):
        with deepspeed.zero.GatheredParameters([weight], modifier_rank=None):
            if dist.get_rank() == 0:
                values = weight[rows].clone()
            else:
                values = torch.empty((len(rows), embed_dim), dtype=weight.dtype, device=weight.device)
        dist.broadcast(values, src=0)
        return values

    _patch("trainable_tokens_init_under_zero3_on_cpu", TrainableTokensLayer, "_collect_token_weights", collect)


@_shim("DeepSpeed compiles its shared-memory all-reduce kernel (deepspeed_shm_comm) when a CPU run sets up its "
       "communication, for inference_all_reduce alone, which training never calls: ~90 s of C++ build on 2 cores at a "
       "fresh machine's first DeepSpeed run", deepspeed="~=0.19.8")
def no_shm_comm_kernel_on_cpu() -> None:
    """deepspeed 0.19's TorchBackend (deepspeed.comm.torch, created by init_distributed, which accelerate calls for a
    DeepSpeed run) JIT-builds the cpu accelerator's ShareMemCommBuilder op (`build_shm_op`) and uses it only in
    `inference_all_reduce` (DeepSpeed-Inference's tensor parallelism); ZeRO's collectives go through torch.distributed
    (gloo on the cpu target) either way. Without the kernel, inference_all_reduce falls back to the process group's
    all_reduce, as upstream does where the kernel cannot run."""
    # (`import deepspeed.comm.torch as m` would bind the torch library: deepspeed.comm re-exports its `torch`)
    ds_torch = importlib.import_module("deepspeed.comm.torch")  # DeepSpeed runs only; it reads DS_ACCELERATOR when imported
    _patch("no_shm_comm_kernel_on_cpu", ds_torch, "build_shm_op", lambda: None)


@_shim("under ZeRO-3, transformers runs a model's _init_weights on modules whose parameters all loaded; model code that "
       "reads such a parameter's shape there sees its 0-element partition (RWKV: IndexError)", transformers="~=5.24.0")
def loaded_modules_skip_init_under_zero3() -> None:
    """transformers 5.24 initialises the keys a checkpoint lacks by running `_init_weights` on every module not yet
    marked initialised (PreTrainedModel._initialize_weights, from _initialize_missing_keys); the init functions skip
    loaded tensors, but the model's own code runs first. Under ZeRO-3 a loaded parameter is a 0-element partition
    outside the GatheredParameters block, so code that reads its shape fails (RWKV's `max(shape[0], shape[1])` of an
    embedding: IndexError, every rank, after loading). A module whose own parameters are all ZeRO-3 partitions marked
    loaded, and whose buffers are all loaded, is marked initialised and skipped: its init could change nothing (as
    transformers already does for remote code); non-persistent buffers (rotary tables) are never loaded, so their
    modules still run."""
    from transformers import PreTrainedModel

    original = PreTrainedModel._initialize_weights

    @functools.wraps(original)
    def initialize(self, module, is_custom_code: bool = False):
        own = list(module.parameters(recurse=False))
        buffers = [b for b in module.buffers(recurse=False) if b is not None]
        if (own and not getattr(module, "_is_hf_initialized", False) and all(hasattr(p, "ds_id") for p in own)
                and all(getattr(t, "_is_hf_initialized", False) for t in own + buffers)):
            module._is_hf_initialized = True
            return None
        return original(self, module, is_custom_code)

    _patch("loaded_modules_skip_init_under_zero3", PreTrainedModel, "_initialize_weights", initialize)


@_shim("transformers' Split conversion sizes each piece of a fused checkpoint tensor by its target parameter's shape, "
       "which under ZeRO-3 is a 0-element partition (Sarvam-MoE's query_key_value, Lara-mini's in_proj_qkv: "
       "split_with_sizes fails while loading)", transformers="~=5.24.0")
def split_sizes_from_full_shapes_under_zero3() -> None:
    """transformers 5.24's core_model_loading.Split cuts a stored fused tensor (q|k|v) into one piece per target,
    each as many rows as the target parameter has. Under ZeRO-3 (zero.Init) the parameter holds a 0-element
    partition; its full shape is in ds_shape. Read the sizes from there where the targets are partitioned; the same
    cut otherwise (upstream's own code)."""
    from transformers import core_model_loading

    original = core_model_loading.Split.convert

    @functools.wraps(original)
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name, model, **kwargs):
        params = [model.get_parameter(full_layer_name.replace(target_patterns[0], t)) for t in target_patterns]
        if len(input_dict) != 1 or not all(hasattr(p, "ds_shape") for p in params):
            return original(self, input_dict, source_patterns, target_patterns, full_layer_name, model, **kwargs)
        value = next(iter(input_dict.values()))
        fused = value[0] if isinstance(value, list) else value
        pieces = torch.split(fused, [p.ds_shape[self.dim] for p in params], dim=self.dim)
        return {t: piece.contiguous() for t, piece in zip(target_patterns, pieces)}

    _patch("split_sizes_from_full_shapes_under_zero3", core_model_loading.Split, "convert", convert)


@_shim("peft's v4->v5 MoE target conversion drops dense nn.Linear targets named like the old expert projections",
       peft="~=0.21.2")
def keep_dense_linears_in_moe_conversion() -> None:
    """peft 0.21 rewrites a LoRA config for the MoE types transformers 5 converted (peft.utils.
    transformers_weight_conversion._convert_peft_config_moe: Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4-MoE, MiniMax, ...):
    every target named gate_proj / up_proj / down_proj (or gate) becomes the fused experts' parameter and leaves
    target_modules. On v4 those names also adapted the dense layers' MLPs and the shared experts, which are still
    nn.Linear modules on v5: after the rewrite they get no LoRA, silently. Put back the names that still name
    nn.Linear modules of the model (the output head aside), so a v4 adapter keeps its meaning and a v5 config (the
    project's lora.lora_targets) adapts what it lists."""
    import peft.utils.transformers_weight_conversion as twc

    original = twc._convert_peft_config_moe

    def convert(peft_config, model) -> None:
        before = peft_config.target_modules
        original(peft_config, model)
        after = peft_config.target_modules
        if before is after or after is None:
            return
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and m is not head}
        if isinstance(before, str):  # all-linear (or a regex): what peft resolved it to, before the rewrite
            wanted = linear if before.lower() == "all-linear" else set()
        else:
            wanted = {t.rsplit(".", 1)[-1] for t in before}
        back = {t for t in wanted if t in linear} - set(after)
        if back:
            peft_config.target_modules = set(after) | back

    _patch("keep_dense_linears_in_moe_conversion", twc, "_convert_peft_config_moe", convert)


@_shim("a causal LM whose base_model_prefix names no attribute gives itself as base_model; TRL's fused head then "
       "reads last_hidden_state from its own CausalLM output (AttributeError every step)", transformers="~=5.24.0",
       trl="~=1.16.0")
def backbone_under_a_stale_prefix() -> None:
    """transformers 5.24's PreTrainedModel.base_model is `getattr(self, self.base_model_prefix, self)`. Llama4ForCausalLM
    (text-only Llama-4) keeps its backbone in `model` but declares base_model_prefix "language_model" (the multimodal
    model's), so base_model is the CausalLM itself. TRL 1.16's fused LM head (trl.trainer.utils.add_fused_lm_head,
    always on in SFTTrainer) runs `self.base_model(...)` and reads `.last_hidden_state`: a CausalLM output has none. Where
    the prefix names no attribute and the model holds its backbone as `model`, give that backbone."""
    original = PreTrainedModel.base_model

    def base_model(self):
        if getattr(self, self.base_model_prefix, None) is None and isinstance(getattr(self, "model", None), PreTrainedModel):
            return self.model
        return original.fget(self)

    _patch("backbone_under_a_stale_prefix", PreTrainedModel, "base_model", property(base_model, doc=original.__doc__))


# the names transformers' MoE configs give the expert count where they have no num_experts
EXPERT_COUNT_NAMES = ("num_local_experts", "n_routed_experts")


@_shim("TRL's MoE aux loss reads config.num_experts, which Llama-4, DeepSeek-V4, GraniteMoE and PhiMoE configs name "
       "num_local_experts (AttributeError every step)", transformers="~=5.24.0", trl="~=1.16.0")
def num_experts_for_trl() -> None:
    """TRL 1.16's SFTTrainer turns the load-balancing loss on for every config with output_router_logits and a
    router_aux_loss_coef (these have 0.001); its fused LM head then reads `text_config.num_experts`
    (trl.trainer.utils.add_fused_lm_head). transformers 5.24's Llama4TextConfig, DeepseekV4Config, GraniteMoe*Config
    and PhimoeConfig name the count num_local_experts and map no alias, so every step fails. When the trainer installs
    the fused head, the model's config class gains the alias (attribute_map, as Mixtral's config has it), which reads
    and writes num_local_experts and adds no key to a saved config.json."""
    import trl.trainer.sft_trainer as sft

    original = sft.add_fused_lm_head

    @functools.wraps(original)
    def add_fused_lm_head(model, *args, **kwargs):
        alias_num_experts(type(model.config.get_text_config()))
        return original(model, *args, **kwargs)

    _patch("num_experts_for_trl", sft, "add_fused_lm_head", add_fused_lm_head)


def alias_num_experts(cls) -> None:
    """num_experts on a config class that names its expert count otherwise (num_experts_for_trl)."""
    fields = getattr(cls, "__dataclass_fields__", {})
    names = cls.attribute_map
    if "num_experts" in names or "num_experts" in names.values() or "num_experts" in fields or hasattr(cls, "num_experts"):
        return  # has it, or is what another name aliases (Kimi-Linear: num_local_experts -> num_experts)
    count = next((n for n in EXPERT_COUNT_NAMES if n in fields), None)
    if count is not None and "num_experts_for_trl" in _APPLIED:
        _patch("num_experts_for_trl", cls, "attribute_map", {**cls.attribute_map, "num_experts": count})


@_shim("accelerate's RAM-efficient FSDP2 loading takes every state-dict entry for a sharded parameter and fails on a "
       "persistent buffer (DeepSeek-V3's router bias, Gemma-4's layer scalars: 'Tensor' has no device_mesh)",
       accelerate="~=1.15.0")
def buffers_in_ram_efficient_fsdp2() -> None:
    """accelerate 1.15's fsdp2_load_full_state_dict (accelerate/utils/fsdp_utils.py) walks the sharded model's state
    dict and reads `.device_mesh` of each entry; FSDP2 shards parameters only, so a persistent buffer in that dict
    (DeepSeek-V3's e_score_correction_bias, Gemma-4's layer_scalar) is a plain tensor and the load fails after rank 0
    has read the weights. Around it: those buffers are left out of the state dict for the upstream call (marked
    non-persistent), then rank 0 broadcasts each one whole, as buffers are not sharded, and they are persistent again."""
    import accelerate.utils.fsdp_utils as fsdp_utils

    original = fsdp_utils.fsdp2_load_full_state_dict

    @functools.wraps(original)
    def load(accelerator, model, full_sd, *args, **kwargs):
        plain = {k: v for k, v in model.state_dict().items() if not isinstance(v, DTensor)}
        owners = []
        for fqn in plain:
            parent, _, leaf = fqn.rpartition(".")
            module = model.get_submodule(parent)
            if leaf not in module._buffers:  # a parameter FSDP left whole: upstream's own failure, unchanged
                return original(accelerator, model, full_sd, *args, **kwargs)
            owners.append((fqn, module, leaf))
        if not owners:
            return original(accelerator, model, full_sd, *args, **kwargs)
        for _, module, leaf in owners:
            module._non_persistent_buffers_set.add(leaf)
        try:
            original(accelerator, model, full_sd, *args, **kwargs)
        finally:
            for _, module, leaf in owners:
                module._non_persistent_buffers_set.discard(leaf)
        for fqn, module, leaf in owners:
            like = plain[fqn]
            if accelerator.is_main_process:
                tensor = full_sd[fqn].detach().to(accelerator.device, like.dtype).contiguous()
            else:
                tensor = torch.empty(like.shape, dtype=like.dtype, device=accelerator.device)
            dist.broadcast(tensor, src=0)
            module._buffers[leaf] = tensor
        return model

    _patch("buffers_in_ram_efficient_fsdp2", fsdp_utils, "fsdp2_load_full_state_dict", load)
