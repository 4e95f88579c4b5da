"""Test-only driver (tests/model/test_quantload.py), run on 2 ranks under accelerate with a QLoRA ZeRO-3 or FSDP2 recipe.

ZeRO-3: for each model folder in QUANTLOAD_MODELS (os.pathsep-separated; else the recipe's), loads the model as
train.py does (model.load_model, zero3_init: 4-bit layers partitioned as they load), then again with zero3_init off
(the whole 4-bit model on every rank, as transformers loads it), and compares, on this rank:
- every Params4bit's packed bytes gathered from the partitions (what the rank computes with) against the whole load's,
  bit for bit, and its quantization state (absmax, code, nested statistics: every tensor's bytes, and the rest);
- the logits of one forward pass with every parameter gathered against the whole model's.
While the partitioned model loads it records, at each layer handed to DeepSpeed, how many packed bytes this rank
holds whole, beside each layer's packed bytes in the whole load: the proof that layers were partitioned as they
loaded, not after.

FSDP2 (check_fsdp): the same two loads (fsdp_cpu_ram_efficient_loading: rank 0 reads, each layer sent once quantized
and kept by rows; then off: every rank loads the whole model), and on this rank: which pages of each kept weight are
resident (only its own rows'), the whole bytes held at each layer's sending, then the model wrapped by accelerate's
FSDP2 preparation and compared with the whole load: the packed bytes every Linear4bit computes with in a forward pass
(gathered by FSDP2) and the gathered shards, bit for bit, the quantization state, and the logits.
Writes <output_dir>/rank<N>-<folder name>.json."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import deepspeed  # noqa: E402
import torch  # noqa: E402

from sftrecipes.train import args as backends  # noqa: E402
from sftrecipes.train import devices  # noqa: E402
from sftrecipes.model import meta  # noqa: E402
from sftrecipes.model import load as models  # noqa: E402
from sftrecipes.model import wrapping  # noqa: E402
from sftrecipes.model import quantload  # noqa: E402
from sftrecipes.recipe.load import load_recipe  # noqa: E402
from sftrecipes.data.tokenizer import load_tokenizer  # noqa: E402


def params4bit(model) -> dict:
    return {n: p for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}


def whole_bytes(model) -> int:
    """Packed bytes of the 4-bit weights this rank holds whole: loaded (not on the meta device), not yet handed to
    DeepSpeed (ZeRO-3) and not kept by rows (FSDP2)."""
    return sum(p.numel() * p.element_size() for m in model.modules()
               if quantload.is_4bit(p := m._parameters.get("weight")) and p.device.type != "meta"
               and not hasattr(p, "ds_tensor") and not hasattr(m, "kept_rows"))


def load_both(argv: list[str], target: str, partitioner: type, whole_flag: str):
    """The model loaded as train.py loads it (4-bit layers partitioned as they load), recording at each layer's
    hand-over the 4-bit bytes this rank holds whole; then loaded whole (`whole_flag` false). (parted, whole,
    held_at_handover, each decoder layer's packed bytes in the whole load)."""
    recipe = load_recipe(argv)
    tokenizer = load_tokenizer(recipe)[0]
    held_at_handover = []
    handover = partitioner._partition

    def recording(self, layer):
        held_at_handover.append(whole_bytes(self.model))
        handover(self, layer)

    partitioner._partition = recording
    try:
        parted = models.load_model(recipe, tokenizer, target)
    finally:
        partitioner._partition = handover
    whole = models.load_model(load_recipe(argv + [whole_flag, "false"]), tokenizer, target)
    ref = params4bit(whole)
    prefix, layers = meta.decoder_layers(whole)
    layer_bytes = [sum(p.numel() * p.element_size() for n, p in ref.items() if n.startswith(f"{prefix}.{i}."))
                   for i in range(len(layers))]
    return parted, whole, held_at_handover, layer_bytes


def state_tensors(qs, prefix="") -> dict:
    """Every tensor of a bitsandbytes QuantState (nested state2 included), as bytes, and its plain fields."""
    out = {}
    for key, value in vars(qs).items():
        if isinstance(value, torch.Tensor):
            out[prefix + key] = [str(value.dtype), list(value.shape), value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).tolist()]
        elif key == "state2" and value is not None:
            out.update(state_tensors(value, prefix + "state2."))
        elif isinstance(value, (int, float, str, bool, torch.dtype, torch.Size, tuple)) or value is None:
            out[prefix + key] = str(value)
    return out


def check(argv: list[str], target: str, rank: int) -> dict:
    """One model: loaded partitioned, then whole, and compared on this rank."""
    parted, whole, held_at_handover, layer_bytes = load_both(argv, target, quantload.LayerPartitioner, "--launch.zero3_init")
    mine, ref = params4bit(parted), params4bit(whole)
    result = {"rank": rank, "params4bit": len(mine), "layer_bytes": layer_bytes, "partitioned": 0, "bits_equal": 0,
              "state_equal": 0, "partition_elements": 0, "whole_elements": 0, "held_at_handover": held_at_handover,
              "whole_4bit_bytes": whole_bytes(whole), "mismatch": []}
    for name, p in mine.items():
        if hasattr(p, "ds_tensor"):
            result["partitioned"] += 1
            result["partition_elements"] += p.ds_tensor.numel()
            result["whole_elements"] += p.ds_numel
        with deepspeed.zero.GatheredParameters([p]):
            same_bits = torch.equal(p.data.view(torch.uint8), ref[name].data.view(torch.uint8))
        same_state = state_tensors(p.quant_state) == state_tensors(ref[name].quant_state)
        result["bits_equal"] += same_bits
        result["state_equal"] += same_state
        if not (same_bits and same_state):
            result["mismatch"].append(name)
    ids = torch.tensor([[1, 20, 30, 40, 50, 60, 70, 80]])
    with torch.no_grad(), deepspeed.zero.GatheredParameters(list(parted.parameters())):
        logits = parted(input_ids=ids).logits
    with torch.no_grad():
        result["logits_equal"] = torch.equal(logits, whole(input_ids=ids).logits)
    return result


