"""Issue 42's first increment, for real on CPU: recipes/tiny/lora.yaml with model_name_or_path set to the tiny
Gemma-3 vision-language model (tiny --family gemma3 --vision) trains on rows in TRL's vision format (an `images`
column of local PNGs, content as image and text parts), and the images reach it: after training, the greedy answer
to "What colour is this?" follows the image. The same rows with every image one grey square cannot be told apart,
so the answers cannot follow the colour. The adapter merges with --verify and loads with AutoModelForImageTextToText
and AutoProcessor; the same recipe launches on 2 ranks (DDP).
"""

import json

import pytest
import torch
from PIL import Image

import train
from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.load import load_recipe

COLOURS = {"red": (255, 0, 0), "blue": (0, 0, 255)}
QUESTION = [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]


def _rows(folder, grey: bool = False, n: int = 8):
    """folder/train.jsonl (the dataset: one file, its train split) naming folder/img/<i>.png by relative paths."""
    (folder / "img").mkdir(parents=True)
    rows = []
    for i in range(n):
        word = list(COLOURS)[i % 2]
        Image.new("RGB", (28, 28), (128, 128, 128) if grey else COLOURS[word]).save(folder / "img" / f"{i}.png")
        rows.append({"images": [f"img/{i}.png"], "messages": [
            {"role": "user", "content": QUESTION}, {"role": "assistant", "content": [{"type": "text", "text": word}]}]})
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "train.jsonl"


def _flags(model, data, out, *extra):
    return ["recipes/tiny/lora.yaml", "--model_name_or_path", str(model), "--dataset_name", str(data), "--splits", "train",
            "--output_dir", str(out), "--chat_template_format", "tokenizer", "--packing", "false",
            "--assistant_only_loss", "true", "--max_steps", "20", "--learning_rate", "0.02",
            "--per_device_train_batch_size", "4", "--logging_steps", "10", *extra]


def _answers(model, processor) -> dict[str, str]:
    prompt = processor.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           tokenize=False)
    out = {}
    model.eval()
    for word, rgb in COLOURS.items():
        enc = processor(text=[prompt], images=[[Image.new("RGB", (28, 28), rgb)]], return_tensors="pt",
                        add_special_tokens=False)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=4, do_sample=False)
        out[word] = processor.tokenizer.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    return out


@pytest.fixture(scope="module")
def vision_run(vision_models, tmp_path_factory):
    model, root = vision_models("gemma3"), tmp_path_factory.mktemp("vision")
    trainer, summary = train.run(load_recipe(_flags(model, _rows(root / "data"), root / "out")))
    return model, root, trainer, summary


def test_images_reach_the_model_and_the_answer_follows_the_colour(vision_run, caplog):
    """The data line counts rows and images; LoRA on the language model only; the labels train the assistant's word
    and its end of turn, never an image token; after training the answer is the image's colour."""
    model, root, trainer, summary = vision_run
    assert summary["data"]["train"] == {"read": 8, "dropped_too_long": 0, "kept": 8, "images": 8, "rows_with_images": 8}
    batch = trainer.data_collator([trainer.train_dataset[0]])
    tok = trainer.processing_class.tokenizer
    trained = tok.convert_ids_to_tokens(batch["input_ids"][0][batch["labels"][0] != -100])
    assert "".join(trained).replace("Ġ", "") in ("red<end_of_turn>", "red<end_of_turn>Ċ"), trained
    assert int((batch["input_ids"] == trainer.model.config.image_token_id).sum()) == 4
    adapted = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapted and all(".language_model." in n for n in adapted), sorted(adapted)[:3]
    assert _answers(trainer.model, trainer.processing_class) == {"red": "red", "blue": "blue"}
    saved = json.loads((root / "out" / "processor_config.json").read_text())
    assert saved["processor_class"] == "Gemma3Processor"
    # the end-of-run sample: the first row's question with its image (red), answered through the processor
    sample = summary["sample"]
    assert sample["images"] == [str(root / "data" / "img" / "0.png")] and sample["reply"].strip() == "red", sample


def test_grey_images_cannot_teach_the_colour(vision_models, tmp_path):
    """The control: the same rows and run with every image one grey square. It learns the answers' words but not which
    image each belongs to, so its answers do not follow the colour: the test above fails where images are dropped."""
    model = vision_models("gemma3")
    trainer, summary = train.run(load_recipe(_flags(model, _rows(tmp_path / "data", grey=True), tmp_path / "out")))
    assert summary["steps"] == 20 and summary["data"]["train"]["images"] == 8
    answers = _answers(trainer.model, trainer.processing_class)
    assert set(answers.values()) <= set(COLOURS) and answers != {"red": "red", "blue": "blue"}, answers


