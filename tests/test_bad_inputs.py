"""Bad-input corpus (issue 7): malformed or conflicting recipes and command lines, each run as a user would run
it (train.py, python -m sftrecipes VERB, scripts/run_*.sh) from the repository root.

Every case in tests/bad_inputs/cases.yaml must:
  1. exit with status 2;
  2. end stderr with ONE line `error: ...` that names the case's key and contains its fix fragment. Before it,
     stderr must be empty — except for `heavy` cases, whose error surfaces after torch/datasets load: there the
     only other lines allowed are timestamped logging records (train.py's logging.basicConfig format: the run's
     own INFO lines and library loggers such as bitsandbytes) and `datasets` progress bars. Neither can be an
     error message, and both are how a normal run starts; no other line (a traceback, a second error) may appear;
  3. write nothing: no new path in the case's tmp dir (its --output_dir included) and none under the repo's
     outputs/, configs/, scripts/, docs/, recipes/, tests/bad_inputs/ or top level.

Cases the product does not handle well yet are marked xfail(strict=True) with the reason, so they flip when fixed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, Zygote

HERE = ROOT / "tests" / "bad_inputs"
CASES = yaml.safe_load((HERE / "cases.yaml").read_text())
PY = sys.executable
WATCHED = ("outputs", "configs", "scripts", "docs", "recipes", "tests/bad_inputs")
LOG_RECORD = re.compile(r"^\d\d:\d\d:\d\d [\w.]+: ")  # logging.basicConfig(format="%(asctime)s %(name)s: ...")
PROGRESS_BAR = re.compile(r"^[\w ]+: +\d+%?.*\[\d\d:\d\d.*(examples|it)/s\]\s*$|^[\w ]+: \d+ examples \[")


# ----------------------------------------------------------------------------------------------- setups


def _text_jsonl(tmp: Path, tiny: Path) -> None:
    """A local data file whose only column is 'text' (no 'messages', no 'content')."""
    rows = [{"text": "The cat sat on the mat."}, {"text": "A tiny model learns slowly."}]
    (tmp / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _text_txt(tmp: Path, tiny: Path) -> None:
    """Chat data in a file with a suffix the loader does not know."""
    (tmp / "chat.txt").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")


def _tool_calls_jsonl(tmp: Path, tiny: Path) -> None:
    """An OpenAI-style tool call (content null) and a template that concatenates content as text."""
    rows = [{"messages": [{"role": "user", "content": "Weather in Paris?"},
                          {"role": "assistant", "content": None,
                           "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                          {"role": "tool", "content": "22 C"}, {"role": "assistant", "content": "It is 22 C."}]}]
    (tmp / "tools.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "text.jinja").write_text("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}")


def _tokenizer_without_template(tmp: Path, tiny: Path) -> None:
    """The tiny model with its chat template removed (it lives only in chat_template.jinja)."""
    dst = tmp / "notemplate"
    shutil.copytree(tiny, dst)
    (dst / "chat_template.jinja").unlink()
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def _lora_adapter(folder: Path, base: str, hidden: int = 64, r: int = 4) -> None:
    """A minimal, valid LoRA adapter folder for the tiny Llama (q_proj of layer 0)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj"],
        "base_model_name_or_path": base, "bias": "none"}))
    pre = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{pre}.lora_A.weight": torch.randn(r, hidden), f"{pre}.lora_B.weight": torch.randn(hidden, r)},
              str(folder / "adapter_model.safetensors"))


def _adapter_hub_base(tmp: Path, tiny: Path) -> None:
    """An adapter whose base is a hub id, merged with the hub offline (HF_HUB_OFFLINE=1) and no --base."""
    _lora_adapter(tmp / "adapter", base="meta-llama/Llama-2-7b-hf")


