"""4-bit weights partitioned as they load, under ZeRO-3 and under FSDP2: each decoder layer is partitioned as soon as
its last weight has been quantized, so no rank holds more than its share of the 4-bit layers loaded so far plus the
one layer being quantized.

FSDP2 (fsdp_cpu_ram_efficient_loading, a floating quant storage): only rank 0 reads the checkpoint, as for 16-bit
weights; the other ranks build the model on the meta device. At each layer's last weight, rank 0 sends the layer to
them (`send_4bit_layers`, `receive_4bit_layers`: the packed bytes and each weight's quantization state, by broadcast),
and every rank keeps, of each packed weight, only the rows of dim 0 that FSDP2's `fully_shard` will take for it (its
`torch.chunk` of dim 0), in a full-shape CPU tensor of its own anonymous mapping where only those rows are ever
written: the rest costs address space, not memory. `fully_shard` copies the rank's rows into its shard and never reads
the others; `check_kept_rows` proves, once the model is wrapped, that the shard FSDP2 took is the rows kept. What lies
outside the layers is sent whole after loading. On a GPU the layer is quantized on the GPU and the kept rows wait in
host memory until `fully_shard` moves each layer to its GPU, one layer at a time.

ZeRO-3:

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
longer goes through it). tests/model/test_quantload.py holds the setter's use at the pinned version.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import mmap

import torch
from transformers import core_model_loading

from sftrecipes.core.errors import RecipeError
from sftrecipes.model import heap, meta

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
                    # what the layer still views in the checkpoint's mapping (its norms) copied first: zero.Init's
                    # broadcast writes into it, and a page written in the mapping would keep it from being dropped
                    heap.own_checkpoint_views(layer)
                    self._partition(layer)
                    del self.remaining[head]
                    heap.drop_checkpoint_pages()  # the layer's 16-bit weights were read: their pages leave this RSS
                return

    def summary(self) -> str:
        return f"zero3_init: {self.partitioned} of {self.layers} decoder layers partitioned as their 4-bit weights loaded"

    def _partition(self, layer) -> None:
        import deepspeed

        deepspeed.zero.Init(module=layer, config_dict_or_path=self.ds_config)
        self.partitioned += 1


@contextlib.contextmanager
def partition_4bit_layers(enabled: bool):
    """Within (from_pretrained of a 4-bit model under ZeRO-3 with zero3_init): each decoder layer partitioned once its
    last weight is set. Yields the LayerPartitioner (None where not enabled)."""
    if not enabled:
        yield None
        return
    from transformers.integrations.deepspeed import deepspeed_config

    with _after_each_set(LayerPartitioner(deepspeed_config())) as part:
        yield part


@contextlib.contextmanager
def _after_each_set(part: LayerPartitioner):
    """Within: transformers' per-weight setter, looked up by name at each call, followed by part.after_set."""
    setter = core_model_loading.set_param_for_module

    def set_then(model, target_name, *args, **kwargs):
        setter(model, target_name, *args, **kwargs)
        part.after_set(model, target_name)

    core_model_loading.set_param_for_module = set_then
    try:
        yield part
    finally:
        core_model_loading.set_param_for_module = setter


# ---------------------------------------------------------------------------------------------- FSDP2: rank 0 reads


def is_4bit(p) -> bool:
    return type(p).__name__ == "Params4bit"


