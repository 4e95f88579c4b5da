"""4-bit weights partitioned as they load under ZeRO-3: each decoder layer goes to DeepSpeed's partitioner as soon as
its last weight has been quantized, so no rank holds more than its share of the 4-bit layers loaded so far plus the
one layer being quantized.

transformers turns `deepspeed.zero.Init` off for bitsandbytes loads: the model is built on the meta device, every
weight is quantized as it is set, and the whole 4-bit model sits on each rank (each GPU) until the DeepSpeed engine
partitions it in `deepspeed.initialize` (36 GB per GPU for a 70B model; a 405B model cannot load on 80 GB GPUs).
Here the same loader runs, and its per-weight setter (`core_model_loading.set_param_for_module`, looked up by name at
each call) is wrapped: once every parameter of a decoder layer is set, the layer's parameters are converted to ZeRO-3
parameters with the same DeepSpeed config transformers uses for 16-bit zero.Init. The conversion is DeepSpeed's own,
the one the engine applies later to whatever is not yet partitioned (embeddings, norms, the head, LoRA): rank 0's data
is broadcast and each rank keeps its partition of the packed bytes; the quantization state (absmax, code, nested
statistics) stays on the `Params4bit` object on every rank, where bitsandbytes reads it after each gather. Every rank
quantizes every weight itself (from the memory-mapped checkpoint: one read of it per node in the page cache), so
the states are every rank's own and equal to rank 0's, bit for bit: the quantizer is deterministic.

A layer with a weight the checkpoint lacks (initialised after loading) is left whole, for the engine to partition;
model.load_model warns when any layer was (also when the setter was never called: a transformers whose loader no
longer goes through it). tests/test_quantload.py holds the setter's use at the pinned version.
"""

from __future__ import annotations

import contextlib
import logging

from transformers import core_model_loading

from . import meta
from .errors import RecipeError

log = logging.getLogger("sftrecipes")


class LayerPartitioner:
    """What the wrapped setter does for one from_pretrained call: finds the decoder layers (meta.decoder_layers) at
    its first call, counts each layer's parameters down as they are set, and hands a layer over when none is left."""

    def __init__(self, ds_config):
        self.ds_config = ds_config
        self.model = None  # the model being loaded, known from the setter's first call
        self.remaining: dict[str, tuple[set[str], object]] = {}  # layer prefix -> (names still to set, the layer)
        self.layers = 0  # decoder layers found
        self.partitioned = 0  # of them, handed to DeepSpeed

    def _layers(self, model) -> dict[str, tuple[set[str], object]]:
        try:
            prefix, layers = meta.decoder_layers(model)
        except RecipeError:  # no list of decoder layers to find: loaded whole, partitioned by the engine
            return {}
        out = {}
        for i, layer in enumerate(layers):
            names = {f"{prefix}.{i}.{n}" for n, _ in layer.named_parameters()}
            if names:
                out[f"{prefix}.{i}."] = (names, layer)
        return out

    def after_set(self, model, target_name: str) -> None:
        if self.model is None:
            self.model, self.remaining = model, self._layers(model)
            self.layers = len(self.remaining)
        for head, (names, layer) in self.remaining.items():
            if target_name.startswith(head):
                names.discard(target_name)
                if not names:
                    self._partition(layer)
                    del self.remaining[head]
                return

    def _partition(self, layer) -> None:
        import deepspeed  # noqa: PLC0415 - only ZeRO-3 runs get here

        deepspeed.zero.Init(module=layer, config_dict_or_path=self.ds_config)
        self.partitioned += 1


@contextlib.contextmanager
def partition_4bit_layers(enabled: bool):
    """Within (from_pretrained of a 4-bit model under ZeRO-3 with zero3_init): each decoder layer partitioned once its
    last weight is set. Yields the LayerPartitioner (None where not enabled)."""
    if not enabled:
        yield None
        return
    from transformers.integrations.deepspeed import deepspeed_config  # noqa: PLC0415 - as above

    part = LayerPartitioner(deepspeed_config())
    setter = core_model_loading.set_param_for_module

    def set_and_partition(model, target_name, *args, **kwargs):
        setter(model, target_name, *args, **kwargs)
        part.after_set(model, target_name)

    core_model_loading.set_param_for_module = set_and_partition
    try:
        yield part
    finally:
        core_model_loading.set_param_for_module = setter