def _adapter_and_4bit_base(tmp: Path, tiny: Path) -> None:
    """A QLoRA adapter, and its base as saved from the 4-bit model (what save_pretrained writes for a bitsandbytes
    model: uint8-packed linear weights and a quantization_config), instead of the unquantized base."""
    import torch
    from safetensors.torch import load_file, save_file

    base = tmp / "base-4bit"
    shutil.copytree(tiny, base)
    cfg = json.loads((base / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
                                  "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                                  "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8"}
    (base / "config.json").write_text(json.dumps(cfg, indent=1))
    sd = load_file(str(base / "model.safetensors"))
    packed = {k: torch.zeros(v.numel() // 2, 1, dtype=torch.uint8) if k.endswith("_proj.weight") else v for k, v in sd.items()}
    save_file(packed, str(base / "model.safetensors"), metadata={"format": "pt"})
    _lora_adapter(tmp / "adapter", base=str(base))


def _empty_dir(tmp: Path, tiny: Path) -> None:
    (tmp / "empty").mkdir()


def _existing_recipe(tmp: Path, tiny: Path) -> None:
    """A recipe of the user's own where `cp` is asked to write."""
    (tmp / "mine.yaml").write_text("learning_rate: 1.0e-3\n")


def _run_with_checkpoint_only(tmp: Path, tiny: Path) -> None:
    """A run folder with an intermediate checkpoint but no final save (the run did not finish)."""
    (tmp / "run" / "checkpoint-3").mkdir(parents=True)


def _model_without_tokenizer(tmp: Path, tiny: Path) -> None:
    """The tiny model as a checkpoint or export folder often is: weights and config, no tokenizer files."""
    shutil.copytree(tiny, tmp / "model", ignore=shutil.ignore_patterns("tokenizer*", "chat_template.jinja"))


def _truncated_safetensors(tmp: Path, tiny: Path) -> None:
    """The tiny model with its model.safetensors cut short, as an interrupted copy leaves it."""
    shutil.copytree(tiny, tmp / "model")
    with open(tmp / "model" / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)


SETUPS = {
    "model_without_tokenizer": _model_without_tokenizer,
    "truncated_safetensors": _truncated_safetensors,
    "text_jsonl": _text_jsonl,
    "text_txt": _text_txt,
    "tokenizer_without_template": _tokenizer_without_template,
    "tool_calls_jsonl": _tool_calls_jsonl,
    "adapter_hub_base": _adapter_hub_base,
    "adapter_and_4bit_base": _adapter_and_4bit_base,
    "empty_dir": _empty_dir,
    "run_with_checkpoint_only": _run_with_checkpoint_only,
    "existing_recipe": _existing_recipe,
}


# issue 37: rows that carry images (an images column, an image column, image content parts) and content given as parts


def _vl_rows(n: int, kind: str) -> list[dict]:
    """TRL's vision-language rows, every other one with an image: kind 'images' (a list column + image parts), 'image'
    (one image column, string content), 'parts' (image parts, no column; the first row has none), 'text_parts'
    (content as text parts only)."""
    rows = []
    for i in range(n):
        img = i % 2 == 1
        user = [{"type": "image"}] * (img and kind in ("images", "parts")) + [{"type": "text", "text": "What is this?"}]
        answer = [{"type": "text", "text": "A cat."}]
        if kind == "image":
            rows.append({"image": "cat.png" if img else None,
                         "messages": [{"role": "user", "content": "What is this?"}, {"role": "assistant", "content": "A cat."}]})
            continue
        row = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
        if kind == "images":
            row["images"] = ["cat.png"] if img else []
        rows.append(row)
    return rows


def _vl_folder(kind: str):
    def setup(tmp: Path, tiny: Path) -> None:
        (tmp / "vl").mkdir()
        for split in ("train", "test"):
            (tmp / "vl" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _vl_rows(6, kind)))
    return setup


def _images_saved(tmp: Path, tiny: Path) -> None:
    """The images rows as a save_to_disk folder: not readable without datasets, counted in the run before tokenizing."""
    import datasets

    split = datasets.Dataset.from_list(_vl_rows(6, "images"))
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp / "vl"))


SETUPS.update({"images_jsonl": _vl_folder("images"), "image_column_jsonl": _vl_folder("image"),
               "image_parts_jsonl": _vl_folder("parts"), "text_parts_jsonl": _vl_folder("text_parts"),
               "images_saved": _images_saved})


# issue 37: data files (datafiles.py, badrows.py): a folder whose files cannot be read together, a cut line


def _chat_lines(n: int) -> str:
    return "".join(json.dumps({"messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": f"A{i}"}]}) + "\n"
                   for i in range(n))


