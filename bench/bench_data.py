#!/usr/bin/env python
"""`make bench-data`: data preparation's rows/s, this project's (data.load_datasets) against TRL's own (SFTTrainer's
dataset preparation) on the same synthetic multi-turn chat rows, and whether the two give the same tokens and labels.

    python bench/bench_data.py [--rows 50000,200000] [--short_rows 50000] [--repeats 1] [--reference_rows 50000]
                               [--scale_rows 100000,1000000] [--only_scale] [--no-docs]

The rows: synthetic conversations under a fixed seed, written once as jsonl: multi-turn (`--rows`: tiny.py's question
kinds, 1-6 user/assistant exchanges, each question said 1-3 times and each answer 1-4 times, a system turn in ~30% of
them; ~160 tokens, some past max_length) and short (`--short_rows`: data/tiny_chat's own generator,
tiny.make_conversations: 1-2 exchanges, ~40 tokens), since TRL's time per row hardly depends on its length and ours
mostly does (the tokenizer's encode). Every run is
a fresh process with a fresh datasets cache (HF_DATASETS_CACHE in a temporary folder), so every row is prepared; the
jsonl is read into that cache before the clock starts, and each side's clock covers its preparation only:
- ours: `data.load_datasets` on recipes/tiny/lora.yaml pointed at the file (`--splits train`): the tiny Llama's
  tokenizer with the recipe's chatml template, max_length 256, add_special_tokens false, loss on every token; worker
  processes as `dataset_num_proc` unset picks them (tokenization.workers);
- ours, one process: the same with its workers held to this one process;
- per-row: the same with each row prepared by the per-row reference (`tokenization._prepare_row` mapped row by row,
  as tokenize_split mapped it before batching), on the sizes up to --reference_rows;
- ours, streamed: one data epoch through `streaming: true` (stream.Stream, one process as each rank runs it, the
  recipe's bfd packing, buffers of 10,000 rows), with the peak resident memory over the epoch;
- TRL: `SFTTrainer(...)` built with the same tokenizer (its template and eos as load_tokenizer set them), the tiny
  Llama, `max_length` 256, packing off and `dataset_num_proc` unset (TRL's default: one process); the clock covers its
  `_prepare_dataset` (tokenize, labels, truncation, drop of fully masked rows). Packing, TRL's step after preparation
  in both pipelines, is left out of both.
Runs alternate (TRL, ours, ...) `--repeats` times per size; each figure is the best run, since load from neighbours on
a shared machine only adds time. The tokens and labels of the last run of each side are compared row by row.

At scale (bench/data_scale.py; `--scale_rows`, multi-turn rows; `--only_scale` runs these alone): `python -m
sftrecipes prepare` of the file as a user runs it (its own process, imports included; a fresh data_cache_dir and
HF_DATASETS_CACHE), measured from outside: rows/s as it says them, the peak RSS of its largest process (the preparer or one of datasets' workers:
each one's kernel high-water mark, the largest kept: getrusage(RUSAGE_CHILDREN) of a wrapper), the PSS of all of them
together sampled every 0.5 s, the disk the cache entry and datasets' cache take (st_blocks), sampled during the run
and measured after it, and the tokens the entry holds.

Results are printed and written into docs/benchmarks.md between the data-bench markers (the rest is kept); the scale
table has markers of its own inside that section, so `--only_scale` rewrites it alone and a run without scale rows
keeps it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from data_scale import SCALE_END, SCALE_START, scale_report, scale_run

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- data-bench:start -->", "<!-- data-bench:end -->"
RECIPE = "recipes/tiny/lora.yaml"
SEED = 1234
KINDS = {"trl": "TRL SFTTrainer", "ours": "ours", "ours_one": "ours, one process", "per_row": "per-row reference",
         "stream": "ours, streamed"}
SHAPES = {"multi-turn": "1-6 exchanges", "short": "tiny_chat's shape"}
GOAL = 10.0


def write_rows(path: Path, n: int, shape: str = "multi-turn", seed: int = SEED) -> None:
    """n conversations of a shape (SHAPES), the same for a given seed (see the module docstring)."""
    sys.path.insert(0, str(ROOT))
    from sftrecipes.tiny import _SYSTEMS, _turn, make_conversations

    if shape == "short":
        path.write_text("".join(json.dumps(row) + "\n" for row in make_conversations(n, seed)))
        return
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            messages = [{"role": "system", "content": rng.choice(_SYSTEMS)}] if rng.random() < 0.3 else []
            for _ in range(rng.randint(1, 6)):
                q, a = _turn(rng)
                messages += [{"role": "user", "content": " ".join([q] * rng.randint(1, 3))},
                             {"role": "assistant", "content": " ".join([a] * rng.randint(1, 4))}]
            f.write(json.dumps({"messages": messages}) + "\n")


# ------------------------------------------------------------------------------------------ one run (a child process)


def child(kind: str, rows_file: str, out: str) -> dict:
    """One preparation of rows_file in this (fresh) process; its tokens and labels saved to out."""
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    import datasets

    from sftrecipes.data import load as data
    from sftrecipes.data import tokenization
    from sftrecipes.recipe.load import load_recipe
    from sftrecipes.data.tokenizer import load_tokenizer

    datasets.utils.logging.disable_progress_bar()
    recipe = load_recipe([RECIPE, "--dataset_name", rows_file, "--splits", "train", "--output_dir", str(Path(out) / "o")])
    tok, eot, _ = load_tokenizer(recipe)
    if kind == "stream":
        return streamed(rows_file, out, tok, eot)
    raw = data.load_raw(recipe)[0]  # read into this run's cache before the clock starts
    n = len(raw)
    workers = 1
    if kind == "trl":
        from transformers import AutoModelForCausalLM
        from trl import SFTConfig, SFTTrainer

        seconds = []
        real = SFTTrainer._prepare_dataset

        def timed(self, *a, **kw):
            t = time.perf_counter()
            result = real(self, *a, **kw)
            seconds.append(time.perf_counter() - t)
            return result

        SFTTrainer._prepare_dataset = timed
        args = SFTConfig(output_dir=str(Path(out) / "o"), max_length=recipe.trl_value("max_length"), packing=False,
                         report_to="none", use_cpu=True, bf16=False)
        model = AutoModelForCausalLM.from_pretrained(recipe.model.model_name_or_path)
        prepared = SFTTrainer(model=model, args=args, train_dataset=raw, processing_class=tok).train_dataset
        seconds = sum(seconds)
    else:
        if kind == "ours_one":
            tokenization.ROWS_PER_WORKER = 1 << 60  # workers() then keeps this process
        if kind == "per_row":  # the per-row reference, mapped as tokenize_split mapped it before batching
            def per_row(recipe, tokenizer, eot, dataset, name, fmt, source=None, rows=None):
                return dataset.map(tokenization._prepare_row, with_indices=True, remove_columns=dataset.column_names,
                                   fn_kwargs={"tokenizer": tokenizer, "recipe": recipe, "eot": eot, "fmt": fmt,
                                              "ends": tokenization.end_ids(tokenizer, eot), "source": source or name,
                                              "rows": rows, "structs": (False, False)},
                                   num_proc=recipe.trl_value("dataset_num_proc"))

            data.tokenize_split = per_row
        else:
            workers = tokenization.workers(recipe, n) or 1
        t = time.perf_counter()
        prepared = data.load_datasets(recipe, tok, eot)[0]
        seconds = time.perf_counter() - t
    prepared.select_columns(["input_ids", "labels"]).save_to_disk(str(Path(out) / "prepared"))
    return {"kind": kind, "rows": n, "seconds": seconds, "rows_per_s": n / seconds, "workers": workers, "kept": len(prepared)}


def streamed(rows_file: str, out: str, tok, eot) -> dict:
    """One data epoch of rows_file through `streaming: true` (stream.Stream, as each rank reads it: one process, the
    recipe's bfd packing, buffers of 10,000 rows): rows/s of its preparation, and the peak of this process's resident
    memory over the epoch above its resident memory at the start (the kernel's high-water mark, reset there)."""
    import gc

    from sftrecipes.train import probes
    from sftrecipes.data import stream as streams
    from sftrecipes.recipe.load import load_recipe

    recipe = load_recipe([RECIPE, "--dataset_name", rows_file, "--splits", "train", "--output_dir", str(Path(out) / "o"),
                          "--streaming", "true", "--max_steps", "1"])
    stream = streams.Stream(recipe, tok, eot)
    gc.collect()
    start = probes.rss_mb()
    probes._reset_peak()
    t = time.perf_counter()
    given = 0
    for _ in stream.rows():
        if stream.epoch == 1:
            break
        given += 1
    seconds = time.perf_counter() - t  # (includes the first buffer of epoch 1: 10,000 rows more than counted)
    read = stream.counts["read"]
    return {"kind": "stream", "rows": read, "seconds": seconds, "rows_per_s": read / seconds, "workers": 1,
            "kept": stream.counts["kept"], "packed_rows": given, "rss_start_mb": round(start, 1),
            "peak_growth_mb": round(probes._status()["VmHWM"] - start, 1),
            "file_mb": round(Path(rows_file).stat().st_size / 1e6, 1)}


def one_run(kind: str, rows_file: Path, tmp: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=tmp))
    env = {**os.environ, "HF_DATASETS_CACHE": str(out / "cache"), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, __file__, "--child", kind, str(rows_file), str(out)], env=env, cwd=ROOT,
                       capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"bench-data: the {kind} run failed:\n{p.stderr[-3000:]}")
    result = json.loads(p.stdout.strip().splitlines()[-1])
    result["out"] = str(out / "prepared")
    return result