def resident_pages(t) -> list[bool]:
    """Whether each page of t's storage is resident (/proc/self/pagemap's present bit)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    first, last = start // page, (start + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    return [bool(int.from_bytes(raw[i:i + 8], "little") >> 63) for i in range(0, len(raw), 8)]


def kept_pages(name, p, rows) -> tuple[int, int, list]:
    """(pages of the kept rows resident, pages wholly outside them resident, problems) for one kept packed weight."""
    page = os.sysconf("SC_PAGE_SIZE")
    row_bytes = p.data[0].numel() * p.element_size()
    a, b = rows[0] * row_bytes, rows[1] * row_bytes  # offsets into the storage (it starts on a page: its own mapping)
    mine = outside = 0
    problems = []
    if p.untyped_storage().data_ptr() % page:
        problems.append(f"{name}: not in a mapping of its own")
    for i, present in enumerate(resident_pages(p.data)):
        lo, hi = i * page, (i + 1) * page
        if a <= lo and hi <= b:
            mine += present
            if not present:
                problems.append(f"{name}: page {i} of its rows not resident")
        elif hi <= a or lo >= b:
            outside += present
    return mine, outside, problems


def check_fsdp(argv: list[str], target: str, rank: int) -> dict:
    """One model under FSDP2: loaded with rank 0 reading (kept by rows), then whole, wrapped, and compared."""
    from accelerate import Accelerator
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    from sftrecipes.model.quantload import check_kept_rows, kept_rows

    parted, whole, held_at_handover, layer_bytes = load_both(argv, target, quantload.LayerSender,
                                                             "--launch.fsdp_cpu_ram_efficient_loading")
    world = torch.distributed.get_world_size()
    ref = params4bit(whole)
    result = {"rank": rank, "params4bit": len(ref), "layer_bytes": layer_bytes, "held_at_handover": held_at_handover,
              "whole_4bit_bytes": whole_bytes(whole), "kept": 0, "rows_as_chunked": 0, "pages_mine": 0,
              "pages_outside": 0, "problems": [], "mismatch": []}
    for name, p in params4bit(parted).items():
        mod = parted.get_submodule(name.rpartition(".")[0])
        if hasattr(mod, "kept_rows"):
            result["kept"] += 1
            result["rows_as_chunked"] += mod.kept_rows == kept_rows(p.shape[0], rank, world)
            mine, outside, problems = kept_pages(name, p, mod.kept_rows)
            result["pages_mine"] += mine
            result["pages_outside"] += outside
            result["problems"] += problems
    modules = {n: m for n, m in parted.named_modules() if type(m).__name__ == "Linear4bit"}
    # the whole load's bytes and states before any forward pass: in eval mode bitsandbytes' CPU backend repacks a
    # weight for its kernel at its first forward (a layout of its own, packing_format_for_cpu)
    want = {n: ref[n + ".weight"].data.reshape(-1).view(torch.uint8).clone() for n in modules}
    want_state = {n: state_tensors(ref[n + ".weight"].quant_state) for n in modules}
    acc = Accelerator()
    acc.state.fsdp_plugin.transformer_cls_names_to_wrap = wrapping.fsdp_layer_classes(parted)  # this family's layers
    wrapped = fsdp2_prepare_model(acc, parted)  # what accelerate's prepare() does to the model
    result["checked_after_wrap"] = check_kept_rows(wrapped)
    result["bits_equal"] = result["gathered_equal"] = result["state_equal"] = 0
    for name, mod in modules.items():  # the shards gathered, and each module's state, before any forward
        gathered = mod.weight.full_tensor() if hasattr(mod.weight, "full_tensor") else mod.weight.data
        result["gathered_equal"] += torch.equal(gathered.reshape(-1).view(torch.uint8), want[name])
        result["state_equal"] += state_tensors(mod.quant_state) == want_state[name]
    computed = {}

    def capture(name):
        def hook(module, args):  # what the module computes with: FSDP2 has gathered its layer
            computed[name] = module.weight.detach().reshape(-1).view(torch.uint8).clone()
        return hook

    handles = [m.register_forward_pre_hook(capture(n)) for n, m in modules.items()]
    ids = torch.tensor([[1, 20, 30, 40, 50, 60, 70, 80]])
    with torch.no_grad():
        logits = wrapped(input_ids=ids).logits
        result["logits_equal"] = torch.equal(logits, whole(input_ids=ids).logits)
    for h in handles:
        h.remove()
    result["computed"] = len(computed)
    for name in modules:
        same = name in computed and torch.equal(computed[name], want[name])
        result["bits_equal"] += same
        if not same:
            result["mismatch"].append(name)
    return result


if __name__ == "__main__":
    argv = sys.argv[1:]
    recipe = load_recipe(argv)
    target = devices.hardware(recipe)
    backends.apply_process_env(recipe, target)
    args = backends.training_args(recipe, target)  # ZeRO-3 on (transformers' DeepSpeed config), process group up
    rank, out = args.process_index, Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = check_fsdp if recipe.launch.backend == "fsdp" else check
    for folder in os.environ.get("QUANTLOAD_MODELS", recipe.model.model_name_or_path).split(os.pathsep):
        row = run(argv + ["--model_name_or_path", folder], target, rank)
        (out / f"rank{rank}-{Path(folder).name}.json").write_text(json.dumps(row))
