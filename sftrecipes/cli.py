"""The command line's dispatch: `python -m sftrecipes VERB ARGS...` runs VERB's handler (the table VERBS), which
parses its own ARGS; everything but training (train.py) starts here.

    python -m sftrecipes tiny [--data] [--size tiny|medium] [--family F] [--out DIR]   offline tiny model / dataset
    python -m sftrecipes merge ADAPTER OUT [--base DIR] [--dtype D] [--verify]  streaming LoRA merge
    python -m sftrecipes launch RECIPE [--key value ...] [--dry-run] [--force]   start any recipe on its processes
    python -m sftrecipes prepare RECIPE [--key value ...] [--dry-run]      tokenize its data into the cache, no GPU
    python -m sftrecipes cp RECIPE|NAME DEST [--force]                     copy a recipe (e.g. tiny/ddp) to edit and launch
    python -m sftrecipes emit [RECIPE ...] [--check]                       configs/, scripts/, docs/generated/setups/
    python -m sftrecipes plan RECIPE [--key value ...]                     memory plan: breakdown, verdict, what would fit
    python -m sftrecipes preflight RECIPE [--key value ...] [--force]      can it start here? (exit 2 if not)
    python -m sftrecipes env RECIPE [--key value ...]                      environment its ranks need (export lines)
    python -m sftrecipes export SRC DEST [--dtype D] [--base DIR] [--verify]  run output/checkpoint -> loadable HF folder
    python -m sftrecipes export SRC DEST --to gguf [--quant q8_0] [--lora] [--verify]   -> GGUF (llama.cpp, Ollama)
    python -m sftrecipes chat RUN|FOLDER [--prompt TEXT] [--image PATH] [--system TEXT] [--temperature T] [--max_new_tokens N]
                                                                           talk to a trained run (an adapter on its base)
    python -m sftrecipes eval RUN|FOLDER --tasks a,b [--include_path DIR] [--limit N] [--apply_chat_template] [--compare-base]
                                                                           benchmark tasks by lm-evaluation-harness
    python -m sftrecipes demo                                              tiny LoRA run end to end on CPU
    python -m sftrecipes schema [--refresh | --docs]                       check/refresh the TRL and peft option snapshots, docs

Outside the repository root, call it as `python PATH/TO/sftrecipes VERB ...` (or with PYTHONPATH=PATH/TO).
Errors a user can fix print one line and exit 2. The verbs that take a recipe (launch, prepare, plan, preflight, env) take it
as train.py does: recipe file(s), then --key value overrides (`python train.py --help` lists the keys).
"""

from __future__ import annotations

import argparse
import difflib
import logging
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from sftrecipes import plan
from sftrecipes.core import paths
from sftrecipes.core.errors import RecipeError
from sftrecipes.facts import folders
from sftrecipes.launch import emit
from sftrecipes.launch import supervise as launch
from sftrecipes.launch.accelerate import launcher_env
from sftrecipes.launch.preflight import before_launch
from sftrecipes.recipe import copying as recipe_copy
from sftrecipes.recipe import schema
from sftrecipes.recipe.load import load_recipe
from sftrecipes.recipe.options_doc import options_markdown

PROG = "python -m sftrecipes"
OPTIONS_DOC = paths.GENERATED_DOCS / "options.md"  # the option table, written by `schema --docs` (make docs)


def _parser(verb: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"{PROG} {verb}", description=VERBS[verb][1])


def _recipe_args(verb: str, argv: list[str]) -> list[str] | None:
    """A recipe verb's ARGS as train.py takes them; None after printing its usage for -h/--help."""
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: {PROG} {verb} RECIPE.yaml [RECIPE.yaml ...] [--key value ...]\n\n{VERBS[verb][1]}\n\n"
              "The keys and their values: python train.py --help (or docs/generated/options.md).")
        return None
    return argv


def _tiny(argv: list[str]) -> int:
    return _run("tiny", _parser("tiny"), argv)


def _merge(argv: list[str]) -> int:
    p = _parser("merge")
    p.add_argument("adapter")
    p.add_argument("out")
    p.add_argument("--base", default=None, help="base model folder or hub id (default: the adapter's base_model_name_or_path)")
    p.add_argument("--dtype", default=None, choices=schema.DTYPES, help="output dtype (default: the base's)")
    p.add_argument("--verify", action="store_true", help="before publishing, compare the merged model's logits with peft's "
                   "unmerged adapter on the base (one line; exit 2 above the dtype's tolerance; needs RAM for two fp32 copies)")
    ns = p.parse_args(argv)
    folders.merge_base(folders.adapter_config(Path(ns.adapter)), ns.base)  # a wrong folder: one line before torch
    return _run("merge", ns)


