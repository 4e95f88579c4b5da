"""`make bench-data`'s table at scale (bench_data.py runs it; `--only_scale` alone): `python -m sftrecipes prepare` of
synthetic chat rows as a user runs it, measured from outside: rows/s as prepare says them, the peak RSS of its largest
process, the PSS of all of them together, the disk the cache entry and datasets' cache take during the run and after
it, the tokens the entry holds."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "recipes/tiny/lora.yaml"
SCALE_START, SCALE_END = "<!-- data-bench-scale:start -->", "<!-- data-bench-scale:end -->"

# runs the command given after it and prints, last, the peak RSS of the largest process of its tree (each process's
# high-water mark; getrusage(RUSAGE_CHILDREN) keeps the largest of the children waited for, theirs included)
PEAK_WRAPPER = ("import json, resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
                "print(json.dumps({'rc': rc, 'maxrss_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e6}))")


def _tree_pss_mb(pid: int) -> float:
    """The PSS of a process's descendants together, MB (a page shared by n of them counts 1/n in each)."""
    import psutil

    total = 0
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(OSError, StopIteration, ValueError):
                with open(f"/proc/{p.pid}/smaps_rollup") as f:
                    total += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    return total * 1024 / 1e6


def _disk_mb(*folders: Path) -> float:
    """What the files under folders take on disk (st_blocks), MB."""
    total = 0
    for folder in folders:
        for root, _, files in os.walk(folder):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total / 1e6


def scale_run(rows_file: Path, tmp: Path) -> dict:
    """One `python -m sftrecipes prepare` of rows_file in a fresh process with a fresh cache entry and datasets cache,
    measured from outside (module docstring)."""
    import pyarrow.compute as pc

    out = Path(tempfile.mkdtemp(prefix="scale-", dir=tmp))
    cache, hf = out / "cache", out / "hf"
    env = {**os.environ, "HF_DATASETS_CACHE": str(hf), "HF_HUB_OFFLINE": "1"}
    env.pop("SFTRECIPES_FORK_SERVER", None)  # (as users start it)
    argv = [sys.executable, "-c", PEAK_WRAPPER, sys.executable, "-m", "sftrecipes", "prepare", RECIPE, "--dataset_name",
            str(rows_file), "--splits", "train", "--data_cache_dir", str(cache), "--output_dir", str(out / "o")]
    peak = {"pss_mb": 0.0, "disk_mb": 0.0}
    stop = threading.Event()
    t = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def sample():
        while not stop.wait(0.5):
            peak["pss_mb"] = max(peak["pss_mb"], _tree_pss_mb(proc.pid))
            peak["disk_mb"] = max(peak["disk_mb"], _disk_mb(cache, hf))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    seconds = time.perf_counter() - t
    stop.set()
    sampler.join()
    lines = stdout.strip().splitlines()
    wrapped = json.loads(lines[-1])
    said = next((line for line in lines if line.startswith("prepare: ")), "")
    m = re.search(r"prepare: (\S+): built; .* prepared in ([\d.]+)s at (\d+) rows/s", said)
    if wrapped["rc"] or not m:
        raise SystemExit(f"bench-data: the prepare of {rows_file.name} failed:\n{stderr[-3000:]}")
    entry = Path(m.group(1))
    import datasets

    train = datasets.Dataset.from_file(str(entry / "prepared" / "train.arrow"))
    tokens = int(pc.sum(pc.list_value_length(train.data.column("input_ids"))).as_py())
    entry_mb, hf_mb = _disk_mb(cache), _disk_mb(hf)
    return {"rows": sum(1 for _ in open(rows_file)), "file_mb": rows_file.stat().st_size / 1e6, "seconds": seconds,
            "prepare_seconds": float(m.group(2)), "rows_per_s": float(m.group(3)), "maxrss_mb": wrapped["maxrss_mb"],
            "pss_mb": peak["pss_mb"], "entry_mb": entry_mb, "hf_mb": hf_mb, "peak_disk_mb": max(peak["disk_mb"], entry_mb),
            "tokens": tokens, "packed_rows": len(train), "columns": train.column_names,
            "left": sorted(str(f.relative_to(entry)) for f in entry.rglob("*") if f.is_file())}


