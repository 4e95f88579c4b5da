"""The tiny vision-language stand-ins (`python -m sftrecipes tiny --family F --vision`, model/tinyvision.py): each
folder loads with AutoProcessor and AutoModelForImageTextToText as a hub checkpoint does, its template renders image
parts as the family's, the processor gives each image the tokens its config says, and the image reaches the logits.
"""

import pytest
import torch
from PIL import Image

from sftrecipes import cli
from sftrecipes.model.tinyvision import VISION

PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]


def _usable(name: str) -> bool:
    from transformers import utils

    return VISION[name].video_processor is None or utils.is_torchvision_available()


@pytest.mark.parametrize("name", [n for n in VISION if _usable(n)])
def test_tiny_vision_family_loads_and_sees_the_image(name, vision_models):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = vision_models(name)
    processor, model = AutoProcessor.from_pretrained(folder), AutoModelForImageTextToText.from_pretrained(folder)
    assert type(processor).__name__ == VISION[name].processor and model.config.model_type == VISION[name].model_type
    text = processor.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert text.count(processor.image_token) == 1 and "What colour is this?" in text
    image_id = model.config.image_token_id
    out = []
    for colour in ((255, 0, 0), (0, 0, 255)):
        enc = processor(text=[text], images=[[Image.new("RGB", (28, 28), colour)]], return_tensors="pt",
                        add_special_tokens=False)
        assert int((enc["input_ids"] == image_id).sum()) == 4  # 32x32 in 8x8 patches pooled 2x2 (or 56x56 merged 2x2)
        with torch.no_grad():
            out.append(model(**enc).logits[0, -1])
    assert not torch.allclose(out[0], out[1])  # the image reaches the language model (Gemma-3's zero-init projector not)


def test_vision_family_refusals(capsys, tmp_path):
    """`tiny` (cli.main as `python -m sftrecipes` runs it): one line, exit 2, nothing built."""
    for argv, words in ((["--family", "llama3", "--vision"], "--family gemma3 or"), (["--family", "idefics3"], "add --vision"),
                        *([(["--family", "qwen2_5_vl", "--vision"], "needs torchvision")] if not _usable("qwen2_5_vl") else [])):
        assert cli.main(["tiny", *argv, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert words in err and err.strip().count("\n") == 0, err
    assert not list(tmp_path.iterdir())
