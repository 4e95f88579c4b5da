"""4-bit weights partitioned as they load under ZeRO-3 (sftrecipes/quantload.py), on 2 ranks: what each rank computes
with is the whole load's, bit for bit, and no rank held more than one layer's 4-bit weights whole while loading."""

import json
import os

from conftest import FAMILIES, accelerate_launch


def test_4bit_layers_partition_as_they_load_bit_for_bit_under_zero3(tiny_model, family_models, tmp_path, monkeypatch):
    """The QLoRA ZeRO-3 twin's loading of the tiny Llama and every family's tiny model, on both ranks, in one launch
    (tests/quantload_driver.py): every Params4bit gathered from its partitions holds the packed bytes and the
    quantization state of the whole model transformers loads (zero3_init off), the logits are equal, each rank keeps
    half of the packed elements, and at each layer's hand-over the rank held exactly that layer's packed bytes
    whole, in order: the earlier layers were already partitioned."""
    out = tmp_path / "q"
    folders = [str(tiny_model)] + [str(family_models[f]) for f in FAMILIES]
    monkeypatch.setenv("QUANTLOAD_MODELS", os.pathsep.join(folders))
    accelerate_launch("recipes/tiny/qlora-zero3.yaml", out, "tests/quantload_driver.py")
    for folder in folders:
        rows = [json.loads((out / f"rank{r}-{os.path.basename(folder)}.json").read_text()) for r in (0, 1)]
        for row in rows:
            n, layers = row["params4bit"], row["layer_bytes"]
            assert n >= 4 * len(layers) and row["mismatch"] == [], (folder, row)
            assert row["partitioned"] == row["bits_equal"] == row["state_equal"] == n, (folder, row)
            assert row["logits_equal"], (folder, row)
            assert row["whole_elements"] <= 2 * row["partition_elements"] <= row["whole_elements"] + n, (folder, row)
            assert row["held_at_handover"] == layers and sum(layers) == row["whole_4bit_bytes"], (folder, row)


def test_a_layer_is_handed_over_once_its_last_parameter_is_set_and_not_before(tiny_model, monkeypatch):
    """LayerPartitioner's counting, on the tiny Llama built on the meta device: a layer goes to DeepSpeed at its last
    parameter, in whatever order they come; a layer missing one (a weight the checkpoint lacks) is never handed over;
    names outside the layers (embeddings, head) and buffers change nothing."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from sftrecipes import quantload

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model))
    handed = []
    monkeypatch.setattr(quantload.LayerPartitioner, "_partition", lambda self, layer: handed.append(layer))
    part = quantload.LayerPartitioner(ds_config=None)
    names = [n for n, _ in model.named_parameters()]
    layer0 = [n for n in names if n.startswith("model.layers.0.")]
    layer1 = [n for n in names if n.startswith("model.layers.1.")]
    for name in ["model.embed_tokens.weight", *reversed(layer0[1:]), "model.layers.0.self_attn.rotary_emb.inv_freq"]:
        part.after_set(model, name)
    assert part.layers == 2 and handed == []  # one parameter of layer 0 still to come
    part.after_set(model, layer0[0])
    assert handed == [model.model.layers[0]]
    for name in layer1[:-1] + ["lm_head.weight", "model.norm.weight"]:
        part.after_set(model, name)
    assert handed == [model.model.layers[0]]  # layer 1 lacks its last parameter: it stays whole
