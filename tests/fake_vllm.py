"""A stand-in for `vllm` on machines without it (tests/test_vllm_check.py, tests/launch/test_serve.py): `vllm serve
MODEL [--tokenizer T] [--lora-modules NAME=PATH] [--port P] ...` answers /v1/models and /v1/completions (token-id
prompts, temperature 0) as vLLM's OpenAI server does, by transformers' greedy decoding on CPU, stopping where vLLM
stops (the served tokenizer's eos, the model folder's generation_config eos ids), the stop token kept in the tokens as
vLLM keeps it; `vllm --version` prints a version. FAKE_VLLM_ARGV=FILE: the argv is written there (JSON) first. Flags
it does not know are taken, as vLLM would, and ignored."""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main(argv: list[str]) -> int:
    if os.environ.get("FAKE_VLLM_ARGV"):
        with open(os.environ["FAKE_VLLM_ARGV"], "w") as f:
            json.dump(argv, f)
    if argv[:1] == ["--version"]:
        print("0.0.0+fake")
        return 0
    if argv[:1] != ["serve"]:
        sys.stderr.write(f"fake vllm: {argv}\n")
        return 2
    model, opts, i = argv[1], {}, 2
    while i < len(argv):
        key = argv[i]
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            opts[key], i = argv[i + 1], i + 2
        else:
            opts[key], i = True, i + 1
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(opts.get("--tokenizer", model))
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    models = {opts.get("--served-model-name", model): net}
    if "--lora-modules" in opts:
        name, _, path = opts["--lora-modules"].partition("=")
        models[name] = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), path).eval()
    eos = GenerationConfig.from_pretrained(model).eos_token_id
    stops = {tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.reply({"data": [{"id": m} for m in models]})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids = list(req["prompt"])
            new = []
            with torch.no_grad():
                for _ in range(req["max_tokens"]):
                    nxt = int(models[req["model"]](torch.tensor([ids + new])).logits[0, -1].argmax())
                    new.append(nxt)
                    if nxt in stops:
                        break
            self.reply({"choices": [{"text": tok.decode(new, skip_special_tokens=True),
                                     "logprobs": {"tokens": [f"token_id:{t}" for t in new]}}]})

    ThreadingHTTPServer((opts.get("--host", "127.0.0.1"), int(opts.get("--port", 8000))), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