def test_chat_with_an_image_answers_its_colour_and_refuses_in_one_line(vision_run, tiny_model, tmp_path):
    """`chat RUN --image PATH`: the first message shows the image (the adapter on its base, the run's processor);
    a missing or unreadable file, or a model without a vision tower, is one line before torch loads."""
    from conftest import run_cli

    _, root, _, _ = vision_run
    for word, rgb in COLOURS.items():
        Image.new("RGB", (28, 28), rgb).save(tmp_path / f"{word}.png")
        res = run_cli(["-m", "sftrecipes", "chat", str(root / "out"), "--prompt", "What colour is this?", "--image",
                       str(tmp_path / f"{word}.png"), "--max_new_tokens", "4"])
        assert res.returncode == 0 and res.stdout.strip() == word, (word, res.stdout, res.stderr[-2000:])
    (tmp_path / "notes.png").write_text("not an image")
    for folder, image, says in ((root / "out", tmp_path / "nowhere.png", "is not a file"),
                                (root / "out", tmp_path / "notes.png", "cannot be read as an image"),
                                (tiny_model, tmp_path / "red.png", "has no vision tower")):
        res = run_cli(["-m", "sftrecipes", "chat", str(folder), "--prompt", "?", "--image", str(image)])
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --image: ") and says in lines[0], res.stderr


def test_the_vision_adapter_merges_with_verify_and_loads(vision_run, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from sftrecipes.export import merge_lora

    _, root, trainer, _ = vision_run
    merged = merge_lora(root / "out", tmp_path / "merged", verify=True)
    processor = AutoProcessor.from_pretrained(merged)
    model = AutoModelForImageTextToText.from_pretrained(merged)
    assert _answers(model, processor) == {"red": "red", "blue": "blue"}


def test_vision_rows_refused_in_one_line(vision_models, tiny_model, tmp_path):
    """Packing; a template that renders image parts as text (chatml); a missing image file; a text model."""
    from sftrecipes.data import vision
    from sftrecipes.data.tokenizer import load_tokenizer

    model, data = vision_models("gemma3"), _rows(tmp_path / "data", n=2)
    recipe = load_recipe(_flags(model, data, tmp_path / "o"))
    with pytest.raises(RecipeError, match="^packing: rows with images cannot be packed"):
        load_recipe(_flags(model, data, tmp_path / "o", "--packing", "true"))
    with pytest.raises(RecipeError, match="^chat_template_format: the chatml template renders an image part without"):
        train.run(load_recipe(_flags(model, data, tmp_path / "o", "--chat_template_format", "chatml")))
    (data.parent / "img" / "1.png").unlink()  # torch-free when the recipe is read, and where the run reads the rows
    with pytest.raises(RecipeError, match=r"^images: image 1 of row 2 of dataset_name .* names img/1.png, which is not a file"):
        load_recipe(_flags(model, data, tmp_path / "o"))
    with pytest.raises(RecipeError, match=r"^images: image 1 of row 2 of dataset_name .* names img/1.png, which is not a file"):
        vision.vision_datasets(recipe, load_tokenizer(recipe)[0])
    with pytest.raises(RecipeError, match="has no vision tower"):
        load_recipe(_flags(tiny_model, data, tmp_path / "o"))
    assert not (tmp_path / "o").exists()


# twin -> the backend run_summary.json must show
TWO_RANKS = {"ddp": ("MULTI_CPU", "DistributedDataParallel"), "zero3": ("DEEPSPEED", None), "fsdp": ("FSDP", None),
             "qlora-fsdp": ("FSDP", None), "qlora-zero3": ("DEEPSPEED", None)}


@pytest.mark.parametrize("twin", list(TWO_RANKS))
def test_the_vision_recipe_launches_on_two_ranks(vision_run, tmp_path, twin):
    """The same rows and model through each 2-rank twin under `launch` (DDP, ZeRO-3 LoRA, FSDP2 full, QLoRA on FSDP2
    and on ZeRO-3): each rank reads the rows with their images; LoRA on the language model only; QLoRA keeps the vision
    tower, the projector and the head in 16 bits (bitsandbytes' CPU kernels could not even run the tiny tower's 16-wide
    layers in 4 bits); every rank takes the end-of-run sample with its image together; the processor is saved with
    every checkpoint and the final model."""
    from conftest import run_cli

    model, root, _, _ = vision_run
    out = tmp_path / twin
    res = run_cli(["-m", "sftrecipes", "launch", f"recipes/tiny/{twin}.yaml", "--model_name_or_path", str(model),
                   "--dataset_name", str(root / "data" / "train.jsonl"), "--splits", "train", "--chat_template_format",
                   "tokenizer", "--packing", "false", "--assistant_only_loss", "true", "--max_steps", "2",
                   "--sample_max_new_tokens", "2", "--save_strategy", "steps", "--save_steps", "2", "--output_dir", str(out)])
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-3000:]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 2 and summary["data"]["train"]["images"] == 8
    backend, wrapper = TWO_RANKS[twin]
    assert summary["backend"]["world_size"] == 2 and summary["backend"]["distributed_type"] == backend, summary["backend"]
    assert wrapper is None or summary["backend"]["wrapper"] == wrapper
    lora = twin != "fsdp"  # (the FSDP2 twin is a full fine-tune)
    assert ("LoRA on the language model: 42 modules; vision tower and projector frozen" in log) == lora, log[-3000:]
    assert ("quantization: model.vision_tower, model.multi_modal_projector, lm_head kept in 16 bits" in log) == \
        twin.startswith("qlora"), log[-3000:]
    assert summary["sample"]["new_tokens"] == 2 and summary["sample"]["images"] == [str(root / "data" / "img" / "0.png")]
    weights = "adapter_model.safetensors" if lora else "pytorch_model_fsdp_0"  # (the twin saves FSDP2's shards)
    # the processor with the final model, and with every checkpoint but FSDP's sharded ones (transformers writes no
    # tokenizer or processor there: still open; the run folder has them)
    for folder in (out, out / "checkpoint-2") if "fsdp" not in twin else (out,):
        assert (folder / "processor_config.json").is_file(), sorted(p.name for p in folder.iterdir())
    assert (out / weights).exists(), sorted(p.name for p in out.iterdir())


