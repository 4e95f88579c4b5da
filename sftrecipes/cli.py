"""One entry point for everything but training (train.py):

    python -m sftrecipes tiny [--data] [--size tiny|medium] [--family F] [--out DIR]   offline tiny model / dataset
    python -m sftrecipes merge ADAPTER OUT [--base DIR] [--dtype D]        streaming LoRA merge
    python -m sftrecipes launch RECIPE [--key value ...] [--dry-run] [--force]   start any recipe on its processes
    python -m sftrecipes cp RECIPE|NAME DEST [--force]                     copy a recipe (e.g. tiny/ddp) to edit and launch
    python -m sftrecipes emit [RECIPE ...] [--check]                       configs/ and scripts/ from recipes
    python -m sftrecipes plan RECIPE [--key value ...]                     memory plan: breakdown, verdict, what would fit
    python -m sftrecipes preflight RECIPE [--key value ...] [--force]      can it start here? (exit 2 if not)
    python -m sftrecipes env RECIPE [--key value ...]                      environment its ranks need (export lines)
    python -m sftrecipes export SRC DEST [--dtype D] [--base DIR] [--verify]  run output/checkpoint -> loadable HF folder
    python -m sftrecipes demo                                              tiny LoRA run end to end on CPU
    python -m sftrecipes schema [--refresh | --docs]                       check/refresh the TRL and peft option snapshots, docs

Outside the repository root, call it as `python PATH/TO/sftrecipes VERB ...` (or with PYTHONPATH=PATH/TO).
Errors a user can fix print one line and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from . import paths
from .errors import RecipeError
from .schema import DTYPES
from .tiny import FAMILIES


def _tiny(ns) -> int:
    from . import tiny

    if ns.data:
        tiny.write_dataset()
        print(f"wrote {paths.DATA_DIR}")
        return 0
    if ns.family:
        if ns.out:
            print(tiny.build_family(ns.family, Path(ns.out)))
        else:
            print(tiny.ensure_family(ns.family))
        return 0
    out = Path(ns.out) if ns.out else (tiny.TINY_MODEL if ns.size == "tiny" else paths.ASSETS / f"{ns.size}-llama")
    print(tiny.ensure_tiny_model(out, ns.size))
    return 0


def _merge(ns) -> int:
    from .export import merge_lora

    print(merge_lora(ns.adapter, ns.out, base=ns.base, dtype=ns.dtype))
    return 0


def _schema(ns) -> int:
    from . import schema

    if ns.refresh:
        schema.write_trl_snapshot()
        schema.write_peft_snapshot()
        print(f"wrote {schema.TRL_SNAPSHOT} and {schema.PEFT_SNAPSHOT}")
    if ns.docs or ns.refresh:
        from .recipe import options_markdown
        from .paths import ROOT

        (ROOT / "docs" / "options.md").write_text(options_markdown())
        print("wrote docs/options.md")
        return 0
    for name, live, stored in (("trl_options.json", schema.trl_snapshot, schema.load_trl_snapshot),
                               ("peft_options.json", schema.peft_snapshot, schema.load_peft_snapshot)):
        if live() != stored()["options"]:
            print(f"error: sftrecipes/{name} differs from the installed library; run: python -m sftrecipes schema --refresh", file=sys.stderr)
            return 1
    print("trl_options.json and peft_options.json match the installed TRL and peft")
    return 0


def _emit(ns) -> int:
    from .launch import main as emit_main

    return emit_main(ns.args + (["--check"] if ns.check else []))


def _env(ns) -> int:
    """Shell `export` lines for the environment a rank of this recipe needs (launchers eval them)."""
    import shlex

    from .backends import launcher_env
    from .recipe import load_recipe

    for k, v in launcher_env(load_recipe(ns.args)).items():
        print(f"export {k}={shlex.quote(v)}")
    return 0


def _preflight(ns) -> int:
    from .preflight import before_launch
    from .recipe import load_recipe

    print(before_launch(load_recipe([a for a in ns.args if a != "--force"]), force="--force" in ns.args))
    return 0


def _launch(ns) -> int:
    from .launch import launch_main

    return launch_main(ns.args)


def _cp(ns) -> int:
    from .launch import cp_main

    return cp_main(ns.src, ns.dest, force=ns.force)


def _plan(ns) -> int:
    from .plan import main as plan_main

    return plan_main(ns.args)


def _export(ns) -> int:
    from .export import export

    print(export(ns.src, ns.dest, dtype=ns.dtype, base=ns.base, verify=ns.verify))
    return 0


def _demo(ns) -> int:
    from .demo import demo

    return demo()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sftrecipes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    t = sub.add_parser("tiny", help="build offline tiny assets")
    t.add_argument("--data", action="store_true", help="rewrite data/tiny_chat instead of building the model")
    t.add_argument("--size", default="tiny", choices=["tiny", "medium"])
    t.add_argument("--family", default=None, choices=sorted(FAMILIES),
                   help="a tiny model of another architecture (.assets/tiny-FAMILY): its config class, tokenizer habits, template")
    t.add_argument("--out", default=None)
    t.set_defaults(fn=_tiny)
    m = sub.add_parser("merge", help="merge a LoRA adapter into its base, streaming")
    m.add_argument("adapter")
    m.add_argument("out")
    m.add_argument("--base", default=None, help="base model folder or hub id (default: the adapter's base_model_name_or_path)")
    m.add_argument("--dtype", default=None, choices=DTYPES, help="output dtype (default: the base's)")
    m.set_defaults(fn=_merge)
    e = sub.add_parser("emit", help="render configs/ and scripts/ from recipes (--check: compare only)")
    e.add_argument("args", nargs="*", help="recipe files (default: every recipe under recipes/)")
    e.add_argument("--check", action="store_true", help="compare only; exit 1 naming stale files")
    e.set_defaults(fn=_emit)
    c = sub.add_parser("cp", help="copy a recipe (file, or name under recipes/ such as tiny/ddp) to edit and launch anywhere")
    c.add_argument("src", help="recipe file, or a name under recipes/ (tiny/ddp)")
    c.add_argument("dest", help="the copy (.yaml), or an existing folder")
    c.add_argument("--force", action="store_true", help="overwrite DEST")
    c.set_defaults(fn=_cp)
    for verb, fn, help_ in (("launch", _launch, "start RECIPE on the processes its launch section names (--dry-run: print the command; "
                                                "--force: past a memory plan that does not fit)"),
                            ("plan", _plan, "memory per GPU and per node for RECIPE: breakdown, verdict, strategies (exit 2: does not fit)"),
                            ("env", _env, "print the environment a rank of RECIPE needs, as export lines"),
                            ("preflight", _preflight, "check RECIPE can start here (hardware, memory); exit 2 if not")):
        v = sub.add_parser(verb, help=help_, prefix_chars="\0")
        v.add_argument("args", nargs="*", help="recipe file(s) and --key value overrides, as train.py takes them")
        v.set_defaults(fn=fn)
    x = sub.add_parser("export", help="turn a run's output into a folder transformers loads (merging LoRA adapters)")
    x.add_argument("src")
    x.add_argument("dest")
    x.add_argument("--base", default=None)
    x.add_argument("--dtype", default=None, choices=DTYPES)
    x.add_argument("--verify", action="store_true", help="reload the export and compare logits with the source (needs RAM for two fp32 copies)")
    x.set_defaults(fn=_export)
    d = sub.add_parser("demo", help="tiny LoRA fine-tune, merge, reload, generate")
    d.set_defaults(fn=_demo)
    s = sub.add_parser("schema", help="check or refresh the stored TRL option list")
    s.add_argument("--refresh", action="store_true", help="rewrite trl_options.json (and docs/options.md)")
    s.add_argument("--docs", action="store_true", help="rewrite docs/options.md")
    s.set_defaults(fn=_schema)
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        return ns.fn(ns)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
