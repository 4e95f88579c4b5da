"""Narrow compatibility shims for upstream gaps, each applied only where it is needed (backends.apply_process_env).

Pinned to the versions in requirements.txt; each names the upstream code it works around, so it can be dropped
when that is fixed. tests/test_twins.py fails when one is removed (FSDP turns into DDP, or an adapter saves 0
tensors).
"""

from __future__ import annotations

import logging

log = logging.getLogger("sftrecipes")


def enable_fsdp_on_cpu() -> None:
    """accelerate 1.15 promotes a run to FSDP only for GPU-family distributed types (accelerate/state.py,
    AcceleratorState.__init__: `elif self.distributed_type in [MULTI_GPU, MULTI_XPU, ...]`). A CPU run is MULTI_CPU,
    so the FSDP plugin is dropped and the model is silently wrapped in DDP. After the original constructor, do what
    the GPU branch does. FSDP1 also needs the device without an index ("cpu", not "cpu:0"), or torch's FSDP init
    raises "Inconsistent compute device and `device_id`"."""
    import torch  # noqa: PLC0415
    from accelerate.state import AcceleratorState, PartialState  # noqa: PLC0415
    from accelerate.utils import DistributedType  # noqa: PLC0415

    original = AcceleratorState.__init__
    if getattr(original, "_sftrecipes_cpu_fsdp", False):
        return

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

    init._sftrecipes_cpu_fsdp = True
    AcceleratorState.__init__ = init
    log.info("compat: FSDP enabled on CPU (accelerate promotes only GPU distributed types)")


def fix_peft_prefixes_under_wrappers() -> None:
    """peft 0.21 finds adapter tensors by module-name prefixes (tuners_utils._get_tuner_state_dict_key_prefixes) and
    strips only a leading `_fsdp_wrapped_module.`; the state dict it filters has every wrapper segment removed. Under
    FSDP1 nested wrapping or activation-checkpoint wrappers no key matches and the adapter is saved with 0 tensors.
    Strip the wrapper segments wherever they are."""
    import peft.tuners.tuners_utils as tu  # noqa: PLC0415

    original = tu._get_tuner_state_dict_key_prefixes
    if getattr(original, "_sftrecipes_prefixes", False):
        return
    segments = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")

    def prefixes(model, adapter_name=None):
        out = set()
        for p in original(model, adapter_name=adapter_name):
            for seg in segments:
                p = p.replace(seg, "")
            out.add(p)
        return out

    prefixes._sftrecipes_prefixes = True
    tu._get_tuner_state_dict_key_prefixes = prefixes