def _jsonl_and_txt_folder(tmp: Path, tiny: Path) -> None:
    """A folder of chat rows and a notes file: datasets read the jsonl alone and said nothing of the txt."""
    (tmp / "mixed").mkdir()
    (tmp / "mixed" / "a.jsonl").write_text(_chat_lines(4))
    (tmp / "mixed" / "notes.txt").write_text("where the data came from\n")


def _columns_differ_folder(tmp: Path, tiny: Path) -> None:
    """messages rows in parquet, prompt/completion rows in jsonl: datasets read the parquet alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp / "mixed").mkdir()
    pq.write_table(pa.Table.from_pylist([json.loads(x) for x in _chat_lines(4).splitlines()]), tmp / "mixed" / "a.parquet")
    (tmp / "mixed" / "b.jsonl").write_text(json.dumps({"prompt": "Q", "completion": "A"}) + "\n")


def _cut_line_jsonl(tmp: Path, tiny: Path) -> None:
    """Chat rows whose last line was cut mid-string (a copy interrupted): it was a pyarrow traceback."""
    (tmp / "cut.jsonl").write_text(_chat_lines(3) + _chat_lines(1)[:30])


SETUPS.update({"jsonl_and_txt_folder": _jsonl_and_txt_folder, "columns_differ_folder": _columns_differ_folder,
               "cut_line_jsonl": _cut_line_jsonl})


# issue 39: val_set_size on a save_to_disk folder with a test split (found when the data is read: no files validation reads)


def _chat_saved_with_test(tmp: Path, tiny: Path) -> None:
    import datasets

    rows = [json.loads(x) for x in _chat_lines(6).splitlines()]
    datasets.DatasetDict({s: datasets.Dataset.from_list(rows) for s in ("train", "test")}).save_to_disk(str(tmp / "saved"))


SETUPS["chat_saved_with_test"] = _chat_saved_with_test


# ----------------------------------------------------------------------------------------------- running


def command(case: dict, tmp: Path, tiny: Path) -> list[str]:
    def fill(s: str) -> str:
        return str(s).replace("{tmp}", str(tmp)).replace("{tiny}", str(tiny))

    args = [fill(a) for a in case.get("args", [])]
    recipe = [f"tests/bad_inputs/{case['recipe']}"] if "recipe" in case else [case["recipe_path"]] if "recipe_path" in case else []
    out = ["--output_dir", str(tmp / "out")]
    entry = case["entry"]
    if entry == "train":
        return [PY, "train.py", *recipe, *out, *args]
    if entry in ("plan", "preflight", "env"):
        return [PY, "-m", "sftrecipes", entry, *recipe, *out, *args]
    if entry == "emit":
        return [PY, "-m", "sftrecipes", "emit", *recipe, *args]
    if entry == "launch":
        return [PY, "-m", "sftrecipes", "launch", *recipe, *args, *out]
    if entry in ("merge", "export", "cp"):
        return [PY, "-m", "sftrecipes", entry, *args]
    if entry.startswith("script:"):
        return ["bash", f"scripts/{entry.split(':', 1)[1]}", *out, *args]
    raise ValueError(f"unknown entry {entry!r} in case {case['name']}")


def snapshot(tmp: Path) -> set[str]:
    """Every path under the case's tmp dir and the repo's watched folders, plus the repo's top-level entries."""
    paths = {f"tmp:{p.relative_to(tmp)}" for p in tmp.rglob("*")}
    for folder in WATCHED:
        for dirpath, dirnames, filenames in os.walk(ROOT / folder):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for n in dirnames + filenames:
                paths.add(str(Path(dirpath, n).relative_to(ROOT)))
    paths |= {p.name for p in ROOT.iterdir()}
    return paths


