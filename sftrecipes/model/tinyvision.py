"""What a tiny vision-language stand-in needs beyond a text family (`VISION`): its config's tower and image-token keys,
its processor and image processor classes from transformers with small image sizes, the image tokens its tokenizer
carries, and a chat template that renders image parts as the family's released template does.

tiny.py builds the folder (`python -m sftrecipes tiny --family gemma3 --vision`): the text family's tokenizer with
these tokens, `tiny_archs.tiny_config` with these keys, the model from AutoModelForImageTextToText, the processor
from `build_processor`; AutoProcessor and AutoModelForImageTextToText load it as they load a hub checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import transformers

from sftrecipes.core.errors import RecipeError

_PARTS = ("{%- if message['content'] is string %}{{- STRING }}{%- else %}{%- for part in message['content'] %}"
          "{%- if part['type'] == 'image' %}{{- IMAGE }}{%- elif part['type'] == 'text' %}{{- TEXT }}"
          "{%- endif %}{%- endfor %}{%- endif %}")


def _parts(image: str, string: str = "message['content']", text: str = "part['text']") -> str:
    """A template's content rendering: a plain string, or image and text parts in their order."""
    return _PARTS.replace("STRING", string).replace("IMAGE", image).replace("TEXT", text)


# Gemma-3 (gemma-3-4b-it's template): BOS, the system text into the first user turn, 'model' for the assistant,
# an image part as <start_of_image> (the processor expands it to <start_of_image> + image tokens + <end_of_image>)
GEMMA3_VISION_TEMPLATE = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}"
    "{%- set first = (messages[0]['content'] if messages[0]['content'] is string else messages[0]['content'][0]['text'])"
    " + '\\n\\n' %}{%- set messages = messages[1:] %}{%- else %}{%- set first = '' %}{%- endif %}"
    "{%- for message in messages %}{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (first if loop.first else '') }}"
    + _parts("'<start_of_image>'", "message['content'] | trim", "part['text'] | trim")
    + "{{- '<end_of_turn>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)
# Qwen2-VL / Qwen2.5-VL: ChatML, an image part as <|vision_start|><|image_pad|><|vision_end|> (the processor repeats
# <|image_pad|> once per merged patch)
QWEN_VL_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    + _parts("'<|vision_start|><|image_pad|><|vision_end|>'")
    + "{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Idefics3 / SmolVLM: 'User:' / 'Assistant:' turns closed by <end_of_utterance>, an image part as <image>
IDEFICS3_TEMPLATE = (
    "{{- '<|im_start|>' }}{%- for message in messages %}{{- message['role'] | capitalize }}"
    "{%- if message['content'] is not string and message['content'][0]['type'] == 'image' %}{{- ':' }}"
    "{%- else %}{{- ': ' }}{%- endif %}" + _parts("'<image>'")
    + "{{- '<end_of_utterance>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- 'Assistant:' }}{%- endif %}"
)


@dataclass(frozen=True)
class VisionFamily:
    """A tiny vision-language model of one family.

    model_type: transformers' config (AutoConfig.for_model); text: the tiny text family whose tokenizer habits it
    keeps (tiny.FAMILIES); tokens: the image tokens its tokenizer lists, by the attribute name the processor reads
    (image_token, boi_token ...); eos: its end of turn where it differs from the text family's; vision: the tower's
    sizes; ids: config keys set to a token's id; extra: other config keys (the image tokens per image); processor /
    image_processor: transformers' class names, with processor_kwargs / image_kwargs; template: the chat template.
    """

    model_type: str
    text: str
    tokens: tuple[tuple[str, str], ...]
    vision: dict
    ids: tuple[tuple[str, str], ...]
    extra: dict
    processor: str
    image_processor: str
    image_kwargs: dict
    processor_kwargs: dict
    template: str
    eos: str | None = None
    video_processor: str | None = None  # where the processor class requires one (Qwen-VL)


