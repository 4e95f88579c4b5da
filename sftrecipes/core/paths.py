"""Where the repository's own folders are, in a leaf module: the root every shipped relative path is relative to,
the shipped recipes, the tiny stand-ins' data and build folder."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"  # the shipped recipes (edited by users; their relative paths are relative to ROOT)
DATA_DIR = ROOT / "data" / "tiny_chat"  # the small chat dataset shipped in the repository
ASSETS = ROOT / ".assets"  # tiny models built locally (ignored by git)
GENERATED_DOCS = ROOT / "docs" / "generated"  # pages written by commands (options.md, setups/), drift-tested
SWEEP_DOC = GENERATED_DOCS / "architectures.md"  # make sweep's table (bench/sweep.py): a measurement, not drift-tested
SWEEP_ROWS = GENERATED_DOCS / "architectures.json"  # the rows behind that table, so a clone reruns single entries


def runnable_recipes() -> list[Path]:
    """The shipped recipes a user runs (files under recipes/ whose name does not start with `_`: those are bases)."""
    return sorted(p for p in RECIPES.rglob("*.yaml") if not p.name.startswith("_"))
