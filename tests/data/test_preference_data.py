"""Preference data (preference.py): every shape DPO and KTO read, mixtures, the one-line errors, the rows TRL then
tokenizes exactly as it tokenizes the raw data, and what its preparation cut and dropped (truncation_counts)."""

import importlib.util
import json
import os
from types import SimpleNamespace

import datasets
import pytest
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

from sftrecipes.data import formats
from sftrecipes.core.errors import RecipeError
from sftrecipes.core.paths import ROOT
from sftrecipes.data.prefcuts import truncation_counts
from sftrecipes.data.preference import preference_datasets
from sftrecipes.recipe.load import load_recipe
from sftrecipes.data.tokenizer import load_tokenizer

BASE = ["--model_name_or_path", ".assets/tiny-llama", "--output_dir", "outputs/t", "--chat_template_format", "chatml"]
SHIPPED = [json.loads(line) for line in open(ROOT / "data/tiny_dpo/train.jsonl")][:8]
TOOLS = [{"type": "function", "function": {"name": "spell", "parameters": {"type": "object"}}}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def text(msgs):
    return msgs[0]["content"]


def sharegpt(msgs):
    return [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in msgs]


def split_at_shared_start(chosen: str, rejected: str) -> dict:
    n = len(os.path.commonprefix([chosen, rejected]))
    n -= chosen[n - 1] == " "
    return {"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


# Each DPO shape, and the rows it must become: (rows as written, rows TRL is handed)
CONV = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in SHIPPED]
TEXT = [{"prompt": text(r["prompt"]), "chosen": " " + text(r["chosen"]), "rejected": " " + text(r["rejected"])} for r in SHIPPED]
DPO_SHAPES = {
    "conversational prompt/chosen/rejected": (CONV, CONV),
    "text prompt/chosen/rejected": (TEXT, TEXT),
    "ShareGPT prompt/chosen/rejected": ([{k: sharegpt(v) for k, v in r.items()} for r in CONV], CONV),
    "conversational chosen/rejected (implicit prompt)": (
        [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in CONV], CONV),
    "ShareGPT chosen/rejected (implicit prompt)": (
        [{"chosen": sharegpt(r["prompt"] + r["chosen"]), "rejected": sharegpt(r["prompt"] + r["rejected"])} for r in CONV], CONV),
    # text: the prompt is the longest shared start, as TRL's extract_prompt cuts it (a space before the cut goes to
    # the completions)
    "text chosen/rejected (implicit prompt)": (
        [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in TEXT],
        [split_at_shared_start(r["prompt"] + r["chosen"], r["prompt"] + r["rejected"]) for r in TEXT]),
}


def build(method, *flags):
    r = load_recipe(BASE + ["--method", method, *[str(f) for f in flags]])
    tok, _, _ = load_tokenizer(r)
    return r, tok


def read(method, *flags):
    r, tok = build(method, *flags)
    return tok, preference_datasets(r, tok)


def trl_prepared(method, ds, tok, max_length=None):
    """TRL's own preparation of a dataset (its trainer's _prepare_dataset, without a model): the tokens it trains on."""
    if method == "dpo":
        args = DPOConfig(output_dir="outputs/t", report_to="none", use_cpu=True, bf16=False, max_length=max_length)
        return DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tok), ds, tok, args, "train")
    args = KTOConfig(output_dir="outputs/t", report_to="none", use_cpu=True, bf16=False, max_length=max_length)
    trainer = SimpleNamespace(_tokenizer=tok, calculate_KL=False, desirable_weight=1.0, undesirable_weight=1.0)
    return KTOTrainer._prepare_dataset(trainer, ds, tok, args, "train")


def ids(ds, method):
    cols = ("prompt_ids", "chosen_ids", "rejected_ids") if method == "dpo" else ("prompt_ids", "completion_ids", "label")
    return [tuple(tuple(v) if isinstance(v, list) else v for v in (row[c] for c in cols)) for row in ds]


# ------------------------------------------------------------------------------------------ shapes


@pytest.mark.parametrize("shape", list(DPO_SHAPES))
def test_every_dpo_shape_becomes_prompt_chosen_rejected(tiny_model, tmp_path, shape):
    written, expected = DPO_SHAPES[shape]
    _, (train, evals, prompt, counts) = read("dpo", "--dataset_name", write_jsonl(tmp_path / "d.jsonl", written), "--splits", "train")
    assert counts["train"]["formats"] == {shape: len(written)} and counts["train"]["kept"] == len(written)
    assert train.column_names == ["prompt", "chosen", "rejected"] and evals is None
    assert train.to_list() == expected
    assert prompt == expected[0]["prompt"]  # no eval split: the first train row's prompt


