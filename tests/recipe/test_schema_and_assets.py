"""Checked-in generated files never drift: TRL's and peft's option snapshots, the tiny dataset; tiny builds are deterministic."""

import hashlib
import json

from sftrecipes import tiny
from sftrecipes.recipe import schema
from sftrecipes.recipe import snapshots
from sftrecipes.train import options
from sftrecipes.cli import OPTIONS_DOC
from sftrecipes.core.paths import DATA_DIR


def test_trl_snapshot_matches_installed_trl():
    stored = snapshots.load_trl_snapshot()
    import trl

    assert stored["trl_version"] == trl.__version__, "run: make schema"
    assert stored["options"] == options.trl_snapshot(), "sftrecipes/recipe/trl_options.json is stale; run: make schema"


def test_peft_snapshot_matches_installed_peft():
    """peft's LoraConfig fields, stored for torch-free validation; each field is a recipe key or has its reason."""
    import peft

    stored = snapshots.load_peft_snapshot()
    assert stored["peft_version"] == peft.__version__, "run: make schema"
    assert stored["options"] == options.peft_snapshot(), "sftrecipes/recipe/peft_options.json is stale; run: make schema"
    fields = {row["name"] for row in stored["options"]}
    assert set(schema.PEFT_NOT_EXPOSED) <= fields, "PEFT_NOT_EXPOSED names a field peft no longer has"
    exposed = {n for n, o in schema.all_options().items() if o.owner == "peft"}
    assert exposed == fields - set(schema.PEFT_NOT_EXPOSED)


def test_project_options_do_not_shadow_trl():
    trl_names = {row["name"] for row in snapshots.load_trl_snapshot()["options"]}
    for cls in schema.SECTIONS.values():
        assert not trl_names & set(cls.__dataclass_fields__)
    assert set(schema.ALIASES.values()) <= set(schema.all_options())


def test_shipped_dataset_is_what_the_generator_writes(tmp_path):
    tiny.write_dataset(tmp_path)
    for split in ("train", "test"):
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (DATA_DIR / f"{split}.jsonl").read_bytes(), "run: make data"
    rows = [json.loads(ln) for ln in (DATA_DIR / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 320 and all(r["messages"][-1]["role"] == "assistant" for r in rows)


def digest(folder):
    h = hashlib.sha256()
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        h.update((folder / name).read_bytes())
    return h.hexdigest()


def test_tiny_model_build_is_deterministic(tmp_path, tiny_model):
    a = tiny.build_model(tmp_path / "a")
    assert digest(a) == digest(tiny_model)


def test_options_doc_is_current():
    from sftrecipes.recipe.options_doc import options_markdown

    assert OPTIONS_DOC.read_text() == options_markdown(), "run: make docs"