def error_line(stderr: str, heavy: bool) -> str:
    """The one error line, after checking that nothing but allowed noise precedes it."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert lines, "nothing on stderr"
    *before, last = lines
    assert last.startswith("error: "), f"last stderr line is not the error:\n{stderr[-3000:]}"
    if heavy:
        noise = [ln for ln in before if not (LOG_RECORD.match(ln) or PROGRESS_BAR.match(ln))]
    else:
        noise = before
    assert not noise, f"stderr has more than the error line:\n{stderr[-3000:]}"
    return last


def _params():
    out = []
    for case in CASES:
        marks = [pytest.mark.xfail(strict=True, reason=" ".join(case["xfail"].split()))] if case.get("xfail") else []
        out.append(pytest.param(case, id=case["name"], marks=marks))
    return out


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def zygote():
    """The heavy train cases (their errors come after torch loads) run in forks of one process that imported torch
    and the training modules once (conftest.Zygote): ~1 s a case instead of ~9 s of imports each. The others are
    separate processes, as the torch-free checks must be."""
    z = Zygote(ENV)
    yield z
    z.close()


@pytest.mark.parametrize("case", _params())
def test_bad_input(case, tmp_path, tiny_model, request):
    tmp = tmp_path / "case"
    tmp.mkdir()
    if case.get("setup"):
        SETUPS[case["setup"]](tmp, tiny_model)
    before = snapshot(tmp)
    cmd = command(case, tmp, tiny_model)
    if case.get("heavy") and case["entry"] == "train":
        res = request.getfixturevalue("zygote").run(cmd[1:], tmp_path)  # (its output files beside the case's folder)
    else:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, env=ENV)
    created = sorted(snapshot(tmp) - before)
    for p in created:  # a file emitted from a corpus recipe must not stay in the shared checkout (others' files stay)
        f = ROOT / p
        if p.startswith(("configs/", "scripts/")) and f.is_file() and "tests/bad_inputs/" in f.read_text(errors="replace"):
            f.unlink()
    report = f"exit {res.returncode}\n--- stderr:\n{res.stderr[-3000:]}\n--- stdout:\n{res.stdout[-1500:]}"
    assert res.returncode == 2, report
    line = error_line(res.stderr, bool(case.get("heavy")))
    key, fix = case["key"], str(case["fix"]).replace("{tmp}", str(tmp))
    assert key in line, f"error does not name {key!r}: {line}"
    assert fix in line, f"error does not give the fix {fix!r}: {line}"
    assert not created, f"the run wrote {created}"


# ----------------------------------------------------------------------------------------------- the corpus itself


def test_corpus_is_consistent():
    """Unique names, known entry points and setups, every referenced recipe exists and every recipe file is used."""
    names = [c["name"] for c in CASES]
    assert len(names) == len(set(names)), "duplicate case names"
    # every case written in the file is a case run (a mis-indented or merged entry would drop one silently): the
    # top-level list items counted in the raw text, not through the YAML loader
    written = re.findall(r"^- (?:\{\s*)?name:", (HERE / "cases.yaml").read_text(), flags=re.M)
    assert len(CASES) == len(written) and len(_params()) == len(CASES), (len(CASES), len(written))
    used = set()
    for c in CASES:
        assert {"name", "entry", "key", "fix"} <= set(c), c
        assert c["entry"] in ("train", "plan", "emit", "preflight", "env", "merge", "export", "launch", "cp") or (
            c["entry"].startswith("script:") and (ROOT / "scripts" / c["entry"][7:]).is_file()), c
        assert not c.get("setup") or c["setup"] in SETUPS, c
        if "recipe" in c:
            assert (HERE / c["recipe"]).is_file(), c
            used.add(c["recipe"])
        if "recipe_path" in c:
            assert (ROOT / c["recipe_path"]).is_file(), c
    used |= {"cycle_b.yaml"}  # reached through cycle_a.yaml's base:
    files = {p.name for p in HERE.glob("*.yaml")} - {"cases.yaml"}
    assert files == used, f"recipe files without a case: {files - used}"


def test_a_good_input_passes_the_same_checks(tmp_path, tiny_model):
    """Control: the harness tells a good input from a bad one. `lora_r: "8"` (a quoted number) is fine where
    `lora_r: eight` is not; plan on the tiny LoRA recipe exits 0 and writes nothing."""
    recipe = tmp_path / "quoted.yaml"
    recipe.write_text(f'base: {ROOT}/recipes/tiny/lora.yaml\nlora_r: "8"\n')
    before = snapshot(tmp_path)
    res = subprocess.run([PY, "-m", "sftrecipes", "plan", str(recipe), "--output_dir", str(tmp_path / "out")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0 and "error" not in res.stderr, res.stderr
    assert snapshot(tmp_path) == before
    recipe.write_text(f"base: {ROOT}/recipes/tiny/lora.yaml\nlora_r: eight\n")
    res = subprocess.run([PY, "-m", "sftrecipes", "plan", str(recipe)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 2 and error_line(res.stderr, heavy=False).startswith("error: lora_r (in ")