def test_kto_reads_unpaired_rows_and_unpairs_pairs_as_trl_does(tiny_model, tmp_path):
    _, (train, evals, prompt, counts) = read("kto", "--dataset_name", "data/tiny_kto")
    shipped = [json.loads(line) for line in open(ROOT / "data/tiny_kto/train.jsonl")]
    assert train.to_list() == shipped and train.features["label"] == datasets.Value("bool")
    assert counts["train"]["formats"] == {"conversational prompt/completion/label": 200} and counts["train"]["unpaired"] == 0
    assert (counts["train"]["desirable"], counts["train"]["undesirable"]) == (100, 100) and len(evals) == 20
    assert prompt == json.loads(open(ROOT / "data/tiny_kto/test.jsonl").readline())["prompt"]  # the first eval row's
    # pairs (explicit or implicit prompt, text or messages): a desirable and an undesirable row each, in TRL's order
    for shape in ("conversational prompt/chosen/rejected", "text prompt/chosen/rejected", "conversational chosen/rejected (implicit prompt)"):
        written, rows = DPO_SHAPES[shape]
        _, (train, _, _, counts) = read("kto", "--dataset_name", write_jsonl(tmp_path / "p.jsonl", written), "--splits", "train")
        assert counts["train"]["unpaired"] == 8 and counts["train"]["kept"] == len(train) == 16
        assert train.to_list() == ([{"prompt": r["prompt"], "completion": r["chosen"], "label": True} for r in rows]
                                   + [{"prompt": r["prompt"], "completion": r["rejected"], "label": False} for r in rows])
    # 0/1 labels are bools
    ints = [{"prompt": "Say cat.", "completion": " cat.", "label": 1}, {"prompt": "Say cat.", "completion": " dog.", "label": 0}]
    _, (train, *_rest) = read("kto", "--dataset_name", write_jsonl(tmp_path / "i.jsonl", ints), "--splits", "train")
    assert train["label"] == [True, False]


def test_rows_trl_cannot_use_are_dropped_and_counted(tiny_model, tmp_path, caplog):
    rows = [*CONV[:3],
            {**CONV[3], "chosen": None},  # a null
            {**CONV[4], "rejected": []},  # a conversation with no messages
            {**CONV[5], "rejected": CONV[5]["chosen"]}]  # nothing to prefer
    with caplog.at_level("INFO", logger="sftrecipes"):
        _, (train, _, _, counts) = read("dpo", "--dataset_name", write_jsonl(tmp_path / "d.jsonl", rows), "--splits", "train")
    c = counts["train"]
    assert (c["read"], c["empty"], c["identical"], c["no_prompt"], c["kept"]) == (6, 2, 1, 0, 3) and train.to_list() == CONV[:3]
    assert "2 dropped with a null or no messages" in caplog.text and "1 dropped with chosen = rejected" in caplog.text
    # an implicit prompt with no shared start (TRL would fail on its empty prompt)
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in CONV[:2]]
    implicit.append({"chosen": CONV[2]["chosen"], "rejected": CONV[2]["rejected"]})
    _, (train, _, _, counts) = read("dpo", "--dataset_name", write_jsonl(tmp_path / "i.jsonl", implicit), "--splits", "train")
    assert counts["train"]["no_prompt"] == 1 and train.to_list() == CONV[:2]
    with pytest.raises(RecipeError, match="^dataset_name: every train split row was dropped"):
        read("dpo", "--dataset_name", write_jsonl(tmp_path / "e.jsonl", rows[3:]), "--splits", "train")


def test_only_the_columns_trl_reads_stay(tiny_model, tmp_path):
    rows = [{**r, "tools": json.dumps(TOOLS), "source": "web", "score": 3} for r in CONV]
    _, (train, *_rest) = read("dpo", "--dataset_name", write_jsonl(tmp_path / "d.jsonl", rows), "--splits", "train")
    assert train.column_names == ["prompt", "chosen", "rejected", "tools"]


# ------------------------------------------------------------------------------------------ mixtures


