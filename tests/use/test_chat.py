"""`python -m sftrecipes chat` (sftrecipes/use/chat.py) as a person uses it: a real terminal (tmux), lines typed, the
screen read. Each reply must be what greedy decoding gives with transformers and peft directly (the adapter on its
base, the run's own tokenizer: its template and end of turn), the history must reach the model, /reset must forget it
and /exit must end the program; `--prompt` gives one answer on stdout; a folder chat cannot use is one line, exit 2."""

import json
import os
import shlex
import subprocess
import sys
import time
import uuid

import pytest
import torch
from conftest import ROOT, run_cli
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW = 12  # tokens a reply may have


def greedy(folder, turns: list[str]) -> list[str]:
    """The replies greedy decoding gives to `turns`, one conversation, outside the project's code: the folder's own
    tokenizer, the adapter (if it is one) on its base through peft, generation stopped at the tokenizer's eos (the
    run's end of turn) or the model's own eos."""
    tok = AutoTokenizer.from_pretrained(folder)
    if (folder / "adapter_config.json").is_file():
        base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder)
    own = model.generation_config.eos_token_id
    eos = list(dict.fromkeys([tok.eos_token_id] + (own if isinstance(own, list) else [own])))
    history, replies = [], []
    for text in turns:
        history.append({"role": "user", "content": text})
        enc = tok.apply_chat_template(history, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            gen = model.generate(**enc, do_sample=False, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=eos[0])
        reply = tok.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        history.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies


class Terminal:
    """A tmux session of its own (its own server socket) running one command in a 200-column window."""

    def __init__(self, command: str):
        self.sock = f"sftrecipes-test-{uuid.uuid4().hex[:8]}"
        env = {k: v for k, v in os.environ.items() if k != "SFTRECIPES_FORK_SERVER"}  # a real process, as users start it
        subprocess.run(["tmux", "-L", self.sock, "-f", "/dev/null", "new-session", "-d", "-x", "200", "-y", "50",
                        "-c", str(ROOT), command], check=True, env=env)

    def screen(self) -> str:
        res = subprocess.run(["tmux", "-L", self.sock, "capture-pane", "-p", "-J", "-S", "-"], capture_output=True, text=True)
        return res.stdout

    def type(self, line: str) -> None:
        subprocess.run(["tmux", "-L", self.sock, "send-keys", "-l", line], check=True)
        subprocess.run(["tmux", "-L", self.sock, "send-keys", "Enter"], check=True)

    def wait_for(self, done, timeout: float = 180) -> str:
        end = time.time() + timeout
        while time.time() < end:
            text = self.screen()
            if done(text):
                return text
            time.sleep(0.2)
        pytest.fail(f"the terminal never showed what was waited for; it shows:\n{self.screen()[-3000:]}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], capture_output=True)


def _prompts(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.startswith("> "))


def _reply_after(text: str, typed: str) -> str:
    """What the program wrote between the line the user typed and its next prompt."""
    lines = text.splitlines()
    i = max(k for k, line in enumerate(lines) if line == f"> {typed}")
    out = []
    for line in lines[i + 1:]:
        if line.startswith(">"):
            break
        out.append(line)
    return "\n".join(out).strip()


def test_chat_in_a_terminal_answers_what_greedy_decoding_answers(twin_runs):
    run, _, _ = twin_runs("ddp")  # a LoRA adapter, trained on 2 ranks, with its tokenizer (chatml)
    first, second = "What is the capital of France?", "And the capital of Spain?"
    want = greedy(run, [first, second])
    want_alone = greedy(run, [second])[0]
    assert want[1] != want_alone, "the history does not change the reply here: the test could not see /reset"
    cmd = f"{shlex.quote(sys.executable)} -m sftrecipes chat {shlex.quote(str(run))} --max_new_tokens {NEW}; echo CHAT-EXIT=$?; sleep 60"
    term = Terminal(cmd)
    try:
        term.wait_for(lambda t: _prompts(t) == 1)
        assert "/reset" in term.screen() and "/exit" in term.screen()  # the banner says how to leave
        for n, (typed, expected) in enumerate(((first, want[0]), (second, want[1])), start=2):
            term.type(typed)
            screen = term.wait_for(lambda t, n=n: _prompts(t) == n)
            assert _reply_after(screen, typed) == expected.strip(), screen[-2000:]
        term.type("/reset")
        term.wait_for(lambda t: "(a new conversation)" in t and _prompts(t) == 4)
        term.type(second)
        screen = term.wait_for(lambda t: _prompts(t) == 5)
        assert _reply_after(screen, second) == want_alone.strip(), screen[-2000:]
        term.type("/exit")
        term.wait_for(lambda t: "CHAT-EXIT=0" in t)
    finally:
        term.close()


def test_chat_prompt_gives_one_answer_and_a_folder_it_cannot_use_is_one_line(tiny_model, tmp_path):
    res = run_cli(["-m", "sftrecipes", "chat", str(tiny_model), "--prompt", "Hello there", "--max_new_tokens", str(NEW)])
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == greedy(tiny_model, ["Hello there"])[0].strip()
    (tmp_path / "checkpoint-3").mkdir()
    for args, says in (([str(tmp_path / "missing")], "is not a folder"),
                       ([str(tmp_path)], "holds no model (config.json) and no LoRA adapter (adapter_config.json) but checkpoint-3"),
                       ([str(tiny_model), "--temperature", "-1"], "--temperature")):
        res = run_cli(["-m", "sftrecipes", "chat", *args])
        assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr, res.stderr[-1500:]