def _export(argv: list[str]) -> int:
    p = _parser("export")
    p.add_argument("src")
    p.add_argument("dest")
    p.add_argument("--base", default=None)
    p.add_argument("--dtype", default=None, choices=schema.DTYPES)
    p.add_argument("--verify", action="store_true", help="reload the export and compare logits with the source (needs RAM "
                   "for two fp32 copies); --to gguf: llama.cpp against transformers on the run's own rows")
    p.add_argument("--to", default="hf", choices=("hf", "gguf"), help="hf: a folder transformers loads (default); gguf: "
                   "a GGUF file made by llama.cpp's own converter, with an Ollama Modelfile")
    p.add_argument("--quant", default=None, help="--to gguf: the GGUF type (f16, bf16, f32, q8_0, q4_k_m, q5_k_m, q6_k, "
                   "...; default f16)")
    p.add_argument("--lora", action="store_true", help="--to gguf: an adapter as a GGUF LoRA beside its base's GGUF, "
                   "instead of merged")
    ns = p.parse_args(argv)
    kind = folders.export_kind(Path(ns.src))  # a wrong folder: one line before torch
    if ns.to == "hf" and (ns.quant or ns.lora):
        raise RecipeError(f"export: {'--quant' if ns.quant else '--lora'} is for GGUF exports; add --to gguf")
    if ns.to == "gguf":
        from sftrecipes.facts import llamacpp

        llamacpp.require()
        ns.quant = llamacpp.check_quant(ns.quant or "f16")
        if ns.lora and kind == "model":
            raise RecipeError(f"export --lora: '{ns.src}' is a model, not a LoRA adapter; drop --lora to convert the model")
        if ns.lora and kind == "adapter":
            llamacpp.check_gguf_lora(folders.adapter_config(Path(ns.src)))
    if kind == "adapter":
        folders.merge_base(folders.adapter_config(Path(ns.src)), ns.base)
    return _run("export", ns)


def _emit(argv: list[str]) -> int:
    p = _parser("emit")
    p.add_argument("recipes", nargs="*", help="recipe files (default: every recipe under recipes/)")
    p.add_argument("--check", action="store_true", help="compare only; exit 1 naming stale files")
    ns = p.parse_args(argv)
    return emit.main(ns.recipes, check=ns.check)


def _cp(argv: list[str]) -> int:
    p = _parser("cp")
    p.add_argument("src", help="recipe file, or a name under recipes/ (tiny/ddp)")
    p.add_argument("dest", help="the copy (.yaml), or an existing folder")
    p.add_argument("--force", action="store_true", help="overwrite DEST")
    ns = p.parse_args(argv)
    return recipe_copy.main(ns.src, ns.dest, force=ns.force)


def _launch(argv: list[str]) -> int:
    args = _recipe_args("launch", argv)
    return 0 if args is None else launch.main(args)


def _prepare(argv: list[str]) -> int:
    """The recipe's data prepared into its cache entry (prepcache.py) in this one process: no torch.distributed, no
    GPU (a login node, a CPU job, the batch step of a SLURM script). launch's --dry-run and --force are accepted, so a
    script passes the same flags to both: --dry-run names the cache without preparing, --force changes nothing here."""
    args = _recipe_args("prepare", argv)
    if args is None:
        return 0
    dry = "--dry-run" in args
    recipe = load_recipe([a for a in args if a not in ("--dry-run", "--force")])
    return _run("prepare", recipe, dry)


def _plan(argv: list[str]) -> int:
    args = _recipe_args("plan", argv)
    return 0 if args is None else plan.main(args)


def _env(argv: list[str]) -> int:
    args = _recipe_args("env", argv)
    if args is None:
        return 0
    for k, v in launcher_env(load_recipe(args)).items():
        print(f"export {k}={shlex.quote(v)}")
    return 0


def _preflight(argv: list[str]) -> int:
    args = _recipe_args("preflight", argv)
    if args is None:
        return 0
    print(before_launch(load_recipe([a for a in args if a != "--force"]), force="--force" in args))
    return 0