def test_mixture_of_preference_sources_with_weights_and_columns(tiny_model, tmp_path):
    renamed = [{"question": r["prompt"], "good": r["chosen"],
                "bad": [{**m, "name": "other"} for m in r["rejected"]]} for r in CONV]  # a message field entry 0 lacks
    entries = [{"path": "data/tiny_dpo", "weight": 0.5},  # 100 of 200, and its test split for eval
               {"path": write_jsonl(tmp_path / "qa.jsonl", renamed), "samples": 20,
                "columns": {"question": "prompt", "good": "chosen", "bad": "rejected"}}]

    def mixture(*flags):
        return read("dpo", "--datasets", json.dumps(entries), "--splits", "train,test", *flags)[1]

    train, evals, prompt, counts = mixture()
    assert [(s["rows"], s["of"]) for s in counts["mixture"]["sources"]] == [(100, 200), (20, 8)]
    assert counts["train"]["read"] == counts["train"]["kept"] == len(train) == 120 and len(evals) == 20
    assert [s["shape"] for s in counts["train"]["sources"]] == ["conversational prompt/chosen/rejected"] * 2
    assert train.column_names == ["prompt", "chosen", "rejected"]
    from_qa = [r for r in train if r["rejected"][0]["name"] == "other"]
    assert len(from_qa) == 20 and all({"prompt": r["prompt"], "chosen": r["chosen"]} in [
        {"prompt": c["prompt"], "chosen": c["chosen"]} for c in CONV] for r in from_qa)
    assert prompt == json.loads(open(ROOT / "data/tiny_dpo/test.jsonl").readline())["prompt"]
    again = mixture()[0]
    other = mixture("--seed", "7")[0]
    assert again.to_list() == train.to_list() and other.to_list() != train.to_list()
    # kto: a paired and an unpaired source in one mixture (the pairs unpaired first)
    kto = read("kto", "--datasets", json.dumps([{"path": "data/tiny_kto", "samples": 10, "eval_split": None},
                                                 {"path": "data/tiny_dpo", "samples": 5, "eval_split": None}]), "--splits", "train")[1]
    assert len(kto[0]) == 10 + 2 * 5 and kto[3]["train"]["unpaired"] == 5


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("method,rows,flags,fragments", [
    ("dpo", [{"question": "q", "answer": "a"}], [],
     ["dataset_format: dataset_name", "none of the shapes method dpo reads: prompt/chosen/rejected", "; chosen/rejected",
      "rename its columns (a datasets entry's columns:"]),
    ("dpo", [{"prompt": "q", "completion": "a", "label": True}], [], ["dataset_format:", "method dpo reads: prompt/chosen/rejected"]),
    ("kto", [{"prompt": "q", "answer": "a"}], [],
     ["dataset_format:", "none of the shapes method kto reads: prompt/completion/label", "prompt/chosen/rejected", "label a bool"]),
    ("dpo", [CONV[0]], ["--chat_template_format", "none"],
     ["chat_template_format: none, but dataset_name is conversational (preference); set chat_template_format: tokenizer"]),
    ("dpo", [{**CONV[0], "prompt": "a text prompt"}], [], ["holds 'prompt' as text and 'chosen' as messages"]),
    ("dpo", [{**TEXT[0], "chosen": 3}], [], ["column 'chosen' of dataset_name", "neither text nor a list of role/content"]),
    ("kto", [{"prompt": "q", "completion": "a", "label": "yes"}], [], ["column 'label' of dataset_name", "kto needs a bool"]),
    ("kto", [{"prompt": "q", "completion": "a", "label": 2}], [], ["kto needs a bool"]),
])
def test_shape_errors_are_one_line_with_the_key_and_the_shapes(tiny_model, tmp_path, method, rows, flags, fragments):
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(RecipeError) as e:
        read(method, "--dataset_name", f, "--splits", "train", *flags)
    assert all(x in str(e.value) for x in fragments) and "\n" not in str(e.value), str(e.value)


def test_preference_rows_that_carry_images_are_counted_and_refused_where_the_split_loads(tiny_model, tmp_path):
    """Issue 37. A save_to_disk folder (validation reads no such folder without datasets) whose pairs carry images in 2
    of 4 rows: refused in one line naming the column and how many rows, before TRL would drop the images unseen."""
    rows = [{**r, "images": ["cat.png"] if i % 2 else []} for i, r in enumerate(CONV[:4])]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "vl"))
    with pytest.raises(RecipeError) as e:
        read("dpo", "--dataset_name", str(tmp_path / "vl"), "--splits", "train")
    assert str(e.value).startswith(f"images: 2 of 4 rows of dataset_name {tmp_path / 'vl'} (train) carry images "
                                   "(column 'images': 2 rows);") and "\n" not in str(e.value), str(e.value)


