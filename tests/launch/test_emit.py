"""Emitted launch files: never stale, standard accelerate format, safe quoting, dry runs, SLURM ranks."""

import os
import shlex
import shutil
import stat
import subprocess
import textwrap

import pytest
import yaml

from conftest import ROOT
from sftrecipes import cli
from sftrecipes.launch import emit
from sftrecipes.core.paths import SWEEP_DOC, SWEEP_ROWS
from sftrecipes.recipe.load import load_recipe
from sftrecipes.core.errors import RecipeError
from sftrecipes.core.paths import RECIPES

# emit (and the launchers' pre-flight) read the tiny recipes, whose models are built in .assets/: on a fresh clone this
# file run alone builds them first, as the whole suite does
pytestmark = pytest.mark.usefixtures("tiny_model", "family_models")


def test_emitted_files_are_current():
    stale = emit.emit(check=True)
    assert not stale, f"stale generated files (run: make emit): {[str(p.relative_to(ROOT)) for p in stale]}"


def test_a_launcher_that_lost_its_execute_bit_is_stale():
    """Every generated launcher, not only the make targets': `chmod -x` on any of them fails the drift check."""
    scripts = sorted(f for f in (ROOT / "scripts").glob("*.sh") if emit.MARK in f.read_text())  # the generated ones
    assert len(scripts) > 30 and all(os.access(f, os.X_OK) for f in scripts)
    victim = scripts[len(scripts) // 2]  # a launcher or export helper no make target names
    mode = victim.stat().st_mode
    try:
        victim.chmod(mode & ~0o111)
        assert emit.emit(check=True) == [victim]
    finally:
        victim.chmod(mode)
    assert emit.emit(check=True) == []


@pytest.mark.parametrize("folder", ["configs", "scripts", "docs/generated"])
def test_generated_folders_hold_only_generated_files(folder):
    """Generated files are kept apart from written ones: in each generated folder every file but its README.md (which
    says what writes the rest, and which emit neither sweeps nor rewrites) carries emit's mark, or is the option table
    `make docs` writes (compared in tests/recipe/test_schema_and_assets.py), or make sweep's table and its rows (a measurement). Hand-written scripts live in bench/, pages in docs/."""
    readme = ROOT / folder / "README.md"
    assert readme.is_file(), f"{folder}/README.md: say there which command generates the files here"
    assert not emit.is_emitted(readme)  # not taken for a generated file (emit's sweep deletes marked files of gone recipes)
    assert "make emit" in readme.read_text()  # the command that writes the rest
    files = [f for f in (ROOT / folder).rglob("*") if f.is_file()]
    assert len(files) > 5
    written = sorted(str(f.relative_to(ROOT)) for f in files
                     if f not in (readme, cli.OPTIONS_DOC, SWEEP_DOC, SWEEP_ROWS) and not emit.is_emitted(f))
    assert written == [], f"hand-written files in a generated folder: move them out ({written})"


def test_generated_files_of_a_gone_recipe_are_stale():
    """emit's sweep finds every generated file whose recipe is gone, also a SLURM script whose mark comes after more
    #SBATCH lines than usual; hand-written files and the folders' READMEs are left alone."""
    slurm = max((f for f in (ROOT / "scripts").glob("slurm_*.sh")),
                key=lambda f: next(i for i, line in enumerate(f.read_text().splitlines()) if emit.MARK in line))
    planted = {ROOT / "configs" / "gone-recipe.yaml": ROOT / "configs" / "tiny-ddp.yaml",
               ROOT / "scripts" / "slurm_gone-recipe.sh": slurm,
               emit.SETUPS / "gone-recipe.md": next(emit.SETUPS.glob("llama2-*.md"))}
    try:
        for f, src in planted.items():
            shutil.copy(src, f)
        assert sorted(emit.emit(check=True)) == sorted(planted)
    finally:
        for f in planted:
            f.unlink(missing_ok=True)


def test_every_make_target_has_its_launcher():
    makefile = (ROOT / "Makefile").read_text()
    for target, script in (("sft-70b-lora", "run_llama2-70b-lora.sh"), ("sft-70b-qlora", "run_llama2-70b-qlora.sh"),
                           ("sft-offload", "run_llama2-7b-offload.sh"), ("sft-70b-fsdp", "run_llama2-70b-fsdp.sh"),
                           ("sft-70b-qlora-fsdp", "run_llama2-70b-qlora-fsdp.sh"), ("sft-ddp", "run_llama2-7b-ddp.sh"),
                           ("sft-llama3-70b-qlora", "run_llama3.1-70b-qlora.sh"),
                           ("sft-llama3-405b-qlora", "run_llama3.1-405b-qlora.sh"),
                           ("grpo-qwen3-8b-lora", "run_qwen3-8b-grpo-lora.sh"), ("grpo-llama3-70b-lora", "run_llama3.1-70b-grpo-lora.sh"),
                           ("sft-grpo-llama3-70b-lora", "run_llama3.1-70b-grpo-lora.sh")):
        assert f"{target}: $(STAMP)" in makefile and f"scripts/{script}" in makefile
        assert os.access(ROOT / "scripts" / script, os.X_OK)
    listed = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    for target in ("sft-70b-lora", "dpo-llama3-70b-lora", "grpo-qwen3-8b-lora", "grpo-llama3-70b-lora", "sft-grpo-llama3-70b-lora",
                   "vllm-env"):  # `make help` lists each with its ## line
        assert any(line.split()[:1] == [target] and len(line.split()) > 3 for line in listed.splitlines()), (target, listed)


def test_configs_are_standard_accelerate_configs():
    from accelerate.commands.config.config_args import load_config_from_file

    for cfg_file in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config_from_file(str(cfg_file))  # accelerate's own reader accepts every key
        raw = yaml.safe_load(cfg_file.read_text())
        assert cfg.distributed_type.value == raw["distributed_type"]
    z3 = yaml.safe_load((ROOT / "configs/llama2-70b-lora.yaml").read_text())
    assert z3["distributed_type"] == "DEEPSPEED" and z3["num_processes"] == 8 and z3["mixed_precision"] == "bf16"
    assert z3["deepspeed_config"]["zero_stage"] == 3 and z3["deepspeed_config"]["zero3_init_flag"] is True
    off = yaml.safe_load((ROOT / "configs/llama2-7b-offload.yaml").read_text())["deepspeed_config"]
    assert off["offload_optimizer_device"] == "cpu" and off["offload_param_device"] == "cpu"
    fsdp = yaml.safe_load((ROOT / "configs/llama2-70b-fsdp.yaml").read_text())
    assert fsdp["num_machines"] == 2 and fsdp["num_processes"] == 16
    assert fsdp["fsdp_config"]["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert fsdp["fsdp_config"]["fsdp_cpu_ram_efficient_loading"] is True


def test_gpu_recipe_on_cpu_machine_stops_at_once_and_dry_run_shows_command():
    res = subprocess.run(["make", "-s", "sft-70b-lora"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "needs 8 GPU(s) of 80 GB per node" in res.stderr and "this machine has 0" in res.stderr
    res = subprocess.run(["scripts/run_llama2-70b-lora.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    argv = shlex.split(res.stdout)
    assert argv[1:4] == ["-m", "accelerate.commands.launch", "--config_file"]
    assert argv[argv.index("--num_processes") + 1] == "8" and argv[-2:] == ["train.py", "recipes/llama2-70b/lora.yaml"]


def _slurm_stand_ins(tmp_path, submitted: str = "") -> dict:
    """Stand-in srun and scontrol: srun runs the task once per node with the node's SLURM_NODEID, as srun
    --ntasks-per-node=1 does; scontrol answers the node list and the job's submitted command (Command=)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        [ "$1 $2" = 'show hostnames' ] && printf 'gpu-node-17\\ngpu-node-18\\n' && exit 0
        [ "$1 $2" = 'show job' ] && [ -n '{submitted}' ] && printf '   JobId=4242\\n   Command={submitted}\\n' && exit 0
        exit 1
        """))
    (bin_dir / "srun").write_text(textwrap.dedent("""\
        #!/bin/bash
        while [[ "$1" == --* ]]; do shift; done
        for node in 0 1; do SLURM_NODEID=$node "$@"; done
        """))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "SLURM_JOB_NODELIST": "gpu-node-[17-18]", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "4242"}


def _node_commands(stdout: str) -> list[tuple[dict, list[str]]]:
    """Each node's --dry-run output: (its exports, its command)."""
    nodes, env = [], {}
    for line in stdout.splitlines():
        if line.startswith("export "):
            k, v = line[len("export "):].split("=", 1)
            env[k] = v
        elif "accelerate.commands.launch" in line:
            nodes.append((env, shlex.split(line)))
            env = {}
    return nodes


def test_slurm_script_gives_each_node_its_rank_and_the_main_address(tmp_path):
    """Run the SLURM batch script with SLURM's variables and the stand-ins, and check what each node's launcher
    would run (--dry-run): its machine rank, the first host as address, a rendezvous keyed by the job id on a port
    derived from it (machine 0 hosting the store); a requeued job (SLURM_RESTART_COUNT) resumes."""
    env = _slurm_stand_ins(tmp_path)
    res = subprocess.run(["bash", "scripts/slurm_llama2-70b-fsdp.sh", "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    nodes = _node_commands(res.stdout)
    assert len(nodes) == 2
    for rank, (exports, argv) in enumerate(nodes):
        assert argv[argv.index("--machine_rank") + 1] == str(rank)
        assert argv[argv.index("--main_process_ip") + 1] == "gpu-node-17"
        assert argv[argv.index("--num_machines") + 1] == "2" and argv[argv.index("--num_processes") + 1] == "16"
        assert argv[argv.index("--main_process_port") + 1] == str(29500 + 4242 % 1000)
        assert exports["PET_RDZV_ID"] == "slurm-4242"  # torch's rendezvous id (the default, "none", is every job's)
        assert "--resume_from_checkpoint" not in argv
    res = subprocess.run(["bash", "scripts/slurm_llama2-70b-fsdp.sh", "--dry-run"], cwd=ROOT,
                         env={**env, "SLURM_RESTART_COUNT": "1"}, capture_output=True, text=True, timeout=120)
    assert [argv[-2:] for _, argv in _node_commands(res.stdout)] == [["--resume_from_checkpoint", "auto"]] * 2, res.stderr
    head = (ROOT / "scripts/slurm_llama2-70b-fsdp.sh").read_text()
    for directive in ("--nodes=2", "--gres=gpu:8", "--exclusive", "--mem=292G", "--requeue", "--signal=B:USR1@1860",
                      "--output=%x-%j.out", "--open-mode=append"):
        assert f"#SBATCH {directive}\n" in head
    assert "srun --nodes=2 --ntasks-per-node=1 --whole --kill-on-bad-exit=1 " in head


def test_slurm_script_finds_the_repository_from_its_spool_copy(tmp_path):
    """sbatch runs a copy of the script in its spool folder, from the submit directory: the repository is found from
    the path it was submitted as (scontrol's Command=); with none found, one line names SFTRECIPES_REPO, exit 2."""
    spool, elsewhere = tmp_path / "spool" / "job04242", tmp_path / "elsewhere"
    spool.mkdir(parents=True)
    elsewhere.mkdir()
    copy = spool / "slurm_script"
    shutil.copy(ROOT / "scripts/slurm_llama2-70b-fsdp.sh", copy)
    env = _slurm_stand_ins(tmp_path, submitted=f"{ROOT}/scripts/slurm_llama2-70b-fsdp.sh --dry-run")
    res = subprocess.run(["bash", str(copy), "--dry-run"], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert [argv[argv.index("train.py") + 1] for _, argv in _node_commands(res.stdout)] == ["recipes/llama2-70b/fsdp.yaml"] * 2
    env = {**_slurm_stand_ins(tmp_path), "SLURM_SUBMIT_DIR": str(elsewhere)}
    res = subprocess.run(["bash", str(copy), "--dry-run"], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "SFTRECIPES_REPO=/path/to/repo sbatch" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    res = subprocess.run(["bash", str(copy), "--dry-run"], cwd=elsewhere, env={**env, "SFTRECIPES_REPO": str(ROOT)},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and len(_node_commands(res.stdout)) == 2, res.stderr


HOSTILE = ["a b", "it's", 'say "hi"', "$(touch PWNED)", "`touch PWNED`", "x; touch PWNED", "line1\nline2", "*", "--no"]


@pytest.mark.parametrize("value", HOSTILE)
def test_recipe_strings_are_passed_literally(tmp_path, value):
    """Values from a recipe (output_dir, SLURM fields) and extra CLI words reach argv unchanged; nothing runs."""
    rdir = RECIPES / "_pytest_tmp"
    rdir.mkdir(exist_ok=True)
    try:
        rec = rdir / "hostile.yaml"
        # SLURM fields land in #SBATCH lines, which shell quoting cannot protect: anything but a plain value is refused
        for key in ("slurm_partition", "slurm_time"):
            rec.write_text(yaml.safe_dump({"base": "../llama2-70b/fsdp.yaml", "launch": {key: value}}))
            if key == "slurm_partition" and value == "--no":  # plain characters: a (strange) partition name
                assert "#SBATCH --partition=--no\n" in emit.rendered(rec)[ROOT / "scripts/slurm__pytest_tmp-hostile.sh"]
                continue
            with pytest.raises(RecipeError, match=f"launch.{key}"):
                emit.rendered(rec)
        rec.write_text(yaml.safe_dump({"base": "../llama2-70b/fsdp.yaml", "output_dir": f"outputs/{value}"}))
        files = emit.rendered(rec)
        for path, text in files.items():
            if path.suffix != ".sh":
                continue
            out = tmp_path / path.name
            out.write_text(text)
            res = subprocess.run(["bash", "-n", str(out)], capture_output=True, text=True)
            assert res.returncode == 0, (path.name, res.stderr)
        export = next(t for p, t in files.items() if p.name.startswith("export_"))
        # run the export script's variable assignment alone and read the value back
        assign = export[export.index("OUTPUT_DIR="):export.index("\nDEST=")]
        got = subprocess.run(["bash", "-c", assign + '\nprintf "%s" "$OUTPUT_DIR"'], cwd=tmp_path, capture_output=True, text=True)
        assert got.stdout == f"outputs/{value}"
        # extra words given to the launcher reach its argv unchanged
        words = [f"--run_name={value}"] if value.startswith("--") else ["--run_name", value]  # a flag-like value needs =
        res = subprocess.run(["scripts/run_llama2-70b-lora.sh", "--dry-run", *words], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert shlex.split(res.stdout)[-len(words):] == words
        assert not (ROOT / "PWNED").exists() and not (tmp_path / "PWNED").exists()
    finally:
        for f in rdir.iterdir():
            f.unlink()
        rdir.rmdir()


def test_emitted_files_are_not_world_writable():
    for f in list((ROOT / "scripts").glob("*.sh")) + list((ROOT / "configs").glob("*.yaml")):
        assert not f.stat().st_mode & stat.S_IWOTH


def test_launcher_refuses_a_recipe_that_does_not_fit():
    """Pre-flight: the plan's breakdown and alternatives, exit 2; --force skips only the memory verdict."""
    res = subprocess.run(["scripts/run_llama2-70b-lora.sh", "--launch.gpu_memory_gb", "40"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "VERDICT: DOES NOT FIT" in res.stdout and "Strategies" in res.stdout
    assert res.stderr.strip().splitlines()[-1].startswith("error: preflight: the memory plan above says this recipe does not fit")
    forced = subprocess.run(["scripts/run_llama2-70b-lora.sh", "--launch.gpu_memory_gb", "40", "--force"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert forced.returncode == 2 and "needs 8 GPU(s) of 40 GB" in forced.stderr  # past the plan, stopped by the GPU check


def test_slurm_warns_in_time_for_the_save_launch_waits_for():
    """The time-limit signal leaves run.preempt_timeout (+ a minute) for the last step and its checkpoint, never less
    than 10 minutes, never more than half the time limit (a short job would be told to stop as it starts)."""
    from sftrecipes.launch.emit import slurm_script

    def lead(*flags):
        r = load_recipe(["recipes/tiny/multinode.yaml", *flags])
        line = next(ln for ln in slurm_script(r, "recipes/tiny/multinode.yaml", "x").splitlines() if "--signal=" in ln)
        return int(line.rsplit("@", 1)[1])

    assert lead() == 1800 + 60
    assert lead("--preempt_timeout", "3600") == 3660
    assert lead("--preempt_timeout", "60") == 600
    assert lead("--launch.slurm_time", "00:40:00") == 1200