# ------------------------------------------------------------------------------------------ agreement and the report


def agreement(ours: str, theirs: str) -> dict:
    """Rows whose input_ids and labels are the same in both preparations (row i against row i)."""
    import datasets
    import numpy as np

    a, b = datasets.load_from_disk(ours), datasets.load_from_disk(theirs)
    if len(a) != len(b):
        return {"rows": (len(a), len(b)), "same": None}
    same = np.ones(len(a), dtype=bool)
    lengths = None
    for column in ("input_ids", "labels"):
        x, y = (d.data.column(column).combine_chunks() for d in (a, b))
        ox, oy = np.asarray(x.offsets), np.asarray(y.offsets)
        vx, vy = np.asarray(x.values, dtype=np.int64), np.asarray(y.values, dtype=np.int64)
        lengths = np.diff(ox)
        same &= lengths == np.diff(oy)
        for i in np.flatnonzero(same):
            if not np.array_equal(vx[ox[i]:ox[i + 1]], vy[oy[i]:oy[i + 1]]):
                same[i] = False
    return {"rows": (len(a), len(b)), "same": int(same.sum()), "tokens_per_row": float(lengths.mean()),
            "cut": int((lengths == 256).sum())}


def best(runs: list[dict]) -> dict:
    """The fastest run: a neighbour's load on a shared machine only ever adds time (timeit's rule)."""
    return max(runs, key=lambda r: r["rows_per_s"])


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    import datasets
    import tokenizers
    import transformers
    import trl

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"Python {platform.python_version()}, transformers {transformers.__version__}, trl {trl.__version__}, "
            f"datasets {datasets.__version__}, tokenizers {tokenizers.__version__}; {cpu}, {cores} usable cores")