def kept_rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """The rows [start, end) of a dim 0 of n rows that FSDP2 gives `rank` of `world`: torch.chunk's (chunks of
    ceil(n / world) rows, the last ones short or empty), as fully_shard cuts it (_chunk_with_empty)."""
    c = -(-n // world) if n else 0
    return min(n, rank * c), min(n, (rank + 1) * c)


def lazy_tensor(shape, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of `shape` in an anonymous mapping of its own: a page is given memory when first written, so rows
    never written cost address space only (also below glibc's mmap threshold, where torch.empty would reuse heap
    pages already resident). Freed (unmapped) with the tensor."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: no shared memory, no fork sharing
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def keep_rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """t's full shape in host memory holding only this rank's FSDP2 rows (its module records them: `kept_rows`)."""
    out = lazy_tensor(tuple(t.shape), t.dtype)
    a, b = kept_rows(t.shape[0], rank, world)
    out[a:b].copy_(t[a:b])
    return out


def _state_on(qs, device):
    """A copy of a bitsandbytes QuantState (its nested state2 too) with every tensor on `device`; the original as is."""
    out = copy.copy(qs)
    for key, value in vars(qs).items():
        if isinstance(value, torch.Tensor):
            setattr(out, key, value.to(device))
        elif key == "state2" and value is not None:
            out.state2 = _state_on(value, device)
    return out


def _comm_device() -> torch.device:
    import torch.distributed as dist

    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class LayerSender(LayerPartitioner):
    """Rank 0's side of the FSDP2 4-bit load: at each decoder layer's last weight, the layer's parameters go to the
    other ranks (one header, then each tensor by broadcast), and rank 0 keeps of each packed weight its own rows
    (`keep`: (rank, world), FSDP2's cut over the whole world: check_kept_rows holds it after wrapping)."""

    def __init__(self, keep: tuple[int, int]):
        super().__init__(ds_config=None)
        self.keep = keep
        self.sent: set[str] = set()  # parameter names sent
        self.heads: dict[int, str] = {}

    def _layers(self, model):
        out = super()._layers(model)
        self.heads = {id(layer): head for head, (_, layer) in out.items()}
        return out

    def summary(self) -> str:
        return (f"fsdp_cpu_ram_efficient_loading: {self.partitioned} of {self.layers} decoder layers sent to the other "
                "ranks as their 4-bit weights loaded, each rank keeping its FSDP2 rows")

    def _partition(self, layer) -> None:
        head = self.heads[id(layer)]
        self.send(head, [(head + n, layer, n) for n, _ in layer.named_parameters()])
        self.partitioned += 1

    def send(self, head: str, params: list[tuple[str, object, str]]) -> None:
        """One unit: the header (each parameter's name, shape, dtype and, for a 4-bit weight, its quantization state
        and settings), then each tensor; rank 0 then keeps only its rows of each packed weight of a layer."""
        import torch.distributed as dist

        rows = []
        for name, owner, local in params:
            p = owner.get_parameter(local)
            row = {"name": name, "shape": tuple(p.shape), "dtype": p.dtype, "requires_grad": p.requires_grad}
            if is_4bit(p):
                row["state"] = _state_on(p.quant_state, "cpu")
                row["settings"] = {k: getattr(p, k) for k in ("blocksize", "compress_statistics", "quant_type", "quant_storage")}
            rows.append(row)
        dist.broadcast_object_list([{"head": head, "params": rows}], src=0)
        dev = _comm_device()
        for name, owner, local in params:
            p = owner.get_parameter(local)
            dist.broadcast(p.data.to(dev).contiguous(), src=0)  # a copy only where the tensor is not on the device
            if head and is_4bit(p):
                p.data = keep_rows(p.data, *self.keep)
                owner.get_submodule(local.rpartition(".")[0]).kept_rows = kept_rows(p.shape[0], *self.keep)
            self.sent.add(name)

    def send_rest(self, model) -> None:
        """After loading: every parameter not sent with its layer (outside the layers, or in a layer a weight of which
        the checkpoint lacked), whole; the unit with head "" is the last."""
        rest = [(n, model, n) for n, _ in model.named_parameters() if n not in self.sent]
        self.send("", rest)


@contextlib.contextmanager
def send_4bit_layers(enabled: bool, keep: tuple[int, int] | None):  # keep: None where not enabled
    """Within (rank 0's from_pretrained of a 4-bit model under FSDP2 with RAM-efficient loading): each decoder layer
    sent to the other ranks once its last weight is set, then kept by rows. The caller sends the rest
    (LayerSender.send_rest) once loading is done. Yields the LayerSender (None where not enabled)."""
    if not enabled:
        yield None
        return
    with _after_each_set(LayerSender(keep)) as sender:
        yield sender


def receive_4bit_layers(model, keep: tuple[int, int]) -> int:
    """The other ranks' side: the model built on the meta device (4-bit modules, nothing read) takes rank 0's units
    as they come, keeping of each packed weight of a layer only its rows (`keep`), until the last unit; then its
    buffers are given storage (model._broadcast_buffers fills them). The number of layer units taken."""
    import bitsandbytes as bnb
    import torch.distributed as dist

    dev = _comm_device()
    layers = 0
    while True:
        unit = [None]
        dist.broadcast_object_list(unit, src=0)
        head, rows = unit[0]["head"], unit[0]["params"]
        for row in rows:
            buf = torch.empty(row["shape"], dtype=row["dtype"], device=dev)
            dist.broadcast(buf, src=0)
            mod_name, _, local = row["name"].rpartition(".")
            mod = model.get_submodule(mod_name)
            if "state" in row:
                data = keep_rows(buf, *keep) if head else buf
                state = _state_on(row["state"], dev)
                new = bnb.nn.Params4bit(data=data, requires_grad=False, quant_state=state, module=mod,
                                        bnb_quantized=True, **row["settings"])
                if head:
                    mod.kept_rows = kept_rows(row["shape"][0], *keep)
                mod.quant_state = state  # as bitsandbytes' own quantization sets it: FSDP2 drops the parameter's
            else:
                new = torch.nn.Parameter(buf, requires_grad=row["requires_grad"])
            new._is_hf_initialized = True
            mod._parameters[local] = new
            del buf
        if not head:
            break
        layers += 1
    model.tie_weights()  # a tied head still points at the meta embedding it was built with
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise RuntimeError(f"rank {dist.get_rank()}: rank 0 sent no weights for {len(missing)} parameters ({missing[0]}, ...)")
    for module in model.modules():
        for name, b in list(module._buffers.items()):
            if b is not None and b.device.type == "meta":
                module._buffers[name] = torch.empty_like(b, device="cpu")
    return layers


def check_kept_rows(model) -> int:
    """After FSDP2 wrapped the model: every packed weight kept by rows was cut by fully_shard at dim 0 over the
    world, this rank's chunk the rows kept (else the shard would hold rows never written). The number checked."""
    from torch.distributed.tensor import DTensor, Shard

    checked = 0
    for mod in model.modules():
        rows = getattr(mod, "kept_rows", None)
        if rows is None:
            continue
        p = mod._parameters.get("weight")
        if not (isinstance(p, DTensor) and p.placements == (Shard(0),)):
            raise RuntimeError(f"a 4-bit weight kept by rows was not sharded at dim 0 by FSDP2 ({type(p).__name__})")
        mesh = p.device_mesh
        if kept_rows(p.shape[0], mesh.get_local_rank(), mesh.size()) != rows:
            raise RuntimeError(f"FSDP2 cut a 4-bit weight as rank {mesh.get_local_rank()} of {mesh.size()}, not the rows "
                               f"this rank kept ({rows}): rows never written would be trained on")
        checked += 1
    return checked


def kept_rows_check():
    """A trainer callback running check_kept_rows on the wrapped model at train()'s start, before the first step."""
    from transformers import TrainerCallback

    class KeptRowsCheck(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            n = check_kept_rows(model)
            if n:
                log.debug("FSDP2 took the kept rows of %d 4-bit weights", n)

    return KeptRowsCheck()
