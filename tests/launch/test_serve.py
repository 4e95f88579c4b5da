"""scripts/serve_<name>.sh (sftrecipes/launch/serve.py; what vLLM cannot serve as a LoRA: sftrecipes/facts/servable.py):
the command lines of the shipped scripts, read back as argv; a user's recipe through `emit` and its script run with
bash from another folder -- without vllm on PATH, before its folder exists, with adapters vLLM can and cannot serve --
every refusal one line, exit 2, naming the key, its targets and the fix; vLLM's rank rule and the GPU split."""

import json
import os
import shlex
import shutil
import subprocess

import pytest
import yaml

from conftest import ROOT, run_cli
from sftrecipes.core.paths import RECIPES
from sftrecipes.facts.servable import max_lora_rank, obstacles
from sftrecipes.launch.emit import SETUPS
from sftrecipes.launch.serve import serve_plan
from sftrecipes.recipe.load import load_recipe

pytestmark = pytest.mark.usefixtures("tiny_model")
SCRIPTS = ROOT / "scripts"
RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py's MaxLoRARanks, the values --max-lora-rank takes


def exec_argv(script: str) -> list[str]:
    """The `exec vllm serve ...` line of a serve script as the words bash passes (variables left as written)."""
    line = next(ln for ln in script.splitlines() if ln.startswith("exec vllm serve "))
    return shlex.split(line)[1:]


def options(argv: list[str]) -> dict:
    """--flag value pairs after `vllm serve MODEL` (a flag without a value: True)."""
    out, rest = {}, argv[3:]
    for i, a in enumerate(rest):
        if a.startswith("--"):
            out[a] = rest[i + 1] if i + 1 < len(rest) and not rest[i + 1].startswith("--") and rest[i + 1] != "$@" else True
    return out


def assignment(script: str, var: str) -> str:
    """A variable's value as bash assigns it (the script's own line, run alone)."""
    line = next(ln for ln in script.splitlines() if ln.strip().startswith(f"{var}="))
    return subprocess.run(["bash", "-c", f'{line.strip()}\nprintf "%s" "${var}"'], capture_output=True, text=True).stdout


def test_every_recipe_has_its_serve_script():
    runs = {p.name.removeprefix("run_") for p in SCRIPTS.glob("run_*.sh")}
    serves = {p.name.removeprefix("serve_") for p in SCRIPTS.glob("serve_*.sh")}
    assert runs == serves and len(serves) > 30
    assert all(os.access(SCRIPTS / f"serve_{n}", os.X_OK) for n in serves)


def test_shipped_lora_scripts_serve_the_adapter_on_its_base():
    """The base with the run's adapter under the recipe's name and the run's tokenizer; --max-lora-rank the smallest
    value vLLM takes at or above lora_r; --dtype from bf16; --max-model-len the run's max_length."""
    for name, recipe, tp in (("llama3.1-70b-lora", "recipes/llama3.1-70b/lora.yaml", "4"),
                             ("llama3.1-70b-qlora", "recipes/llama3.1-70b/qlora.yaml", "8"),
                             ("tiny-lora", "recipes/tiny/lora.yaml", "1")):
        r = load_recipe([recipe])
        text = (SCRIPTS / f"serve_{name}.sh").read_text()
        argv = exec_argv(text)
        opts = options(argv)
        assert argv[:3] == ["vllm", "serve", r.model.model_name_or_path] and argv[-1] == "$@", argv
        assert opts == {"--tokenizer": "$ADAPTER", "--enable-lora": True, "--lora-modules": f"{name}=$ADAPTER",
                        "--max-lora-rank": str(min(v for v in RANKS if v >= r.model.lora_r)),
                        "--dtype": "bfloat16" if r.trl_value("bf16") else "auto",
                        "--max-model-len": str(r.trl_value("max_length")), "--tensor-parallel-size": tp}, (name, opts)
        assert assignment(text, "OUTPUT_DIR") == r.trl["output_dir"]
        # the merged form, named in the comments and in the refusal
        assert f"vllm serve {r.trl['output_dir']}-export --served-model-name {name} --dtype" in assignment(text, "MERGED")
    # 70B in 16 bits is 141 GB: half of an 80 GB GPU holds it on 4 (35 GB each), not 2 (71 GB); on 24 GB GPUs no
    # split of the node's 8 holds it in half of each, so all 8, and the script says it does not fit
    assert "more or larger GPUs" in (SCRIPTS / "serve_llama3.1-70b-qlora.sh").read_text()
    assert "more or larger GPUs" not in (SCRIPTS / "serve_llama3.1-70b-lora.sh").read_text()