def test_errors_of_a_mixture_entry_name_its_columns(tiny_model, tmp_path):
    bad = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(RecipeError, match=r"^datasets\[1\]\.columns: datasets\[1\] \(.*qa.jsonl, train\) \(has question, answer\) is none of the shapes method dpo reads"):
        read("dpo", "--datasets", json.dumps([{"path": "data/tiny_dpo"}, {"path": bad}]), "--splits", "train")
    # the fix it names: the entry's columns
    fixed = write_jsonl(tmp_path / "qc.jsonl", [{"question": "Say cat.", "good": " cat.", "bad": " dog."}])
    train = read("dpo", "--datasets", json.dumps([{"path": fixed, "columns": {"question": "prompt", "good": "chosen", "bad": "rejected"}}]),
                 "--splits", "train")[1][0]
    assert train.to_list() == [{"prompt": "Say cat.", "chosen": " cat.", "rejected": " dog."}]
    text_rows = write_jsonl(tmp_path / "t.jsonl", TEXT)
    with pytest.raises(RecipeError, match="^datasets: column 'prompt' of .* one run's sources are all text or all conversational"):
        read("dpo", "--datasets", json.dumps([{"path": "data/tiny_dpo", "eval_split": None}, {"path": text_rows}]), "--splits", "train")


def test_formats_of_one_method_are_refused_by_the_others(tiny_model):
    r, tok = build("dpo", "--dataset_name", "data/tiny_dpo")
    r.data.dataset_format = "messages"  # (the schema's choices are checked at load; the data step checks again)
    with pytest.raises(RecipeError, match="^dataset_format: messages is a shape of method sft; method dpo reads"):
        preference_datasets(r, tok)
    r.data.dataset_format = "unpaired_preference"
    with pytest.raises(RecipeError, match="^dataset_format: unpaired_preference .* set method: kto"):
        preference_datasets(r, tok)
    r.data.dataset_format = "preference"
    assert len(preference_datasets(r, tok)[0]) == 200
    for paired in ("orpo", "cpo"):  # dpo's shapes, dpo's refusal
        r, tok = build(paired, "--dataset_name", "data/tiny_kto")
        with pytest.raises(RecipeError, match=f"^dataset_format: dataset_name \\(data/tiny_kto, train\\) .* is none of the shapes method {paired} reads: "
                                               "prompt/chosen/rejected"):
            preference_datasets(r, tok)
        r.data.dataset_format = "unpaired_preference"
        with pytest.raises(RecipeError, match=f"^dataset_format: unpaired_preference .* which method {paired} compares; set method: kto"):
            preference_datasets(r, tok)
    r, tok = build("kto", "--dataset_name", "data/tiny_dpo")
    r.data.dataset_format = "unpaired_preference"  # kto asked for unpaired rows, given pairs
    with pytest.raises(RecipeError, match="^dataset_format: unpaired_preference needs the column 'completion'"):
        preference_datasets(r, tok)
    sft = load_recipe(BASE + ["--dataset_name", "data/tiny_dpo"])
    with pytest.raises(RecipeError, match="^dataset_format: preference is data for the preference methods, but method is sft; set method: dpo"):
        formats.detect_format(sft, ["prompt", "chosen", "rejected"], "x", "preference")


# ------------------------------------------------------------------------------------------ TRL tokenizes what it would have


@pytest.mark.parametrize("shape", ["conversational prompt/chosen/rejected", "text prompt/chosen/rejected",
                                   "conversational chosen/rejected (implicit prompt)", "text chosen/rejected (implicit prompt)",
                                   "ShareGPT prompt/chosen/rejected"])
def test_trl_tokenizes_our_rows_as_it_tokenizes_the_raw_ones(tiny_model, tmp_path, shape):
    """The rows handed to DPOTrainer give the tokens TRL makes of the data as written (ShareGPT: as role/content)."""
    written, _ = DPO_SHAPES[shape]
    raw = DPO_SHAPES[shape.replace("ShareGPT", "conversational")][0]
    if shape.startswith("conversational prompt"):  # a row's tools reach the template, here and in TRL
        written = raw = [{**r, "tools": json.dumps(TOOLS)} for r in written]
    r, tok = build("dpo", "--dataset_name", write_jsonl(tmp_path / "d.jsonl", written), "--splits", "train")
    ours = trl_prepared("dpo", preference_datasets(r, tok)[0], tok)
    theirs = trl_prepared("dpo", datasets.Dataset.from_list(raw), tok)
    assert ids(ours, "dpo") == ids(theirs, "dpo")
    if "tools" in written[0]:
        assert "spell" in tok.decode(ours[0]["prompt_ids"])


