"""`chat`: a trained run (an adapter on its base, never merged) or a model folder answering in a terminal with the run's
own chat template and end tokens, its reply streamed as it is generated; a conversation kept until /reset, /exit ends.

    python -m sftrecipes chat outputs/tiny-lora                    # a terminal chat (history kept, /reset, /exit)
    python -m sftrecipes chat outputs/tiny-lora --prompt "Hi"      # one answer, for scripts
    python -m sftrecipes chat outputs/vl-lora --image cat.png      # a vision-language run: the first message shows it
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer, TextStreamer

from sftrecipes.data.tokenizer import end_of_turn_id
from sftrecipes.facts import startmodel

PROMPT = "> "
HELP = "/reset: a new conversation (the system prompt kept)   /exit (or Ctrl-D): leave"


def load(folder: Path, images: bool = False):
    """(model, tokenizer) of a model folder, or of an adapter folder on its base (peft's PeftModel, not merged); the
    tokenizer is the folder's own: the run saved it with its template and its end of turn as eos. images: the
    image-text-to-text class (its vision tower) and the folder's processor, as (model, processor)."""
    adapter = startmodel.adapter_of(str(folder))
    tok = AutoProcessor.from_pretrained(folder) if images else AutoTokenizer.from_pretrained(folder)
    auto = AutoModelForImageTextToText if images else AutoModelForCausalLM
    if adapter is None:
        model = auto.from_pretrained(folder, dtype="auto")
    else:
        from peft import PeftModel

        base = auto.from_pretrained(startmodel.base_of(adapter), dtype="auto")
        if len(getattr(tok, "tokenizer", tok)) > base.get_input_embeddings().weight.shape[0]:  # the run added tokens
            base.resize_token_embeddings(len(getattr(tok, "tokenizer", tok)))  # (its template's): as trained
        model = PeftModel.from_pretrained(base, adapter)
    model.eval()
    return model, tok


def stops(model, tok) -> tuple[list[int], list[str]]:
    """Where a reply ends: the end of turn the template closes an assistant turn with (a token, or text), the
    tokenizer's eos and the model's own eos ids."""
    eot_id, eot, kind = end_of_turn_id(tok)
    ids = [eot_id] if eot_id is not None else []
    texts = [eot] if kind == "text" and eot else []
    own = model.generation_config.eos_token_id
    ids += [tok.eos_token_id] + (own if isinstance(own, list) else [own])
    return list(dict.fromkeys(i for i in ids if i is not None)), texts


class Chat:
    """One conversation with `model`: reply() renders the history with the tokenizer's chat template, generates (greedy
    at temperature 0) until an end token, streams the text to `out` as it comes, and keeps the turn. With a processor
    and an image, each conversation's first message shows the image (an image part before its text)."""

    def __init__(self, model, tok, system: str | None = None, temperature: float = 0.0, max_new_tokens: int = 256,
                 image=None):
        self.processor = tok if image is not None else None
        tok = getattr(tok, "tokenizer", tok)
        self.model, self.tok, self.system, self.image = model, tok, system, image
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.eos, self.stop_strings = stops(model, tok)
        self.history: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str, out=None) -> str:
        first = not any(m["role"] == "user" for m in self.history)
        if self.processor is not None and first:
            self.history.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]})
        else:
            self.history.append({"role": "user", "content": [{"type": "text", "text": text}] if self.processor else text})
        if self.processor is not None:
            shown = self.processor.apply_chat_template(self.history, add_generation_prompt=True, tokenize=False)
            enc = self.processor(text=[shown], images=[[self.image]], return_tensors="pt", add_special_tokens=False)
        else:
            enc = self.tok.apply_chat_template(self.history, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        streamer = _Streamer(self.tok, out) if out is not None else None
        sample = self.temperature > 0
        kw = dict(do_sample=sample, max_new_tokens=self.max_new_tokens, eos_token_id=self.eos,
                  pad_token_id=self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos[0],
                  streamer=streamer, temperature=self.temperature if sample else None, top_p=None, top_k=None)
        if self.stop_strings:
            kw.update(stop_strings=self.stop_strings, tokenizer=self.tok)
        with torch.no_grad():
            gen = self.model.generate(**enc, **kw)
        answer = self.tok.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for s in self.stop_strings:  # a textual end of turn is generated, then cut here
            answer = answer.split(s, 1)[0]
        self.history.append({"role": "assistant", "content": [{"type": "text", "text": answer}] if self.processor else answer})
        return answer


class _Streamer(TextStreamer):
    """transformers' TextStreamer without the prompt and the special tokens, written to `out` as each piece is final."""

    def __init__(self, tok, out):
        super().__init__(tok, skip_prompt=True, skip_special_tokens=True)
        self.out = out

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.out.write(text + ("\n" if stream_end else ""))
        self.out.flush()


def main(folder: Path, prompt: str | None, system: str | None, temperature: float, max_new_tokens: int,
         image: str | None = None) -> int:
    model, tok = load(folder, images=image is not None)
    if image is not None:
        from PIL import Image

        image = Image.open(image).convert("RGB")
    chat = Chat(model, tok, system, temperature, max_new_tokens, image=image)
    if prompt is not None:  # one answer, nothing else on stdout
        print(chat.reply(prompt))
        return 0
    print(f"chat with {folder} ({'greedy' if temperature == 0 else f'temperature {temperature}'}, at most "
          f"{max_new_tokens} new tokens)   {HELP}", flush=True)
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            print()
            return 0
        text = line.strip()
        if text == "/exit":
            return 0
        if text == "/reset":
            chat.reset()
            print("(a new conversation)", flush=True)
            continue
        if not text:
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]}; {HELP}", flush=True)
            continue
        chat.reply(text, out=sys.stdout)