def test_shipped_full_and_moe_scripts_serve_the_export_folder():
    """A full fine-tune, and a LoRA run whose adapter reaches a mixture-of-experts model's fused expert tensors (peft's
    target_parameters, which vLLM's LoRA does not map), serve <output_dir>-export under the recipe's name."""
    for name, recipe, tp in (("llama2-70b-fsdp", "recipes/llama2-70b/fsdp.yaml", "4"),
                             ("tiny-full", "recipes/tiny/full.yaml", "1"),
                             ("qwen3-30b-a3b-lora", "recipes/qwen3-30b-a3b/lora.yaml", "2")):
        r = load_recipe([recipe])
        text = (SCRIPTS / f"serve_{name}.sh").read_text()
        argv = exec_argv(text)
        assert argv[:3] == ["vllm", "serve", "$SERVED"] and argv[-1] == "$@", argv
        assert options(argv) == {"--served-model-name": name, "--dtype": "bfloat16" if r.trl_value("bf16") else "auto",
                                 "--max-model-len": str(r.trl_value("max_length")), "--tensor-parallel-size": tp}
        assert "--enable-lora" not in text.split("\nset -euo")[1]
        assert assignment(text, "OUTPUT_DIR") == r.trl["output_dir"]
    moe = (SCRIPTS / "serve_qwen3-30b-a3b-lora.sh").read_text()
    assert "mlp.experts.gate_up_proj, mlp.experts.down_proj" in assignment(moe, "WHY")


def test_vllm_rank_rule_and_what_it_cannot_serve():
    assert [max_lora_rank({"r": r}) for r in (1, 2, 8, 9, 16, 300, 320, 321, 512, 513)] == [1, 8, 8, 16, 16, 320, 320, 512, 512, None]
    assert max_lora_rank({"r": 8, "rank_pattern": {"q_proj": 64}}) == 64
    plain = {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"], "bias": "none", "modules_to_save": None,
             "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "trainable_token_indices": None}
    assert obstacles(plain) == []
    assert obstacles({**plain, "rank_pattern": {"q_proj": 32}, "alpha_pattern": {"q_proj": 64}}) == []  # same scaling
    assert obstacles({**plain, "use_rslora": True, "rank_pattern": {"q_proj": 64}, "alpha_pattern": {"q_proj": 64}}) == []
    found = obstacles({**plain, "rank_pattern": {"q_proj": 32}, "bias": "lora_only", "use_dora": True, "r": 1024})
    assert found == ["use_dora: DoRA on q_proj, v_proj", "bias: lora_only (vLLM serves adapters without biases)",
                     "rank 1024 on q_proj, v_proj (lora_r/rank_pattern) above 512, vLLM's largest --max-lora-rank",
                     "rank_pattern/alpha_pattern: q_proj scaled 1, not 0.03125 as every other module (vLLM scales every "
                     "module alike)"]


def test_tensor_parallel_splits_as_the_heads_allow():
    """tiny: 4 heads, 2 KV heads. On 6 GPUs of unknown memory the most a split allows is 2 (3 and 6 do not divide 4);
    on 3, one; where a node's memory is given, the fewest that hold the weights."""
    tp = lambda *flags: serve_plan(load_recipe(["recipes/tiny/lora.yaml", "--launch.backend", "ddp", *flags])).tp  # noqa: E731
    assert tp("--launch.gpus_per_node", "6") == 2 and tp("--launch.gpus_per_node", "3") == 1
    assert tp("--launch.gpus_per_node", "4", "--launch.gpu_memory_gb", "80") == 1
    assert tp("--launch.gpus_per_node", "4", "--launch.hardware", "cpu") == 1


def path_without_vllm() -> str:
    return os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not (os.path.exists(os.path.join(d, "vllm"))))


