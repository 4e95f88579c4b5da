"""Test-only driver (tests/export/test_export.py): a ZeRO-3 LoRA run through train.run that ends with export.merge_in_run,
which every rank calls (ZeRO-3 parameters are gathered collectively); rank 0 writes <output_dir>/merged-in-run."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train  # noqa: E402
from sftrecipes.export import merge_in_run  # noqa: E402
from sftrecipes.recipe.load import load_recipe  # noqa: E402

if __name__ == "__main__":
    trainer, _ = train.run(load_recipe(sys.argv[1:]))
    merge_in_run(trainer, Path(trainer.args.output_dir) / "merged-in-run", dtype="float32")