@pytest.mark.parametrize("data", ["data/tiny_kto", "data/tiny_dpo"])
def test_kto_tokenizes_our_rows_as_it_tokenizes_the_raw_ones(tiny_model, data):
    """Unpaired rows as they are, and pairs unpaired here, give the tokens KTOTrainer makes of the data as written."""
    r, tok = build("kto", "--dataset_name", data, "--splits", "train")
    ours = trl_prepared("kto", preference_datasets(r, tok)[0], tok)
    theirs = trl_prepared("kto", datasets.load_dataset("json", data_files={"train": f"{data}/train.jsonl"}, split="train"), tok)
    assert ids(ours, "kto") == ids(theirs, "kto") and len(ours) == (200 if data.endswith("kto") else 400)


# ------------------------------------------------------------------------------------------ after TRL


def test_truncation_counts_by_hand():
    ds = datasets.Dataset.from_dict({"prompt_ids": [[1, 2, 3], [1, 2], [1, 2, 3, 4]],
                                     "chosen_ids": [[5, 6], [5] * 7, [5]], "rejected_ids": [[7], [7], [7] * 3]})
    # sequences (chosen, rejected): (5, 4), (9, 3), (5, 7); max_length 5
    c = truncation_counts(ds, 5, "keep_start", "dpo", rows_in=4)
    assert (c["rows"], c["dropped"], c["cut"], c["cut_chosen"], c["cut_rejected"]) == (3, 1, 2, 1, 1)
    assert c["tokens"] == {"prompt": 9, "chosen": 10, "rejected": 5, "total": 33, "after_cut": 27}
    assert c["warn"] and "\n" not in c["line"]
    assert "1 dropped by TRL (the prompt alone fills max_length 5)" in c["line"]
    assert "2 cut at max_length 5 (keep_start; chosen 1, rejected 1)" in c["line"] and "27 of 33" in c["line"]
    # keep_end: row 1's chosen alone fills max_length, its prompt is cut away entirely
    c = truncation_counts(ds, 5, "keep_end", "dpo", rows_in=3)
    assert (c["dropped"], c["cut"], c["prompt_cut_away"]) == (0, 2, 1) and "1 with the prompt cut away entirely" in c["line"]
    c = truncation_counts(ds, None, "keep_start", "dpo")
    assert (c["cut"], c["dropped"], c["tokens"]["after_cut"], c["warn"]) == (0, None, 33, False)
    kto = datasets.Dataset.from_dict({"prompt_ids": [[1, 2], [1, 2, 3]], "completion_ids": [[5], [5, 6, 7]],
                                      "KL_completion_ids": [[5, 6, 7], [5]], "label": [True, False]})
    c = truncation_counts(kto, 4, "keep_end", "kto", rows_in=2)  # kto keeps the start whatever truncation_mode says
    assert (c["rows"], c["cut"], c["truncation_mode"], c["tokens"]) == (
        2, 1, "keep_start", {"prompt": 5, "completion": 4, "total": 9, "after_cut": 7})


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_truncation_counts_of_what_trl_prepared(tiny_model, tmp_path, method):
    """Against TRL's own preparation of the shipped rows, their prompts made of 0-3 more words: rows dropped and cut at
    a max_length between the prompts' lengths are those the untruncated preparation's lengths say."""
    shipped = [json.loads(line) for line in open(ROOT / f"data/tiny_{method}/train.jsonl")][:40]
    rows = [{**r, "prompt": [{"role": "user", "content": r["prompt"][0]["content"] + " please" * (i % 4)}]} for i, r in enumerate(shipped)]
    r, tok = build(method, "--dataset_name", write_jsonl(tmp_path / "d.jsonl", rows), "--splits", "train")
    rows = preference_datasets(r, tok)[0]
    whole = trl_prepared(method, rows, tok)
    prompts = sorted(len(p) for p in whole["prompt_ids"])
    limit = prompts[len(prompts) // 2] + 1  # the longer prompts fill it
    completion = "chosen_ids" if method == "dpo" else "completion_ids"
    expect_dropped = sum(len(p) >= limit for p in whole["prompt_ids"])
    expect_cut = sum(len(p) < limit and len(p) + len(c) > limit for p, c in zip(whole["prompt_ids"], whole[completion]))
    c = truncation_counts(trl_prepared(method, rows, tok, max_length=limit), limit, "keep_start", method, rows_in=len(rows))
    assert 0 < c["dropped"] == expect_dropped and c["rows"] == len(rows) - expect_dropped
    assert (c["cut_chosen"] if method == "dpo" else c["cut"]) == expect_cut > 0


@pytest.mark.parametrize("method", ["orpo", "cpo"])
def test_cut_counts_of_what_orpo_and_cpo_prepared(tiny_model, tmp_path, method):
    """ORPOTrainer and CPOTrainer tokenize each row themselves (tokenize_row) and cut the completion's end there,
    keeping the prompt whole and every row: against their own tokenize_row on the shipped pairs, prompts made of 0-3
    more words, at a max_length between the prompts' lengths: the rows at max_length are those whose prompt +
    completion reach it, the rows left with no completion token those whose prompt alone fills it."""
    import functools

    from trl.data_utils import maybe_apply_chat_template

    from sftrecipes.train.options import trl_class

    shipped = [json.loads(line) for line in open(ROOT / "data/tiny_dpo/train.jsonl")][:40]
    rows = [{**r, "prompt": [{"role": "user", "content": r["prompt"][0]["content"] + " please" * (i % 4)}]} for i, r in enumerate(shipped)]
    r, tok = build(method, "--dataset_name", write_jsonl(tmp_path / "d.jsonl", rows), "--splits", "train")
    rows = preference_datasets(r, tok)[0].map(maybe_apply_chat_template, fn_kwargs={"processing_class": tok})
    trainer = trl_class(method, f"{method.upper()}Trainer")

    def prepared(max_length):  # the trainer's own tokenize_row, with the attributes its __init__ gives it
        me = SimpleNamespace(processing_class=tok, is_encoder_decoder=False, max_length=max_length, padding_value=0)
        me.build_tokenized_answer = functools.partial(trainer.build_tokenized_answer, me)
        return rows.map(functools.partial(trainer.tokenize_row, me))

    whole = prepared(10_000)
    prompts = [len(p) for p in whole["prompt_input_ids"]]
    limit = sorted(prompts)[len(prompts) // 2] + 1
    seqs = {c: [len(x) for x in whole[f"{c}_input_ids"]] for c in ("chosen", "rejected")}
    expect_at = sum(any(p < limit <= seqs[c][i] for c in seqs) for i, p in enumerate(prompts))
    expect_empty = sum(p >= limit for p in prompts)
    c = truncation_counts(prepared(limit), limit, "keep_start", method, rows_in=len(rows))
    assert c["rows"] == len(rows) and c["dropped"] == 0
    assert c["cut"] == expect_at > 0 and c["empty_completion"] == expect_empty > 0 and c["warn"]
    assert f"{expect_empty} with no completion token left (the prompt alone fills max_length" in c["line"]
    uncut = truncation_counts(whole, 10_000, "keep_start", method, rows_in=len(rows))
    assert (uncut["cut"], uncut["empty_completion"], uncut["warn"]) == (0, 0, False)
    assert uncut["tokens"]["prompt"] == sum(prompts)


# ------------------------------------------------------------------------------------------ the shipped data


def test_shipped_preference_data_is_the_generator_output_and_follows_its_rule(tmp_path):
    spec = importlib.util.spec_from_file_location("make_preference_data", ROOT / "data/make_preference_data.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.write(tmp_path)
    for folder in ("tiny_dpo", "tiny_kto"):
        for split in ("train", "test"):
            assert (tmp_path / folder / f"{split}.jsonl").read_bytes() == (ROOT / "data" / folder / f"{split}.jsonl").read_bytes()
    dpo = [json.loads(line) for line in open(ROOT / "data/tiny_dpo/train.jsonl")]
    word = lambda msgs: msgs[-1]["content"].rstrip(".").split()[-1]  # noqa: E731
    assert len(dpo) == 200 and all(word(r["prompt"]) == word(r["chosen"]) != word(r["rejected"]) for r in dpo)
    kto = [json.loads(line) for line in open(ROOT / "data/tiny_kto/train.jsonl")]
    assert len(kto) == 200 and all((word(r["prompt"]) == word(r["completion"])) == r["label"] for r in kto)
    assert sum(r["label"] for r in kto) == 100
