"""4-bit weights partitioned as they load under ZeRO-3 and FSDP2 (sftrecipes/model/quantload.py), on 2 ranks: what each
rank computes with is the whole load's, bit for bit, and no rank held more than one layer's 4-bit weights whole while
loading."""

import json
import os

from conftest import FAMILIES, accelerate_launch

from sftrecipes.core.paths import ASSETS
from sftrecipes.tiny import ensure_tiny_model


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


def test_4bit_layers_sent_by_rank0_and_kept_by_rows_bit_for_bit_under_fsdp2(tiny_model, family_models, tmp_path, monkeypatch):
    """The QLoRA FSDP2 twin's loading (fsdp_cpu_ram_efficient_loading: rank 0 reads and quantizes, each decoder layer
    sent once quantized, every rank keeping its FSDP2 rows) of the tiny Llama, the 25.7M one (weights large enough
    for whole pages) and every family's tiny model, in one launch (tests/quantload_driver.py), against the whole
    load every rank reads (RAM-efficient loading off): the rows kept are torch.chunk's, only their pages are resident
    (none wholly outside them), rank 0 held exactly the layer being sent whole at each sending (the earlier ones kept
    by rows) and rank 1 never a whole one; once accelerate's FSDP2 preparation wrapped the model, check_kept_rows
    finds FSDP2 took the kept rows, and the packed bytes each Linear4bit computes with in a forward pass (gathered by
    FSDP2), the shards gathered and the quantization state equal the whole load's bit for bit; the logits are equal."""
    out = tmp_path / "q"
    medium = ensure_tiny_model(ASSETS / "medium-llama", "medium")
    folders = [str(tiny_model), str(medium)] + [str(family_models[f]) for f in FAMILIES]
    monkeypatch.setenv("QUANTLOAD_MODELS", os.pathsep.join(folders))
    accelerate_launch("recipes/tiny/qlora-fsdp.yaml", out, "tests/quantload_driver.py")
    page = os.sysconf("SC_PAGE_SIZE")
    for folder in folders:
        rows = [json.loads((out / f"rank{r}-{os.path.basename(folder)}.json").read_text()) for r in (0, 1)]
        for row in rows:
            n, layers = row["params4bit"], row["layer_bytes"]
            assert n >= 4 * len(layers) and row["mismatch"] == [] and row["problems"] == [], (folder, row)
            assert row["kept"] == row["rows_as_chunked"] == row["checked_after_wrap"] == n, (folder, row)
            assert row["computed"] == row["bits_equal"] == row["gathered_equal"] == row["state_equal"] == n, (folder, row)
            assert row["logits_equal"] and row["pages_outside"] == 0, (folder, row)
            if folder == str(medium):  # its weights span whole pages: each rank's half of them is resident
                assert row["pages_mine"] * page >= 0.95 * row["whole_4bit_bytes"] / 2, (folder, row)
        assert rows[0]["held_at_handover"] == rows[0]["layer_bytes"], (folder, rows[0])
        assert sum(rows[0]["layer_bytes"]) == rows[0]["whole_4bit_bytes"] and rows[1]["held_at_handover"] == [], folder


def test_a_layer_is_handed_over_once_its_last_parameter_is_set_and_not_before(tiny_model, monkeypatch):
    """LayerPartitioner's counting, on the tiny Llama built on the meta device: a layer goes to DeepSpeed at its last
    parameter, in whatever order they come; a layer missing one (a weight the checkpoint lacks) is never handed over;
    names outside the layers (embeddings, head) and buffers change nothing."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from sftrecipes.model import quantload

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


def test_kept_rows_are_the_chunk_fsdp2_takes():
    """quantload.kept_rows against FSDP2's own cut (torch.distributed.fsdp's _chunk_with_empty at dim 0) for every
    row count up to 40 over 1 to 9 ranks: short and empty last chunks included."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from sftrecipes.model.quantload import kept_rows

    for n in range(41):
        rows = torch.arange(n)
        for world in range(1, 10):
            for rank, chunk in enumerate(_chunk_with_empty(rows, world, dim=0)):
                a, b = kept_rows(n, rank, world)
                assert rows[a:b].tolist() == chunk.tolist(), (n, world, rank)