VISION: dict[str, VisionFamily] = {
    # Gemma-3 (gemma-3-4b-it): SigLIP without its pooling head, 32x32 images in 8x8 patches pooled to 2x2 = 4 tokens
    "gemma3": VisionFamily(
        "gemma3", "gemma3",
        tokens=(("boi_token", "<start_of_image>"), ("eoi_token", "<end_of_image>"), ("image_token", "<image_soft_token>")),
        vision=dict(image_size=32, patch_size=8, num_hidden_layers=2, vision_use_head=False),
        ids=(("boi_token_index", "<start_of_image>"), ("eoi_token_index", "<end_of_image>"),
             ("image_token_index", "<image_soft_token>")),
        extra=dict(mm_tokens_per_image=4), processor="Gemma3Processor", image_processor="Gemma3ImageProcessorPil",
        image_kwargs=dict(size={"height": 32, "width": 32}), processor_kwargs=dict(image_seq_length=4),
        template=GEMMA3_VISION_TEMPLATE),
    # Qwen2.5-VL: 14x14 patches merged 2x2; images scaled to 56x56 at least (4 tokens), 112x112 at most (16 tokens)
    "qwen2_5_vl": VisionFamily(
        "qwen2_5_vl", "qwen2",
        tokens=(("vision_start_token", "<|vision_start|>"), ("vision_end_token", "<|vision_end|>"),
                ("image_token", "<|image_pad|>"), ("video_token", "<|video_pad|>")),
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, window_size=56,
                    fullatt_block_indexes=[1]),
        ids=(("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
             ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")),
        extra=dict(text_rope=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3])),
        processor="Qwen2_5_VLProcessor", image_processor="Qwen2VLImageProcessorPil",
        image_kwargs=dict(min_pixels=56 * 56, max_pixels=112 * 112), processor_kwargs={}, template=QWEN_VL_TEMPLATE,
        video_processor="Qwen2VLVideoProcessor"),
    # SmolVLM / Idefics3: SigLIP 32x32 in 8x8 patches, pixel-shuffled by 2 = 4 tokens, no image splitting
    "idefics3": VisionFamily(
        "idefics3", "qwen2",
        tokens=(("fake_image_token", "<fake_token_around_image>"), ("image_token", "<image>"),
                ("end_of_utterance_token", "<end_of_utterance>"), ("global_image_token", "<global-img>")),
        vision=dict(image_size=32, patch_size=8, num_hidden_layers=2), ids=(("image_token_id", "<image>"),),
        extra=dict(scale_factor=2), processor="Idefics3Processor", image_processor="Idefics3ImageProcessorPil",
        image_kwargs=dict(do_image_splitting=False, size={"longest_edge": 32}, max_image_size={"longest_edge": 32}),
        processor_kwargs=dict(image_seq_len=4), template=IDEFICS3_TEMPLATE, eos="<end_of_utterance>"),
}


def config_keys(fam: VisionFamily, tokenizer) -> dict:
    """The config keys besides the tiny sizes: the image tokens' ids in this tokenizer, the family's extra keys."""
    return {**{k: tokenizer.convert_tokens_to_ids(t) for k, t in fam.ids},
            **{k: v for k, v in fam.extra.items() if k != "text_rope"}}


def text_keys(fam: VisionFamily) -> dict:
    """Keys of the text config (Qwen-VL's multimodal RoPE sections, summing to the tiny head's half)."""
    return {"rope_parameters": fam.extra["text_rope"]} if "text_rope" in fam.extra else {}


def build_processor(name: str, tokenizer):
    """The family's processor from transformers' classes: its image processor with small sizes, the tokenizer, the
    template. A processor class that needs a part this environment cannot build (Qwen-VL's video processor needs
    torchvision) is one line naming what to install."""
    fam = VISION[name]
    cls, parts = getattr(transformers, fam.processor), {}
    if "video_processor" in cls.get_attributes():
        if not transformers.utils.is_torchvision_available():
            others = " or ".join(n for n, f in VISION.items() if f.video_processor is None)
            raise RecipeError(f"--family {name} --vision: transformers' {fam.processor} requires a video processor, "
                              f"which needs torchvision; install it (pip install torchvision) or choose --family {others}")
        parts["video_processor"] = getattr(transformers, fam.video_processor)()
    image_processor = getattr(transformers, fam.image_processor)(**fam.image_kwargs)
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=fam.template, **parts,
               **fam.processor_kwargs)