def _chat(argv: list[str]) -> int:
    p = _parser("chat")
    p.add_argument("folder", help="a run's output_dir (an adapter: loaded on its base, not merged) or a model folder")
    p.add_argument("--prompt", default=None, help="answer this one message, print the answer and exit (for scripts)")
    p.add_argument("--system", default=None, help="a system prompt, kept across /reset")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default); above 0: sampled")
    p.add_argument("--max_new_tokens", type=int, default=256, help="the longest reply, in tokens")
    p.add_argument("--image", default=None, help="an image file the conversation's first message shows (a "
                   "vision-language model's run)")
    ns = p.parse_args(argv)
    if ns.temperature < 0:
        raise RecipeError(f"--temperature: {ns.temperature} is negative; use 0 for greedy or a positive value to sample")
    if ns.max_new_tokens < 1:
        raise RecipeError(f"--max_new_tokens: {ns.max_new_tokens} is not a positive number of tokens; e.g. 256")
    folder = Path(ns.folder)
    _model_folder("chat", folder)
    ns.folder = folder
    if ns.image is not None:
        _chat_image(folder, Path(ns.image))
    return _run("chat", ns)


def _chat_image(folder: Path, image: Path) -> None:
    """--image: a file, and a model that can see it (its config declares a vision tower), checked torch-free."""
    from sftrecipes.facts import startmodel
    from sftrecipes.recipe.images import vision_tower

    from PIL import Image

    if not image.is_file():
        raise RecipeError(f"--image: {image} is not a file; give the path of an image file (PNG, JPEG, ...)")
    try:
        with Image.open(image) as im:
            im.verify()
    except (OSError, SyntaxError) as e:  # (PIL's UnidentifiedImageError is an OSError; a broken PNG, a SyntaxError)
        raise RecipeError(f"--image: {image} cannot be read as an image ({type(e).__name__}); give a PNG, JPEG, ... "
                          "file") from None
    adapter = startmodel.adapter_of(str(folder))
    model = startmodel.base_of(adapter) if adapter is not None else str(folder)
    if not vision_tower(model):
        raise RecipeError(f"--image: {model} has no vision tower (its config.json declares no vision_config), so it "
                          "cannot see the image; chat with a vision-language model's run, or leave --image out")


def _model_folder(verb: str, folder: Path) -> None:
    """A folder `verb` can load a model from, checked torch-free: a model (config.json), or a LoRA adapter whose base
    is there and unquantized; else one line naming what it is and the export that makes it one."""
    if not folder.is_dir():
        raise RecipeError(f"{verb}: '{folder}' is not a folder; give a run's output_dir or a model folder")
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        folders.merge_base(folders.adapter_config(folder), None)
    elif not (folder / "config.json").is_file():  # a checkpoint, or a run's folder holding checkpoints only
        ckpts = sorted((p for p in folder.glob("checkpoint-*") if p.is_dir()), key=folders.natural_key)
        src = ckpts[-1] if ckpts else folder
        try:
            exportable = folders.export_kind(src) in ("zero", "dcp", "adapter", "model")
        except RecipeError:
            exportable = False
        fix = (f"export it first (python -m sftrecipes export {src} {folder.name}-export) and {verb} that folder"
               if exportable else "give a run's output_dir after training, or a model folder")
        raise RecipeError(f"{verb}: '{folder}' holds no model (config.json) and no LoRA adapter (adapter_config.json)"
                          + (f" but {', '.join(p.name for p in ckpts)}" if ckpts else "") + f"; {fix}")