@pytest.fixture
def user_recipes(tmp_path):
    """Recipes of a user's own under recipes/, each with its output_dir in tmp_path (the LoRA one's path has a space, a
    quote and a command substitution, which must stay literal), emitted through `python -m sftrecipes emit`."""
    rdir = RECIPES / "_pytest_serve"
    rdir.mkdir(exist_ok=True)
    tiny = {"lora": {"base": "../tiny/lora.yaml", "lora_r": 4, "output_dir": str(tmp_path / "it's $(touch PWNED)" / "lora")},
            "dora": {"base": "../tiny/lora.yaml", "use_dora": True, "output_dir": str(tmp_path / "dora")},
            "save": {"base": "../tiny/lora.yaml", "modules_to_save": ["lm_head"], "output_dir": str(tmp_path / "save")},
            "rank": {"base": "../tiny/lora.yaml", "lora_r": 1024, "output_dir": str(tmp_path / "rank")},
            "full": {"base": "../tiny/full.yaml", "output_dir": str(tmp_path / "full")}}
    try:
        for k, body in tiny.items():
            (rdir / f"{k}.yaml").write_text(yaml.safe_dump(body))
        res = run_cli(["-m", "sftrecipes", "emit", *(f"recipes/_pytest_serve/{k}.yaml" for k in tiny)], timeout=120)
        assert res.returncode == 0, res.stderr
        assert all(f"wrote: scripts/serve__pytest_serve-{k}.sh" in res.stdout for k in tiny), res.stdout
        yield {k: (SCRIPTS / f"serve__pytest_serve-{k}.sh", tmp_path / k if k != "lora" else tmp_path / "it's $(touch PWNED)" / "lora")
               for k in tiny}
    finally:
        shutil.rmtree(rdir, ignore_errors=True)
        for f in [*SCRIPTS.glob("*__pytest_serve-*.sh"), *(ROOT / "configs").glob("_pytest_serve-*.yaml"),
                  *SETUPS.glob("_pytest_serve-*.md")]:  # not tiny/, not cpu: emit writes their setup pages too
            f.unlink()


