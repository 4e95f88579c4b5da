"""Test-only driver (tests/test_quantload.py), run on 2 ranks under accelerate with a QLoRA ZeRO-3 recipe: for each
model folder in QUANTLOAD_MODELS (os.pathsep-separated; else the recipe's), loads the model as train.py does
(model.load_model, zero3_init: 4-bit layers partitioned as they load), then again with zero3_init off (the whole 4-bit
model on every rank, as transformers loads it), and compares, on this rank:
- every Params4bit's packed bytes gathered from the partitions (what the rank computes with) against the whole load's,
  bit for bit, and its quantization state (absmax, code, nested statistics: every tensor's bytes, and the rest);
- the logits of one forward pass with every parameter gathered against the whole model's.
While the partitioned model loads it records, at each layer handed to DeepSpeed, how many packed bytes this rank
holds whole, beside each layer's packed bytes in the whole load: the proof that layers were partitioned as they
loaded, not after. Writes <output_dir>/rank<N>-<folder name>.json."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import deepspeed  # noqa: E402
import torch  # noqa: E402

from sftrecipes import backends, meta, model as models, quantload  # noqa: E402
from sftrecipes.recipe import load_recipe  # noqa: E402
from sftrecipes.tokenizer import load_tokenizer  # noqa: E402


def params4bit(model) -> dict:
    return {n: p for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}


def whole_bytes(model) -> int:
    """Packed bytes of the 4-bit weights this rank holds whole: loaded (not on the meta device) and not yet handed to
    DeepSpeed."""
    return sum(p.numel() * p.element_size() for p in params4bit(model).values()
               if p.device.type != "meta" and not hasattr(p, "ds_tensor"))


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
    recipe = load_recipe(argv)
    tokenizer = load_tokenizer(recipe)[0]
    held_at_handover = []
    handover = quantload.LayerPartitioner._partition

    def recording(self, layer):
        held_at_handover.append(whole_bytes(self.model))
        handover(self, layer)

    quantload.LayerPartitioner._partition = recording
    try:
        parted = models.load_model(recipe, tokenizer, target)
    finally:
        quantload.LayerPartitioner._partition = handover
    whole = models.load_model(load_recipe(argv + ["--launch.zero3_init", "false"]), tokenizer, target)

    mine, ref = params4bit(parted), params4bit(whole)
    prefix, layers = meta.decoder_layers(whole)
    layer_bytes = [sum(p.numel() * p.element_size() for n, p in ref.items() if n.startswith(f"{prefix}.{i}."))
                   for i in range(len(layers))]
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


if __name__ == "__main__":
    argv = sys.argv[1:]
    recipe = load_recipe(argv)
    target = backends.hardware(recipe)
    backends.apply_process_env(recipe, target)
    args = backends.training_args(recipe, target)  # ZeRO-3 on (transformers' DeepSpeed config), process group up
    rank, out = args.process_index, Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for folder in os.environ.get("QUANTLOAD_MODELS", recipe.model.model_name_or_path).split(os.pathsep):
        row = check(argv + ["--model_name_or_path", folder], target, rank)
        (out / f"rank{rank}-{Path(folder).name}.json").write_text(json.dumps(row))