def report(results: dict[tuple[str, int], dict[str, list[dict]]], agree: dict[tuple[str, int], dict], argv: list[str],
           seconds: float, load: str, scale: str = "") -> str:
    lines = [START, "## Data preparation", "",
             f"`{shlex.join(['python', 'bench/bench_data.py', *argv])}` (`make bench-data`), "
             f"{datetime.date.today().isoformat()}, {seconds / 60:.1f} min in all. {machine()}. {load}", "",
             "Synthetic chat rows under a fixed seed (bench/bench_data.py: multi-turn, 1-6 exchanges; short, tiny_chat's "
             "1-2 exchanges; a system turn in ~30%), the tiny Llama's tokenizer with recipes/tiny/lora.yaml's chatml template, max_length 256, loss on every "
             "token. Each run is a fresh process with a fresh datasets cache, its clock on the preparation only "
             "(ours: `data.load_datasets`; TRL: `SFTTrainer._prepare_dataset` as its constructor calls it, packing "
             "off, one process as its default); each figure is the best of its runs.", "",
             "| rows | tokens / row (cut at 256) | TRL rows/s | ours rows/s (workers) | ours / TRL | ours, one process rows/s "
             "| one process / TRL | per-row reference rows/s | same ids and labels as TRL | goal ≥ 10x TRL |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for (shape, n), by in results.items():
        trl, ours, one = best(by["trl"]), best(by["ours"]), best(by["ours_one"])
        before = f"{best(by['per_row'])['rows_per_s']:,.0f}" if by.get("per_row") else "—"
        ag = agree[shape, n]
        same = (f"{ag['same']:,} of {ag['rows'][0]:,} rows" if ag["same"] is not None
                else f"rows differ: {ag['rows'][0]:,} / {ag['rows'][1]:,}")
        ratio = ours["rows_per_s"] / trl["rows_per_s"]
        lines.append(f"| {n:,} {shape} | {ag.get('tokens_per_row', 0):.0f} ({ag.get('cut', 0):,}) | {trl['rows_per_s']:,.0f} | "
                     f"{ours['rows_per_s']:,.0f} ({ours['workers']}) | {ratio:.1f}x | {one['rows_per_s']:,.0f} | "
                     f"{one['rows_per_s'] / trl['rows_per_s']:.1f}x | {before} | {same} | {'met' if ratio >= GOAL else 'missed'} |")
    lines += ["", "Streamed (`streaming: true`, sftrecipes/data/stream.py), one process as each rank reads the stream: one data "
              "epoch of the same file, in buffers of 10,000 rows prepared, shuffled and packed (bfd, max_length 256) as "
              "they are read; its clock covers reading and preparing; memory: the process's peak resident memory over "
              "the epoch above its resident memory at the start (VmHWM, reset there).", "",
              "| rows | jsonl MB | streamed rows/s | / TRL | packed rows | peak RSS growth over the epoch MB |",
              "|---|---:|---:|---:|---:|---:|"]
    for (shape, n), by in results.items():
        if by.get("stream"):
            st, trl = best(by["stream"]), best(by["trl"])
            lines.append(f"| {n:,} {shape} | {st['file_mb']:,.1f} | {st['rows_per_s']:,.0f} | "
                         f"{st['rows_per_s'] / trl['rows_per_s']:.1f}x | {st['packed_rows']:,} | {st['peak_growth_mb']:,.0f} |")
    lines += [NOTES, *([scale] if scale else []), END]
    return "\n".join(lines)


NOTES = """
Tokens and labels agree row for row (the column above). Where the two preparations differ by design
(sftrecipes/data/tokenization.py's docstring), nothing in these rows reaches it: TRL ignores add_special_tokens and
append_concat_token and appends a second end of turn to ChatML text data (these rows are conversations, both keys
false); TRL keeps a row whose only trained label is at position 0, the project needs one past it; the project drops
and counts the rows the cut leaves untrainable (here every label is trained, so neither drops a row).

Streamed rows (the second table) are prepared by every rank itself, one process each, as training reads them: fewer
rows/s than one process of the prepared path (the packing, and each packed row made a Python row for the loader),
~0.2 ms a multi-turn row beside a training step. Memory does not follow the data: 378 MB above the start for 50,000
rows and 389 MB for 200,000 (a file 4x larger); it follows the buffer (10,000 rows: their Python and Arrow copies
while they are prepared and packed; 164 MB for short rows).

Where the time goes (cProfile on one process of ours, 20,000 multi-turn rows, quiet machine, 2026-12-05): the Rust
tokenizer's encode ~62% (`encode_batch_fast`: ~0.135 ms for a 157-token row; fastencode.encode takes it where no
offsets are needed, as here), rendering ~22% (plain turns of the project's templates in Python,
tokenizer.render_plain_turns; other templates through transformers' render_jinja_template without
apply_chat_template's per-call work), the ids as Python lists ~8%, the batch's columns as one Arrow table ~5%, the
rest datasets' batches. Before `encode_batch_fast` the same rows went through the tokenizer's call, which has the
Rust side track offsets and transformers convert each row's encoding: one process prepared 4,200 rows/s of 20,000
rows (now 6,300-6,800), two workers 8,900 (now 10,100-11,100). TRL takes 0.52-0.61 ms a multi-turn row here (a
template render and a tokenizer call per row, then three more passes over the rows: labels, truncation, the drop of
fully masked rows): the encode alone bounds one process of ours near 4.5x TRL and two near 9x, with both cores to
themselves; 10x on such rows takes more cores than this machine has, or a faster encoder than the tokenizers
library's (tokenization.workers uses every core, one worker per 4,000 rows). The ratio is highest on short rows,
where TRL's per-row work is nearly all its time.

Worker processes (dataset_num_proc unset): datasets' pool costs ~0.5 s to start here (forks, the tokenizer and recipe
pickled to each, shards written and joined), so a split gets one worker per 4,000 rows (~2 s of work each at the speed
when it was set, 4x the start; at today's ~6,500 rows/s a worker's 4,000 rows take ~0.6 s, near the start, so the
threshold is due a new measurement), at most the usable cores and 16; below 8,000 rows it is prepared in this process. While other work holds a
core (load 2-3 on 2 cores, as through the 2026-12-04 run: 3.0-5.8x then, TRL at 485-1,138 rows/s), the second
worker gains little, and every figure, TRL's included, is below an idle machine's.

Before this change (git HEAD faa6c2b, measured once on the 50,000 multi-turn rows beside the same kind of load):
297 rows/s. Besides preparing each row on its own, it read the status columns back one row at a time (finish_split's
`with_format("numpy")[column]`): its gap to the per-row reference column.
"""


def write_section(text: str, path: Path = DOCS, start: str = START, end: str = END) -> None:
    """Replace only the text between the data-bench markers (append the section when absent); keep the rest. The scale
    table's own markers: inside the data-bench section, at its end when absent."""
    import bench_train

    old = path.read_text() if path.exists() else ""
    if start == SCALE_START and SCALE_START not in old and END in old:
        path.write_text(old.replace(END, text + "\n" + END, 1))
        return
    bench_train.write_section(text, path, start, end)


def kept_scale(path: Path = DOCS) -> str:
    """The scale table as docs/benchmarks.md has it (a run without scale rows keeps it), or ''."""
    old = path.read_text() if path.exists() else ""
    if SCALE_START not in old or SCALE_END not in old:
        return ""
    return SCALE_START + old.split(SCALE_START, 1)[1].split(SCALE_END, 1)[0] + SCALE_END


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        print(json.dumps(child(*argv[1:4])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="50000,200000", help="sizes of multi-turn rows, comma-separated")
    p.add_argument("--short_rows", default="50000", help="sizes of short rows, comma-separated ('' for none)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each side per size (alternated)")
    p.add_argument("--reference_rows", type=int, default=50000, help="run the per-row reference on sizes up to this")
    p.add_argument("--scale_rows", default="100000,1000000", help="sizes of `prepare` as users run it: rows/s, peak RSS, "
                   "disk (multi-turn rows; '' for none)")
    p.add_argument("--only_scale", action="store_true", help="run the scale rows alone and rewrite their table alone")
    p.add_argument("--no-docs", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from sftrecipes.tiny import ensure_tiny_model

    os.chdir(ROOT)
    ensure_tiny_model()  # .assets/tiny-llama, built once (make assets)
    t0 = time.time()
    load_before = os.getloadavg()
    results: dict[tuple[str, int], dict[str, list[dict]]] = {}
    agree: dict[tuple[str, int], dict] = {}
    sizes = [("multi-turn", int(x)) for x in args.rows.split(",") if x] + [("short", int(x)) for x in args.short_rows.split(",") if x]
    if args.only_scale:
        sizes = []
    scale: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        for n in [int(x) for x in args.scale_rows.split(",") if x]:
            rows_file = Path(tmp) / f"scale-{n}.jsonl"
            write_rows(rows_file, n)
            r = scale_run(rows_file, Path(tmp))
            scale.append(r)
            rows_file.unlink()
            print(f"{n:>9,} multi-turn rows  prepare: {r['prepare_seconds']:7.1f} s ({r['seconds']:.1f} s the command)  "
                  f"{r['rows_per_s']:8,.0f} rows/s  peak RSS {r['maxrss_mb']:,.0f} MB (largest process), PSS {r['pss_mb']:,.0f} MB "
                  f"(all)  entry {r['entry_mb']:,.0f} MB ({r['tokens']:,} tokens), peak disk {r['peak_disk_mb']:,.0f} MB, "
                  f"left in datasets' cache {r['hf_mb']:,.0f} MB", flush=True)
        for shape, n in sizes:
            rows_file = Path(tmp) / f"{shape}-{n}.jsonl"
            write_rows(rows_file, n, shape)
            by = results.setdefault((shape, n), {k: [] for k in KINDS})
            kinds = [k for k in KINDS if k != "per_row" or n <= args.reference_rows]
            for i in range(args.repeats):
                for kind in kinds:  # alternated, so drift and neighbours' load hit every side alike
                    r = one_run(kind, rows_file, Path(tmp))
                    by[kind].append(r)
                    print(f"{n:>8,} {shape:<10} rows  {KINDS[kind]:<20} run {i + 1}: {r['seconds']:7.1f} s  {r['rows_per_s']:8,.0f} rows/s"
                          f"  ({r['workers']} worker{'s' if r['workers'] > 1 else ''}, {r['kept']:,} rows kept)", flush=True)
            agree[shape, n] = agreement(by["ours"][-1]["out"], by["trl"][-1]["out"])
            print(f"{n:>8,} {shape:<10} rows  tokens and labels the same as TRL's: {agree[shape, n]}", flush=True)
    load_after = os.getloadavg()
    # the end's figure counts this bench's own runs (one or two busy processes): only load above them is other work
    load = (f"Load average (1 min) {load_before[0]:.1f} at the start, {load_after[0]:.1f} at the end (this bench's runs count "
            "in it)" + (": other work shared the machine, so every figure is lower than on an idle one."
                        if load_before[0] > 1.0 or load_after[0] > 2.5 else "."))
    scale_text = scale_report(scale, argv, time.time() - t0, f"{machine()}. {load}") if scale else kept_scale()
    if args.only_scale:
        print(scale_text)
        if not args.no_docs and scale:
            write_section(scale_text, DOCS, SCALE_START, SCALE_END)
            print(f"bench-data: wrote the scale table of {DOCS.relative_to(ROOT)}")
        return 0
    text = report(results, agree, argv, time.time() - t0, load, scale_text)
    print(text)
    if not args.no_docs:
        write_section(text)
        print(f"bench-data: wrote the data preparation section of {DOCS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
