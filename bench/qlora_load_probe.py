"""Each rank's load-time peak of a QLoRA model against the plan, for bench/gpu_check.py's QLoRA loading rows.

    accelerate launch --config_file CFG --num_processes N bench/qlora_load_probe.py RECIPE [--key value ...]

Run under accelerate with a QLoRA ZeRO-3 recipe, each rank loads the recipe's model as train.py does
(sftrecipes.model.load.load_model) twice: partitioned as it loads (zero3_init: sftrecipes/model/quantload.py), then whole
(zero3_init false: transformers' own bitsandbytes load), each from a clean device. Measured per load: on a GPU, torch's
peak allocated memory over the load less what was allocated before it; on the cpu target, the RSS high-water mark's
growth over the load (sftrecipes.train.probes.PhaseMemory, the run summary's measure). Beside each: the planner's figure for
that load (the GPU plan's loading phase; on the cpu target, plan/ranks.py's peak for this rank). Writes
<output_dir>/qlora-load-rank<N>.json."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(recipe, tokenizer, target: str) -> tuple[float, int]:
    """(the load's peak over what was held before it, GB; decoder layers the loaded model holds partitioned)."""
    import torch

    from sftrecipes.model import meta
    from sftrecipes.model import load as models
    from sftrecipes.train.probes import PhaseMemory

    if target == "gpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model = models.load_model(recipe, tokenizer, target)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 1e9
    else:
        mem = PhaseMemory()
        mem.start("loading")
        model = models.load_model(recipe, tokenizer, target)
        mem.close()
        peak = mem.phases["loading"]["grew_mb"] / 1e3
    layers = sum(all(hasattr(p, "ds_tensor") for p in layer.parameters()) for layer in meta.decoder_layers(model)[1])
    del model
    gc.collect()
    if target == "gpu":
        torch.cuda.empty_cache()
    return peak, layers


def planned(recipe, target: str, rank: int) -> tuple[str, float]:
    """(the plan's item, GB) for this load on this rank."""
    from sftrecipes.plan import plan_recipe
    from sftrecipes.plan.ranks import loading_of

    plan = plan_recipe(recipe, _alternatives=False)
    if target == "cpu":
        return "cpu target, this rank's loading peak (plan/ranks.py)", loading_of(plan.rank_loading, rank).peak_gb
    name = next(k for k in plan.phases if k.startswith("loading"))
    return name, plan.phases[name]


def main(argv: list[str]) -> None:
    from sftrecipes.train import args as backends
    from sftrecipes.train import devices
    from sftrecipes.recipe.load import load_recipe
    from sftrecipes.data.tokenizer import load_tokenizer

    recipe = load_recipe(argv)
    target = devices.hardware(recipe)
    backends.apply_process_env(recipe, target)
    args = backends.training_args(recipe, target)  # ZeRO-3 on (transformers' DeepSpeed config), process group up
    tokenizer = load_tokenizer(recipe)[0]
    rows = []
    for load, extra in (("partitioned as it loads (zero3_init)", []), ("whole (zero3_init false)", ["--launch.zero3_init", "false"])):
        r = load_recipe(argv + extra)
        peak, layers = measure(r, tokenizer, target)
        what, plan_gb = planned(r, target, args.process_index)
        rows.append({"load": load, "measured_gb": round(peak, 4), "planned_gb": round(plan_gb, 4), "plan_item": what,
                     "layers_partitioned": layers})
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"qlora-load-rank{args.process_index}.json").write_text(json.dumps(
        {"rank": args.process_index, "world": args.world_size, "target": target, "rows": rows}))


if __name__ == "__main__":
    main(sys.argv[1:])