def test_user_recipe_serve_scripts_refuse_in_one_line_and_serve_what_vllm_can(user_recipes, tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "vllm").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$FAKE_ARGV"\n')
    (fake / "vllm").chmod(0o755)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    argv_file = tmp_path / "argv"

    def serve(key, *extra, vllm=True):
        argv_file.unlink(missing_ok=True)
        env = {**os.environ, "FAKE_ARGV": str(argv_file),
               "PATH": (f"{fake}{os.pathsep}" if vllm else "") + path_without_vllm()}
        res = subprocess.run(["bash", str(user_recipes[key][0]), *extra], cwd=elsewhere, env=env, capture_output=True,
                             text=True, timeout=60)
        if res.returncode == 0:
            return 0, argv_file.read_text().splitlines()
        assert res.stdout == "" and len(res.stderr.splitlines()) == 1 and not argv_file.exists(), res
        return res.returncode, res.stderr.strip()

    me = "serve__pytest_serve-"
    rc, line = serve("lora", vllm=False)
    assert rc == 2 and line.startswith(f"{me}lora.sh: vllm is not on PATH; install it in an environment of its own (its "
                                       "pins conflict with the training stack): python3 -m venv ~/vllm && ~/vllm/bin/pip "
                                       "install 'vllm>=0.19.1'"), line
    # adapters vLLM cannot serve as a LoRA: the script serves the merged export, and until it exists says why
    for key, why in (("dora", "use_dora: DoRA on all-linear"), ("save", "modules_to_save: lm_head (whole copies"),
                     ("rank", "rank 1024 on all-linear (lora_r/rank_pattern) above 512, vLLM's largest --max-lora-rank")):
        out = user_recipes[key][1]
        rc, line = serve(key)
        assert rc == 2 and line.startswith(f"{me}{key}.sh: {out}-export does not exist yet; make it: scripts/export_"
                                           f"_pytest_serve-{key}.sh (vLLM cannot serve the run's adapter as a LoRA: {why}"), line
    (tmp_path / "dora-export").mkdir()
    assert serve("dora", "--port", "9") == (0, ["serve", str(tmp_path / "dora-export"), "--served-model-name",
                                                "_pytest_serve-dora", "--dtype", "auto", "--max-model-len", "256",
                                                "--tensor-parallel-size", "1", "--port", "9"])
    rc, line = serve("full")
    assert rc == 2 and line == f"{me}full.sh: {tmp_path / 'full'}-export does not exist yet; make it: scripts/export__pytest_serve-full.sh"

    # the LoRA form: the adapter's own adapter_config.json decides, before vLLM starts
    from peft import LoraConfig

    out = user_recipes["lora"][1]
    rc, line = serve("lora")
    assert rc == 2 and line == f"{me}lora.sh: no LoRA adapter in {out} yet; train it first: scripts/run__pytest_serve-lora.sh"
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    LoraConfig(r=4, lora_alpha=16, target_modules=targets).save_pretrained(out)
    assert serve("lora", "--port", "9") == (0, ["serve", ".assets/tiny-llama", "--tokenizer", str(out), "--enable-lora",
                                                "--lora-modules", f"_pytest_serve-lora={out}", "--max-lora-rank", "8",
                                                "--dtype", "auto", "--max-model-len", "256", "--tensor-parallel-size", "1",
                                                "--port", "9"])
    merged = (f"serve the merged export instead: scripts/export__pytest_serve-lora.sh, then vllm serve "
              f"{shlex.quote(str(out) + '-export')} --served-model-name _pytest_serve-lora --dtype auto")
    # trained with flags the recipe does not have (--use_dora true), or with the rows of tokens its template added
    LoraConfig(r=4, lora_alpha=16, target_modules=targets, use_dora=True).save_pretrained(out)
    rc, line = serve("lora")
    assert rc == 2 and line.startswith(f"{me}lora.sh: vLLM cannot serve {out} as a LoRA: use_dora: DoRA on ") and merged in line, line
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg.update(use_dora=False, trainable_token_indices={"embed_tokens": [512, 513], "lm_head": [512, 513]})
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    rc, line = serve("lora")
    assert rc == 2 and ("trainable_token_indices: rows of embed_tokens, lm_head for the tokens the run's chat template "
                        "added") in line and merged in line, line
    # trained with --lora_r 16: vLLM needs --max-lora-rank 16, which the user may pass
    LoraConfig(r=16, lora_alpha=16, target_modules=targets).save_pretrained(out)
    rc, line = serve("lora")
    assert rc == 2 and line == (f"{me}lora.sh: {out}: the adapter's rank 16 (the run's lora_r or rank_pattern) is above "
                                "--max-lora-rank 8; pass --max-lora-rank 16 (vLLM takes 1, 8, 16, 32, 64, 128, 256, 320, 512)")
    rc, argv = serve("lora", "--max-lora-rank", "16")
    assert rc == 0 and argv[-2:] == ["--max-lora-rank", "16"]
    assert not (ROOT / "PWNED").exists() and not (elsewhere / "PWNED").exists()