def scale_report(results: list[dict], argv: list[str], seconds: float, where: str) -> str:
    """The scale table, its markers around it (bench_data.py writes it); where: the machine and its load, in words."""
    lines = [SCALE_START, "### At scale: `prepare` of up to 1,000,000 rows", "",
             f"`{shlex.join(['python', 'bench/bench_data.py', *argv])}`, {datetime.date.today().isoformat()}, "
             f"{seconds / 60:.1f} min in all. {where}", "",
             "`python -m sftrecipes prepare recipes/tiny/lora.yaml --dataset_name ROWS.jsonl --splits train` as a user runs "
             "it: a fresh process (imports included in its time), a fresh `data_cache_dir` and `HF_DATASETS_CACHE`; the "
             "multi-turn rows above (tiny Llama tokenizer, chatml, max_length 256), packed (bfd) into the entry as the "
             "trainer reads them. Rows/s: as prepare says them (reading, tokenizing, counting, packing and writing the "
             "entry, its imports not included). Peak RSS: the largest process's (the preparer or one of datasets' 2 "
             "workers; each one's kernel high-water mark, mapped file pages included). PSS: all of them together, "
             "sampled every 0.5 s. Disk: what the entry and datasets' cache take (allocated blocks), sampled during the "
             "run (peak) and after it.", "",
             "| rows | jsonl MB | prepare s (command) | rows/s | peak RSS MB, largest process | peak PSS MB, all | "
             "tokens in the entry | entry MB | entry bytes / token | peak disk MB (/ entry) | left in datasets' cache MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['rows']:,} multi-turn | {r['file_mb']:,.0f} | {r['prepare_seconds']:,.1f} ({r['seconds']:,.1f}) | "
                     f"{r['rows_per_s']:,.0f} | {r['maxrss_mb']:,.0f} | {r['pss_mb']:,.0f} | {r['tokens']:,} | "
                     f"{r['entry_mb']:,.0f} | {r['entry_mb'] * 1e6 / r['tokens']:.1f} | {r['peak_disk_mb']:,.0f} "
                     f"({r['peak_disk_mb'] / r['entry_mb']:.2f}x) | {r['hf_mb']:,.0f} |")
    last = results[-1]
    lines += ["", f"The entry holds {', '.join(f'`{c}`' for c in last['columns'])} ({last['packed_rows']:,} packed rows of "
              f"{last['rows']:,}) and its records: {', '.join(last['left'])}.", SCALE_NOTES, SCALE_END]
    return "\n".join(lines)


SCALE_NOTES = """
The bounds (sftrecipes/data/prepcache.py, prepattempt.py, trainrows.py, arrowmem.py, tokenization.py):
- Memory: no row is held for the split's sake. Every pass goes through batches into files (a map batch of 10,000
  rows prepared 1,000 at a time, one tokenizer call each; the marks counted 100,000 rows at a time; packing 1,000 rows
  at a time, as TRL's map hands them to pack_dataset), pyarrow's pool is handed back after each packed batch, and the
  pages of the memory-mapped Arrow files a pass reads go back to the page cache as it goes (madvise DONTNEED: a
  thread every 0.25 s in the preparer, each map batch in a worker, each 100,000 marks); every Arrow file is written
  in record batches of 10,000 rows or 16 MB, since opening a mapped file touches the page around each one's header
  (~64 KB: 64 MB a million rows at datasets' default of 1,000, ~6 MB now). The peak is then the libraries (0.45 GB
  of torch, transformers and the tokenizer before a row is read) plus datasets' JSON reader while it copies the
  source, the largest working set of the run (measured alone: 0.20 GB at 100,000 rows, 0.25-0.27 at 1,000,000 and
  2,000,000: it settles); tokenizing, counting, packing and writing stay below it, flat (the worker of a
  one-process run of 1,000,000 rows: 472 MB by its 50,000th row, 478 MB by its 200,000th, then no higher). Measured
  the same way at 2,000,000 rows: 650 MB. Only where asked do rows cost memory: a `datasets:` mixture holds the indices it draws
  (~36 bytes a drawn row), `shuffle_dataset` the permutation (8 bytes a row) while it shuffles.
- Disk after the preparation: the entry alone, `input_ids` (4 bytes a token), `labels` (8) and, packed, `seq_lengths`;
  no text column, nothing in datasets' cache (its copy of the source, the maps' outputs and temporary files are
  written in the attempt's own folder in the entry and removed with it), and nothing more at launch: the entry holds
  the rows packed and shuffled as TRL's `_prepare_dataset` makes them, and train.py has SFTTrainer skip it (before,
  its first launch wrote the packed rows again beside the entry, and every launch packed under a barrier bound by
  `ddp_timeout`). During it: datasets' copy of the source and the tokenized rows (12 bytes a token, 17 a row), then,
  the copy removed, the tokenized rows and the entry being written: at most twice the entry (the peak column).
- A `prepare` killed outright leaves its attempt's folder (attempt-<token>/ in the entry); the next process to take
  the entry (or to find it complete with no lock held) removes it
  (tests/data/test_prepcache.py::test_a_killed_prepare_leaves_nothing_once_another_takes_over).
"""


