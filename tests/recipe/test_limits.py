"""Issue 37, torch-free: a key written twice in a recipe file, max_length past the model's positions, activation
offloading (refused without a GPU, planned with one), rows that carry images, and what an evaluation-only recipe
evaluates. The refusals as users meet them are in the bad-input corpus (tests/bad_inputs/cases.yaml); here what the
corpus cannot show: what is accepted, the line numbers, the plan's figures, the counts."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT
from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.load import load_recipe

TINY = ROOT / ".assets/tiny-llama"


def recipe_file(tmp_path: Path, text: str, name: str = "r.yaml") -> str:
    p = tmp_path / name
    p.write_text(f"base: {ROOT / 'recipes/tiny/lora.yaml'}\noutput_dir: {tmp_path / 'out'}\n" + textwrap.dedent(text))
    return str(p)


# ----------------------------------------------------------------------------------------------- keys written twice


@pytest.mark.parametrize("text, key, lines", [
    ("lora_r: 8\nlearning_rate: 1.0e-3\nlora_r: 64\n", "lora_r", (3, 5)),
    ("model_init_kwargs:\n  low_cpu_mem_usage: true\n  low_cpu_mem_usage: false\n", "model_init_kwargs.low_cpu_mem_usage", (4, 5)),
    ("dataset_name: null\ndatasets:\n  - path: data/tiny_chat\n  - path: data/tiny_chat\n    columns: {a: b, a: c}\n",
     "datasets[1].columns.a", (7, 7)),
])
def test_a_key_written_twice_is_refused_at_any_depth_with_its_lines(tmp_path, text, key, lines):
    with pytest.raises(RecipeError) as e:
        load_recipe([recipe_file(tmp_path, text)])
    msg = str(e.value)
    assert msg.startswith(f"{key}: set twice in '{tmp_path / 'r.yaml'}' (lines {lines[0]} and {lines[1]};"), msg
    assert "\n" not in msg


def test_keys_a_yaml_merge_brings_in_may_be_overridden_but_not_written_twice(tmp_path):
    """`<<: *anchor` then the same key: YAML's override, not a key written twice; the same key written twice beside
    the merge is."""
    merged = """\
        dataset_name: null
        datasets:
          - &entry {path: data/tiny_chat, weight: 0.5}
          - <<: *entry
            weight: 2
        """
    r = load_recipe([recipe_file(tmp_path, merged)])
    assert [e["weight"] for e in r.data.datasets] == [0.5, 2]
    with pytest.raises(RecipeError, match=r"^datasets\[1\]\.weight: set twice in .* \(lines 7 and 8;"):
        load_recipe([recipe_file(tmp_path, merged.rstrip(" ") + "            weight: 3\n")])


# ----------------------------------------------------------------------------------------------- max_length and positions


def test_max_length_past_positions_is_refused_unless_rope_scaled_or_meant(tmp_path):
    with pytest.raises(RecipeError, match=r"max_length: 2048 is beyond .*tiny-llama's max_position_embeddings 1024"):
        load_recipe(["recipes/tiny/lora.yaml", "--max_length", "2048"])
    load_recipe(["recipes/tiny/lora.yaml", "--max_length", "1024"])  # the limit itself is fine
    load_recipe(["recipes/tiny/lora.yaml", "--max_length", "null", "--packing", "false"])  # no cut: nothing to compare
    load_recipe(["recipes/tiny/lora.yaml", "--max_length", "2048", "--max_length_beyond_positions", "true"])
    load_recipe([recipe_file(tmp_path, "max_length: 4096\nmodel_init_kwargs:\n  rope_parameters: {rope_type: linear, "
                                       "factor: 4.0, rope_theta: 10000.0}\n")])
    with pytest.raises(RecipeError, match="model_init_kwargs.max_position_embeddings 2048"):
        load_recipe([recipe_file(tmp_path, "max_length: 4096\nmodel_init_kwargs: {max_position_embeddings: 2048}\n")])


def test_positions_of_a_multimodal_config_are_its_text_configs(tmp_path):
    model = tmp_path / "mm"
    model.mkdir()
    for f in TINY.iterdir():
        if f.name != "config.json":
            (model / f.name).symlink_to(f)
    cfg = json.loads((TINY / "config.json").read_text())
    positions = cfg.pop("max_position_embeddings")
    (model / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": {**cfg, "max_position_embeddings": positions},
                                                   "vision_config": {"model_type": "clip_vision_model"}}))
    from sftrecipes.recipe import images
    from sftrecipes.recipe.limits import max_positions

    assert max_positions(str(model)) == (1024, "text_config.max_position_embeddings")
    assert images.vision_tower(str(model)) is True and images.vision_tower(str(TINY)) is False


def test_the_plan_counts_the_length_asked_beyond_positions():
    from sftrecipes.plan import plan_recipe

    r = load_recipe(["recipes/tiny/lora.yaml", "--max_length", "4096", "--max_length_beyond_positions", "true"])
    plan = plan_recipe(r, _alternatives=False)
    assert any("8 x 4096 tokens" in i.note for i in plan.live[plan.peak_phase])


# ----------------------------------------------------------------------------------------------- activation offloading


def test_activation_offloading_moves_the_saved_activations_to_host_in_the_plan():
    """Planned per rank: the decoder layers' saved tensors go to pinned host memory (on the node: x ranks); the GPU
    keeps one layer's (checkpointing: the 5 layer inputs in flight). The figures follow activations.py's counts."""
    from sftrecipes.plan import plan_recipe
    from sftrecipes.plan.activations import activations
    from sftrecipes.plan.states import model_states as _model_states
    from sftrecipes.plan.sharding import GB, setup
    from sftrecipes.facts.config import model_shape

    for ckpt in ("false", "true"):
        base = ["recipes/llama2-70b/lora.yaml", "--gradient_checkpointing", ckpt]
        off, on = (load_recipe(base + ["--activation_offloading", v]) for v in ("false", "true"))
        p_off, p_on = plan_recipe(off, _alternatives=False), plan_recipe(on, _alternatives=False)
        shape, s = model_shape(on.model.model_name_or_path), setup(on)
        act = activations(on, shape, s, _model_states(on, shape, s).adapted)
        host = next(i for i in p_on.cpu if i.name == "offloaded activations")
        assert host.gb == pytest.approx(s.gpn * act.saved_all / GB) and not any(i.name == "offloaded activations" for i in p_off.cpu)
        on_gpu = 5 * act.saved_first if ckpt == "true" else max(act.per_layer)
        start = "start of backward (LM head)"
        gpu = {n: next(i.gb for i in p.live[start] if i.name == "activations") for n, p in (("off", p_off), ("on", p_on))}
        assert gpu["off"] - gpu["on"] == pytest.approx((act.saved_all - on_gpu) / GB)
        assert p_on.gpu_total_gb < p_off.gpu_total_gb and any(n.startswith("activation_offloading:") for n in p_on.notes)


def test_activation_offloading_is_refused_on_the_cpu_target_in_the_run_too():
    from sftrecipes.train.args import training_kwargs

    r = load_recipe(["recipes/tiny/lora.yaml", "--activation_offloading", "true"])  # hardware auto: accepted here
    with pytest.raises(RecipeError, match="activation_offloading: .* the cpu target has no GPU"):
        training_kwargs(r, "cpu")


# ----------------------------------------------------------------------------------------------- images


def test_image_rows_are_counted_from_arrow_and_from_json_rows_alike():
    import pyarrow as pa

    from sftrecipes.recipe import images

    rows = [
        {"images": ["a.png"], "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]},
        {"images": [], "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"images": None, "messages": [{"role": "user", "content": [{"type": "image_url", "text": None}]},
                                      {"role": "assistant", "content": [{"type": "image", "text": None}]}]},
        {"images": ["b.png", "c.png"], "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
    ]
    expected = (4, 3, {"images": 2, "messages content parts": 2})
    assert images.count_rows(rows) == expected
    assert images.count_table(pa.Table.from_pylist(rows)) == expected
    assert images.count_table(pa.Table.from_pylist(rows).slice(1, 2)) == (2, 1, {"messages content parts": 1})


# ----------------------------------------------------------------------------------------------- evaluation only


def test_an_evaluation_only_recipe_needs_no_training_split_and_evaluates_the_one_named(tmp_path):
    from sftrecipes.recipe import evalonly

    r = load_recipe(["recipes/tiny/lora.yaml", "--do_train", "false", "--splits", "test"])
    assert evalonly.eval_only(r) and [(s.key, s.eval_split) for s in evalonly.eval_sources(r)] == [("dataset_name", "test")]
    r = load_recipe([recipe_file(tmp_path, """\
        do_train: false
        dataset_name: null
        datasets:
          - {path: data/tiny_chat}
          - {path: data/tiny_chat, eval_split: train}
          - {path: data/tiny_chat, eval_split: null}
        """)])
    assert [(s.key, s.eval_split, s.eval_required) for s in evalonly.eval_sources(r)] == [
        ("datasets[0]", "test", False), ("datasets[1]", "train", True)]
    assert not evalonly.eval_only(load_recipe(["recipes/tiny/lora.yaml"]))  # sftrecipes' default: do_train true


def test_an_evaluation_only_summary_never_replaces_a_training_runs(tmp_path):
    from sftrecipes.recipe import evalonly

    out = tmp_path / "out"
    assert evalonly.summary_path(out) == out / "run_summary.json"
    out.mkdir()
    (out / "run_summary.json").write_text(json.dumps({"evaluation_only": True}))
    assert evalonly.summary_path(out) == out / "run_summary.json"  # an earlier evaluation's: replaced
    (out / "run_summary.json").write_text(json.dumps({"steps": 3}))
    assert evalonly.summary_path(out) == out / "eval" / "run_summary.json"


def test_an_evaluation_only_recipe_is_not_refused_on_a_training_steps_plan():
    """No evaluation is planned: the plan printed is one training step's, labelled as an upper bound of what the
    evaluation holds, and neither `plan` nor pre-flight refuses the evaluation on it (the same recipe training is)."""
    from sftrecipes.plan import verdict
    from sftrecipes.launch.preflight import before_launch

    small = ["recipes/tiny/lora.yaml", "--launch.gpu_memory_gb", "0.001", "--launch.cpu_ram_gb", "0.001"]
    ok, text = verdict(load_recipe(small))
    assert not ok and "EVALUATION ONLY" not in text
    with pytest.raises(RecipeError, match="preflight: the memory plan above says this recipe does not fit"):
        before_launch(load_recipe(small))
    ok, text = verdict(load_recipe([*small, "--max_steps", "0", "--per_device_eval_batch_size", "16"]))
    assert ok and text.splitlines()[1].startswith("EVALUATION ONLY: max_steps: 0: no evaluation is planned here")
    assert "per_device_eval_batch_size 16 is above per_device_train_batch_size 8" in text
    assert ("VERDICT of one training step (an upper bound for this evaluation-only recipe, which is not refused on it): "
            "DOES NOT FIT") in text
    assert "EVALUATION ONLY" in before_launch(load_recipe([*small, "--do_train", "false"]))


def test_launch_puts_an_evaluations_accelerate_config_beside_its_summary(tmp_path):
    """`launch` writes the run's accelerate config into output_dir; an evaluation-only run in a folder that holds a
    training run's results writes it into <output_dir>/eval/, beside its summary: the training's config stays."""
    from sftrecipes.launch.supervise import launch_command

    out = tmp_path / "run"
    out.mkdir()
    (out / "run_summary.json").write_text(json.dumps({"steps": 3}))
    flags = ["recipes/tiny/ddp.yaml", "--output_dir", str(out)]
    assert launch_command(flags).config_path == out / "accelerate_config.yaml"
    assert launch_command([*flags, "--do_train", "false"]).config_path == out / "eval" / "accelerate_config.yaml"


def test_the_gpu_offload_probe_plans_both_rows(tmp_path):
    """bench/offload_probe.py (run by bench/gpu_check.sh on a lent GPU): its recipes are valid and planned, offloading
    off and on, without a GPU (--plan-only)."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import offload_probe

    assert offload_probe.main(["--plan-only", "--out", str(tmp_path), "--steps", "1"]) == 0
    off, on = json.loads((tmp_path / "offload-probe.json").read_text())["rows"]
    assert off["planned_host_gb_per_rank"] == 0 and on["planned_host_gb_per_rank"] > 1
    assert on["planned_tensor_peak_gb"] < off["planned_tensor_peak_gb"]