def _eval(argv: list[str]) -> int:
    p = _parser("eval")
    p.add_argument("folder", help="a run's output_dir (an adapter: peft on its base) or a model folder")
    p.add_argument("--tasks", required=True, help="lm-evaluation-harness task names, comma-separated")
    p.add_argument("--include_path", default=None, help="a folder of task YAML files of your own (local tasks)")
    p.add_argument("--limit", type=float, default=None, help="at most this many documents a task (below 1: a fraction)")
    p.add_argument("--apply_chat_template", action="store_true", help="prompts through the model's chat template")
    p.add_argument("--num_fewshot", type=int, default=None)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--compare-base", dest="compare_base", action="store_true",
                   help="score the base model too (an adapter's base, or --base) and show both side by side")
    p.add_argument("--base", default=None, help="the base model to compare with (default: the adapter's base)")
    ns = p.parse_args(argv)
    folder = Path(ns.folder)
    _model_folder("eval", folder)
    tasks = [t.strip() for t in ns.tasks.split(",") if t.strip()]
    if not tasks:
        raise RecipeError("--tasks: no task named; e.g. --tasks hellaswag,arc_easy")
    if ns.include_path is not None and not Path(ns.include_path).is_dir():
        raise RecipeError(f"--include_path: '{ns.include_path}' is not a folder; give the folder that holds your task YAML files")
    if ns.limit is not None and ns.limit <= 0:
        raise RecipeError(f"--limit: {ns.limit:g} is not positive; give a number of documents (or a fraction below 1)")
    if ns.compare_base and ns.base is None and not (folder / "adapter_config.json").is_file():
        raise RecipeError(f"--compare-base: '{folder}' is a model, not an adapter, so its base is not known; add --base BASE")
    ns.folder, ns.tasks = folder, tasks
    return _run("eval", ns)


def _demo(argv: list[str]) -> int:
    _parser("demo").parse_args(argv)
    return _run("demo")


def _schema(argv: list[str]) -> int:
    p = _parser("schema")
    p.add_argument("--refresh", action="store_true", help="rewrite trl_options.json, trl_methods.json and peft_options.json (and the option table)")
    p.add_argument("--docs", action="store_true", help=f"rewrite {OPTIONS_DOC.relative_to(paths.ROOT)}")
    ns = p.parse_args(argv)
    if ns.refresh:
        _run("refresh_snapshots")
    if ns.docs or ns.refresh:
        OPTIONS_DOC.parent.mkdir(parents=True, exist_ok=True)
        OPTIONS_DOC.write_text(options_markdown())
        print(f"wrote {OPTIONS_DOC.relative_to(paths.ROOT)}")
        return 0
    return _run("check_snapshots")


def _run(verb: str, *args) -> int:
    """The part of a verb that loads the training stack (verbs.py), imported only when that verb runs: every other
    verb (plan, launch, emit, cp, env, preflight, --help) stays torch-free."""
    from sftrecipes import verbs

    return getattr(verbs, verb)(*args)


# verb -> (handler(ARGS) -> exit code, one line of help), in the order the usage lists them
VERBS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "tiny": (_tiny, "build offline tiny assets (model, tokenizer, chat data)"),
    "merge": (_merge, "merge a LoRA adapter into its base, streaming"),
    "launch": (_launch, "start RECIPE on the processes its launch section names (--dry-run: print the command; "
                        "--force: past a memory plan that does not fit)"),
    "prepare": (_prepare, "tokenize RECIPE's data into its cache (data_cache_dir) in one process, without GPUs or "
                          "torch.distributed; launch and train.py then read it (--dry-run: say where)"),
    "cp": (_cp, "copy a recipe (file, or name under recipes/ such as tiny/ddp) to edit and launch anywhere"),
    "emit": (_emit, "render configs/, scripts/ and docs/generated/setups/ from recipes (--check: compare only)"),
    "plan": (_plan, "memory per GPU and per node for RECIPE: breakdown, verdict, strategies (exit 2: does not fit)"),
    "preflight": (_preflight, "check RECIPE can start here (hardware, memory); exit 2 if not (--force: past the memory verdict)"),
    "env": (_env, "print the environment a rank of RECIPE needs, as export lines"),
    "export": (_export, "turn a run's output into a folder transformers loads (merging LoRA adapters), or a GGUF"),
    "chat": (_chat, "talk to a trained run or a model folder in the terminal, with the run's own chat template"),
    "eval": (_eval, "score a trained run or a model folder on benchmark tasks (lm-evaluation-harness)"),
    "demo": (_demo, "tiny LoRA fine-tune, merge, reload, generate"),
    "schema": (_schema, "check or refresh the stored TRL and peft option lists (--docs: rewrite the option table)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n", 1)[1].rstrip(), file=sys.stdout if argv else sys.stderr)  # the verbs, not the first line
        return 0 if argv else 2
    verb, args = argv[0], argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        if verb not in VERBS:
            close = difflib.get_close_matches(verb, VERBS, n=1)
            raise RecipeError(f"unknown verb '{verb}'; " + (f"did you mean {close[0]}?" if close else f"use one of {', '.join(VERBS)}"))
        return VERBS[verb][0](args)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