def test_one_image_column_of_bytes_is_read_as_the_rows_images(vision_models, tmp_path):
    """TRL's other shape: one `image` per row, here PNG bytes in a parquet file: read as the row's images, counted, and
    each batch holds one image's tokens per row, none of them in the labels."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from sftrecipes.data import vision
    from sftrecipes.data.tokenizer import load_tokenizer

    rows = []
    for word, rgb in COLOURS.items():
        png = io.BytesIO()
        Image.new("RGB", (28, 28), rgb).save(png, format="PNG")
        rows.append({"image": png.getvalue(), "messages": [{"role": "user", "content": QUESTION},
                                                           {"role": "assistant", "content": [{"type": "text", "text": word}]}]})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    recipe = load_recipe(_flags(vision_models("gemma3"), tmp_path / "train.parquet", tmp_path / "o"))
    train_ds, _, counts, collator, _, (prompt, images) = vision.vision_datasets(recipe, load_tokenizer(recipe)[0])
    assert counts["train"] == {"read": 2, "dropped_too_long": 0, "kept": 2, "images": 2, "rows_with_images": 2}
    assert prompt == [{"role": "user", "content": QUESTION}] and images == [rows[0]["image"]]  # the sample's, as bytes
    assert vision.open_images(images)[0].getpixel((0, 0)) == COLOURS["red"]
    batch = collator([train_ds[0], train_ds[1]])
    image_id = collator.processor.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    assert (batch["input_ids"] == image_id).sum(dim=1).tolist() == [4, 4] and batch["pixel_values"].shape[0] == 2
    assert not (batch["labels"] == image_id).any()


def test_a_model_only_image_text_to_text_maps_trains_and_merges(vision_models, tmp_path):
    """Idefics3 (SmolVLM) has no causal-LM class in transformers: it is planned, loaded and verified through
    AutoModelForImageTextToText (meta.auto_class), its assistant turn trained, its adapter merged with --verify."""
    from transformers import AutoModelForImageTextToText

    from sftrecipes.export import merge_lora
    from sftrecipes.plan import plan_recipe

    recipe = load_recipe(_flags(vision_models("idefics3"), _rows(tmp_path / "data", n=4), tmp_path / "out", "--max_steps", "2"))
    assert plan_recipe(recipe, _alternatives=False).notes  # (was: "no causal-LM head", before any rank)
    trainer, summary = train.run(recipe)
    batch = trainer.data_collator([trainer.train_dataset[0]])
    trained = trainer.processing_class.tokenizer.convert_ids_to_tokens(batch["input_ids"][0][batch["labels"][0] != -100])
    assert trained == ["Ġred", "<end_of_utterance>", "Ċ"] and summary["steps"] == 2
    merged = merge_lora(tmp_path / "out", tmp_path / "merged", verify=True)
    assert type(AutoModelForImageTextToText.from_pretrained(merged)).__name__ == "Idefics3ForConditionalGeneration"
