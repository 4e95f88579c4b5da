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
