"""The parts of the command line's verbs that load the training stack (tiny, merge, export, prepare, chat, eval, demo, the live
option snapshots): cli.py parses and checks a verb's arguments torch-free, then calls here (cli._run)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sftrecipes import tiny as tinies
from sftrecipes.core import paths
from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe import snapshots
from sftrecipes.recipe.evalonly import eval_only, why


def tiny(p: argparse.ArgumentParser, argv: list[str]) -> int:
    p.add_argument("--data", action="store_true", help="rewrite data/tiny_chat instead of building the model")
    p.add_argument("--size", default="tiny", choices=["tiny", "medium"])
    from sftrecipes.model.tinyvision import VISION

    p.add_argument("--family", default=None, choices=sorted(set(tinies.FAMILIES) | set(VISION)),
                   help="a tiny model of another architecture (.assets/tiny-FAMILY): its config class, tokenizer habits, template")
    p.add_argument("--vision", action="store_true", help="with --family: its vision-language model and processor "
                   f"(.assets/tiny-FAMILY-vision; {', '.join(sorted(VISION))})")
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    if ns.data:
        tinies.write_dataset()
        print(f"wrote {paths.DATA_DIR}")
        return 0
    if ns.vision:
        if ns.family not in VISION:
            raise RecipeError(f"--vision: {'no --family given' if not ns.family else f'no tiny vision-language model of {ns.family}'}; "
                              f"give --family {' or '.join(sorted(VISION))}")
        print(tinies.build_vision_family(ns.family, Path(ns.out)) if ns.out else tinies.ensure_vision_family(ns.family))
        return 0
    if ns.family not in (None, *tinies.FAMILIES):
        raise RecipeError(f"--family: {ns.family} is a vision-language family here; add --vision, or give one of "
                          f"{', '.join(sorted(tinies.FAMILIES))}")
    if ns.family:
        print(tinies.build_family(ns.family, Path(ns.out)) if ns.out else tinies.ensure_family(ns.family))
        return 0
    out = Path(ns.out) if ns.out else (tinies.TINY_MODEL if ns.size == "tiny" else paths.ASSETS / f"{ns.size}-llama")
    print(tinies.ensure_tiny_model(out, ns.size))
    return 0


def merge(ns: argparse.Namespace) -> int:
    from sftrecipes.export import merge_lora

    print(merge_lora(ns.adapter, ns.out, base=ns.base, dtype=ns.dtype, verify=ns.verify))
    return 0


def export(ns: argparse.Namespace) -> int:
    if ns.to == "gguf":
        from sftrecipes.export.gguf import export_gguf

        record = export_gguf(ns.src, ns.dest, quant=ns.quant, verify=ns.verify, lora=ns.lora, base=ns.base, dtype=ns.dtype)
        for name, size in record["files"].items():
            print(f"{Path(ns.dest) / name}  ({size / 1e6:,.1f} MB)")
        print(f"{Path(ns.dest) / 'Modelfile'}  (ollama create NAME -f {Path(ns.dest) / 'Modelfile'})")
        return 0
    from sftrecipes.export import export as export_run

    print(export_run(ns.src, ns.dest, dtype=ns.dtype, base=ns.base, verify=ns.verify))
    return 0


def prepare(recipe, dry: bool) -> int:
    """The recipe's data prepared into its cache entry (data/prepcache.py) in this one process (cli._prepare)."""
    from sftrecipes.data import prepcache

    if dry:
        print(f"prepare: would prepare the data of {recipe.sources[-1] if recipe.sources else 'the flags'} into {prepcache.cache_root(recipe)} "
              "(--dry-run: nothing prepared)")
        return 0
    from sftrecipes.data.load import prepared_datasets
    from sftrecipes.data.tokenizer import load_tokenizer

    if eval_only(recipe):  # what the evaluation reads: its eval split (no train split, no merged start model)
        return _prepare_evaluation(recipe, load_tokenizer)
    from sftrecipes.export.startfrom import ensure

    merged = ensure(recipe.model.model_name_or_path, recipe.run.heartbeat_timeout)  # before any rank starts, as the data
    if merged is not None:
        print(f"prepare: the start model: {recipe.model.model_name_or_path} merged into its base in {merged}")
    if recipe.method != "sft":  # (a SLURM script runs prepare before any recipe: it goes on to the ranks)
        print(f"prepare: method {recipe.method}: TRL's {recipe.method.upper()}Trainer tokenizes the rows in the run "
              "itself, so nothing is cached in data_cache_dir; nothing more to prepare")
        return 0
    if recipe.data.streaming:
        print("prepare: streaming: the training rows are prepared as the run reads them (stream.py), so nothing is "
              "cached in data_cache_dir; nothing more to prepare")
        return 0
    tokenizer, eot, _ = load_tokenizer(recipe)
    *_, counts = prepared_datasets(recipe, tokenizer, eot)
    p = counts["preparation"]
    splits = ", ".join(f"{s} {counts[s]['read']} read, {counts[s]['kept']} kept" for s in ("train", "eval") if s in counts)
    how = {"built": "built", "waited": "built by another process (waited)", "reused": "reused"}[p["how"]]
    print(f"prepare: {p['path']}: {how}; {p['rows']} rows ({splits}); prepared in {p['build_seconds']:.2f}s at "
          f"{p['rows_per_s']:.0f} rows/s; this command's data step {p['seconds']:.2f}s")
    return 0


