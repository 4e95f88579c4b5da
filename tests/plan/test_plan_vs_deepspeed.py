"""The planner's model states against DeepSpeed 0.19.8's own estimator (estimate_zero3/zero2_model_states_mem_needs),
called for real with the planner's parameter counts: Llama-2-7B and 70B, ZeRO-3 on 8 GPUs and on 2 x 8, ZeRO-2 on 8,
no offload. Each pair is stated, and every difference is taken apart into what one side counts and the other does not
(or counts in another phase of the step), to the byte.

What DeepSpeed counts per GPU (P parameters, N ranks, Lmax the largest module's own parameters):
  ZeRO-3: 18P/N + 4 Lmax  =  16-bit param 2 + fp32 master 4 + Adam m, v 8 + fp32 grads 4, sharded; the largest layer
          gathered (16-bit param + grad);
  ZeRO-2:  2P + 18P/N     =  16-bit params whole; 16-bit grads 2 + fp32 grads 4 + master 4 + m, v 8, sharded.
The planner's resident model states are 16P/N (ZeRO-3: the 16-bit grad partition, 2 B, which DeepSpeed's estimator
leaves out, instead of the fp32 grads) and 2P + 14P/N (ZeRO-2). The fp32 gradient copy exists only inside the
optimizer step, one ZeRO-3 sub-group (<= sub_group_size = 1e9 elements per rank) or one ZeRO-1/2 param group at a
time: the planner counts it in its "optimizer step" phase (it did not before this test: ZeRO-2 was 11.8% under
DeepSpeed), and the gathered largest layer in its backward phases.
"""

import contextlib
import io
import os
import re

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from sftrecipes import plan  # noqa: E402
from sftrecipes.plan.phases import DS_SUB_GROUP_SIZE  # noqa: E402
from sftrecipes.recipe.load import load_recipe  # noqa: E402
from sftrecipes.facts.config import model_shape  # noqa: E402

GiB, GB = 2**30, 1e9
NO_OFFLOAD = ["--launch.offload_optimizer", "false", "--launch.offload_params", "false", "--launch.gpus_per_node", "8"]
# (model, nodes, ZeRO stage, DeepSpeed's per-GPU GiB as issue 13 quotes it, the planner's model states in GB before
# the fp32 step gradients were added (they did not change: the new item is in the step phase))
CASES = [
    ("meta-llama/Llama-2-7b-hf", 1, 3, 14.61, 13.48),
    ("meta-llama/Llama-2-7b-hf", 2, 3, 7.55, 6.74),
    ("meta-llama/Llama-2-7b-hf", 1, 2, 26.67, 25.27),
    ("meta-llama/Llama-2-70b-hf", 1, 3, 145.52, 137.95),
    ("meta-llama/Llama-2-70b-hf", 2, 3, 73.25, 68.98),
    ("meta-llama/Llama-2-70b-hf", 1, 2, 273.02, 258.66),
]


def deepspeed_gpu_bytes(stage: int, params: int, largest: int, gpn: int, nodes: int) -> int:
    """DeepSpeed's per-GPU figure without offload: the _all_cold estimator's printed line, checked against the value
    function it prints from."""
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs as value,
                                                   estimate_zero3_model_states_mem_needs_all_cold as cold)

        _, gpu, _ = value(params, largest, gpn, nodes, cpu_offload=False, cpu_offload_params=False, zero_init=True)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            cold(params, largest, gpn, nodes)
        line = next(x for x in printed.getvalue().splitlines() if "offload_param=none, offload_optimizer=none, zero_init=1" in x)
    else:
        from deepspeed.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs as value,
                                                          estimate_zero2_model_states_mem_needs_all_cold as cold)

        _, gpu = value(params, gpn, nodes, cpu_offload=False)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            cold(params, gpn, nodes)
        line = next(x for x in printed.getvalue().splitlines() if x.rstrip().endswith("offload_optimizer=none"))
    assert float(re.findall(r"([\d.]+)GB", line)[1]) == round(gpu / GiB, 2), line
    return gpu


def item(p, phase: str, name: str) -> float:
    return next((i.gb for i in p.live[phase] if i.name == name), 0.0) * GB


@pytest.mark.parametrize("model, nodes, stage, ds_gib, states_gb", CASES, ids=[f"{c[0].split('-')[2]}-zero{c[2]}-{c[1]}x8" for c in CASES])
def test_planner_model_states_against_deepspeeds_estimator(model, nodes, stage, ds_gib, states_gb):
    recipe = load_recipe(["recipes/llama2-7b/offload.yaml", "--model_name_or_path", model, *NO_OFFLOAD,
                          "--launch.num_machines", str(nodes), "--launch.zero_stage", str(stage),
                          *(["--launch.zero3_init", "false"] if stage != 3 else [])])
    shape = model_shape(model)
    P, N = shape.params, 8 * nodes
    largest = shape.largest_weight  # DeepSpeed's "largest layer": a module's own params (an embedding / lm_head here)
    ds = deepspeed_gpu_bytes(stage, P, largest, 8, nodes)
    p = plan.plan_recipe(recipe, _alternatives=False)
    states = p.model_states_gb * GB

    # the pair, as stated in the issue (DeepSpeed in GiB, the planner in GB)
    assert round(ds / GiB, 2) == ds_gib
    assert round(p.model_states_gb, 2) == states_gb

    grads16 = next(i.gb for i in p.states if i.name == "gradients") * GB
    fp32_step = item(p, "optimizer step", "fp32 gradient partition (DeepSpeed step)")
    if stage == 3:
        # every byte of the difference: DeepSpeed has fp32 grads (4 B/param/N) resident where the planner has the 16-bit
        # grad partition (2 B/param/N), and the gathered largest module (4 B/param)
        assert grads16 == pytest.approx(2 * P / N, rel=1e-6)
        assert ds == pytest.approx(states - grads16 + 4 * P / N + 4 * largest, rel=1e-6)
        # the fp32 copy really made in the step: one sub-group of at most 1e9 elements per rank
        assert fp32_step == pytest.approx(4 * min(P / N, DS_SUB_GROUP_SIZE), rel=1e-6)
        # the gathered largest layer: the planner gathers whole decoder layers (+ prefetch) and lm_head in backward,
        # at least DeepSpeed's 16-bit copy of its largest module
        gathered = max(item(p, ph, n) for ph in p.live for n in ("gathered params (ZeRO-3/FSDP)", "gathered lm_head"))
        assert gathered >= 2 * largest
    else:
        # ZeRO-2: the whole difference is the fp32 gradient partition of the step (4 B/param/N)
        assert fp32_step == pytest.approx(4 * P / N, rel=1e-6)
        assert ds == pytest.approx(states + fp32_step, rel=1e-6)
        gathered = 0.0
    # the planner's model-state peak (resident states + the step's fp32 grads, or + the gathered layer in backward)
    # is within 10% of DeepSpeed's figure; what remains at 70B (DeepSpeed +9%) is its fp32 grads of the whole
    # partition where DeepSpeed allocates one sub-group of them at a time
    planner_peak = max(states + fp32_step, states + gathered)
    assert abs(planner_peak - ds) / ds <= 0.10, (planner_peak / GB, ds / GB)
    assert p.phases["optimizer step"] * GB == pytest.approx(states + fp32_step, rel=1e-6)