def _prepare_evaluation(recipe, load_tokenizer) -> int:
    """prepare for an evaluation-only recipe: the eval splits the run evaluates read (a hub dataset downloaded into
    datasets' cache), checked and tokenized as the run does (evaluate.eval_dataset), to say what the run will evaluate;
    nothing is written to data_cache_dir (the run prepares its eval rows itself), no train split is read (but for
    val_set_size's held-out rows), and an adapter is not merged (the run evaluates it on its base)."""
    from sftrecipes.train.evaluate import eval_dataset

    tokenizer, eot, _ = load_tokenizer(recipe)
    _, counts, read = eval_dataset(recipe, tokenizer, eot)
    print(f"prepare: {why(recipe)}: evaluation only: {', '.join(read)}: {counts['read']} read, {counts['kept']} kept, "
          "checked as the run reads them; nothing cached in data_cache_dir (the run prepares its eval rows itself), "
          f"{'the train split read for the rows val_set_size holds out' if 'held_out' in counts else 'no train split read'}, "
          "no start model merged (an adapter is evaluated on its base)")
    return 0


def chat(ns: argparse.Namespace) -> int:
    from sftrecipes.use import chat as chats

    return chats.main(ns.folder, ns.prompt, ns.system, ns.temperature, ns.max_new_tokens, image=ns.image)


def eval(ns: argparse.Namespace) -> int:  # noqa: A001 - the verb's name
    from sftrecipes.use import lmeval

    lmeval.main(ns.folder, ns.tasks, ns.include_path, ns.limit, ns.apply_chat_template, ns.compare_base, ns.base,
                ns.num_fewshot, ns.batch_size)
    return 0


def demo() -> int:
    from sftrecipes.demo import demo as run_demo

    return run_demo()


def refresh_snapshots() -> int:
    from sftrecipes.train import options

    options.write_trl_snapshot()
    options.write_methods_snapshot()
    options.write_peft_snapshot()
    print(f"wrote {snapshots.TRL_SNAPSHOT}, {snapshots.METHODS_SNAPSHOT} and {snapshots.PEFT_SNAPSHOT}")
    return 0


def check_snapshots() -> int:
    from sftrecipes.train import options

    methods = snapshots.load_methods_snapshot
    for name, live, stored in (("trl_options.json", options.trl_snapshot, lambda: snapshots.load_trl_snapshot()["options"]),
                               ("trl_methods.json", options.methods_snapshot,
                                lambda: {m: rows for m, rows in methods().items() if m != "trl_version"}),
                               ("peft_options.json", options.peft_snapshot, lambda: snapshots.load_peft_snapshot()["options"])):
        if live() != stored():
            print(f"error: sftrecipes/recipe/{name} differs from the installed library; run: python -m sftrecipes schema --refresh", file=sys.stderr)
            return 1
    print("trl_options.json, trl_methods.json and peft_options.json match the installed TRL and peft")
    return 0
