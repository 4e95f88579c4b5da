"""The plan command: will a recipe fit its GPUs and CPU RAM, and which strategies would -- the estimate, its strategies
and the pitfalls, printed (torch-free).

    python -m sftrecipes plan RECIPE.yaml [--key value ...]     exit 0 fits (or no gpu_memory_gb), 2 does not fit

The model's shape comes from config.json through sftrecipes/facts/config.py (a local folder, or sftrecipes/facts/model_configs/
for hub ids) and every byte is arithmetic on that shape and the recipe (docs/planner.md), in this package's
modules: sharding.py (ranks and bytes per parameter), activations.py (what backward keeps), reference.py (a preference
or online run's reference model), generation.py (what an online run's generation and scoring hold), estimate.py (one
training step of one configuration, per GPU and per node: the model states of states.py, the phases of phases.py, the
CPU RAM of hostram.py, the network volume of network.py, the peak and the verdict), strategies.py (the other
configurations, ranked); pitfalls.py adds the configuration traps.
"""

from __future__ import annotations

import sys

from sftrecipes.core.errors import RecipeError
from sftrecipes.plan.estimate import CUDA_CONTEXT_GB, FRAGMENTATION, Plan, estimate
from sftrecipes.plan.pitfalls import pitfalls
from sftrecipes.plan.strategies import INFINIBAND, NVLINK, PCIE, alternatives
from sftrecipes.recipe.evalonly import eval_only, why
from sftrecipes.recipe.load import load_recipe
from sftrecipes.recipe.schema import ONLINE, PAIRED
from sftrecipes.recipe.typed import Recipe


def plan_recipe(recipe: Recipe, pipeline_degree: int | None = None, _alternatives: bool = True) -> Plan:
    """Memory per GPU and per node for a recipe on its launch hardware, the verdict, and strategies that would fit."""
    plan = estimate(recipe)
    if pipeline_degree:
        ga = recipe.trl_value("gradient_accumulation_steps")
        plan.pipeline_degree, plan.bubble = pipeline_degree, pipeline_bubble(pipeline_degree, ga)
        plan.notes.append(f"pipeline: {pipeline_degree} stages x {ga} micro-batches -> bubble {plan.bubble:.0%} idle "
                          "(memory above is for the whole layer stack; a stage holds 1/p of the layers)")
    if _alternatives and plan.gpu_limit_gb is not None:  # without a memory size there is nothing to fit
        plan.alternatives = alternatives(recipe, plan)
    return plan


def pipeline_bubble(p: int, m: int) -> float:
    """Idle share of a GPipe/1F1B pipeline of p stages running m micro-batches per step: (p-1)/(m+p-1)."""
    if p < 1 or m < 1:
        raise ValueError("pipeline degree and micro-batches must be >= 1")
    return (p - 1) / (m + p - 1)


def verdict(recipe: Recipe) -> tuple[bool, str]:
    """(fits, the printed plan with its pitfalls): what the plan command prints and exits by, and what pre-flight
    (preflight.before_launch) asks first. Unknown GPU memory counts as fitting (nothing to check against).
    An evaluation-only recipe (evalonly.eval_only) is planned as one training step, printed as an upper bound of what
    its evaluation holds and never refused on (evaluation_words): no evaluation's own figures are planned."""
    plan = plan_recipe(recipe)
    ok = plan.fits is not False and plan.cpu_fits is not False
    evaluation = evaluation_words(recipe) if eval_only(recipe) else None
    return ok or evaluation is not None, format_plan(plan, pitfalls(recipe), evaluation)


def evaluation_words(recipe: Recipe) -> str:
    """What the plan of an evaluation-only recipe is: the training step's, which holds what an evaluation does not
    (gradients, optimizer states, the activations saved for backward) besides the weights both hold; its logits are
    the train batch's, so it bounds an evaluation whose eval batch is no larger."""
    train_b, eval_b = recipe.trl_value("per_device_train_batch_size"), recipe.trl_value("per_device_eval_batch_size")
    batch = (f"per_device_eval_batch_size {eval_b} is above per_device_train_batch_size {train_b}: a forward's "
             f"activations and logits for {eval_b} rows are not bounded by it" if eval_b > train_b else
             f"per_device_eval_batch_size {eval_b} is not above per_device_train_batch_size {train_b}")
    return (f"{why(recipe)}: no evaluation is planned here; the plan below is of one training step of this recipe, an "
            "upper bound of what the evaluation holds (the weights, without the gradients, optimizer states and saved "
            f"activations) where the eval batch is no larger ({batch}); plan and pre-flight do not refuse an evaluation "
            "on it")


# ----------------------------------------------------------------------------------------------- output


def _up_to(low_gb: float, high_gb: float | None) -> str:
    """" (up to N)" in MB where a figure has a ceiling at least 0.5 MB above it (RankLoading.peak_up_to_gb)."""
    return f" (up to {high_gb * 1e3:,.0f})" if high_gb is not None and high_gb - low_gb >= 5e-4 else ""


def format_plan(plan: Plan, warnings: list[str] | None = None, evaluation: str | None = None) -> str:
    """The plan as printed; evaluation: an evaluation-only recipe's words (evaluation_words), said first and on the
    verdict line, which is then the training step's and refuses nothing."""
    w = 44
    line = lambda i: f"  {i.name:<{w}} {i.gb:8.2f} GB  {i.note}"  # noqa: E731
    active = f" ({plan.active_params / 1e9:.2f}B active per token)" if plan.active_params not in (0, plan.params) else ""
    method = "" if plan.method == "sft" else f"{plan.method}, "
    unit = " pairs" if plan.method in PAIRED else " completions" if plan.method in ("kto", *ONLINE) else ""
    out = [f"{plan.model}: {method}{plan.params / 1e9:.2f}B params{active}, {plan.trainable / 1e6:.2f}M trainable; {plan.backend} on "
           f"{plan.nodes} node(s) x {plan.gpus_per_node} GPU(s) = {plan.world}; global batch {plan.global_batch}{unit}"
           + (f"; {plan.split.kind} {plan.split.degree}: {plan.rank_tokens} tokens per rank" if plan.split.on else ""),
           *([f"EVALUATION ONLY: {evaluation}"] if evaluation else []), "", "Per GPU — model states (always resident):"]
    out += [line(i) for i in plan.states]
    out += [f"  {'= model states':<{w}} {plan.model_states_gb:8.2f} GB", "", f"Per GPU — also live at the peak ({plan.peak_phase}):"]
    out += [line(i) for i in plan.peak if i.gb > 0]
    if plan.generation:
        out += ["", f"Per GPU — generation ({plan.method}; in the phases below):"] + [line(i) for i in plan.generation]
    out += ["", "Per GPU — tensors at each phase of a step:"]
    out += [f"  {k:<{w}} {v:8.2f} GB" for k, v in plan.phases.items()]
    out += [f"  {'runtime allowance':<{w}} {plan.allowance_gb:8.2f} GB  CUDA context/workspaces {CUDA_CONTEXT_GB:g} GB + "
            f"{FRAGMENTATION:.0%} of the non-resident peak for allocator fragmentation",
            f"  {'= required per GPU':<{w}} {plan.gpu_total_gb:8.2f} GB"]
    if plan.rank_loading:
        out += ["", "Per rank — RSS growth while the weights load (cpu target: the device is the process):"]
        for g in plan.rank_loading:
            large = (" — up to: what touching the mapped checkpoint in places can map (more where the page cache holds "
                     "large folios)" if _up_to(g.peak_gb, g.peak_up_to_gb) else "")
            out.append(f"  {g.ranks + ': peak':<{w}} {g.peak_gb * 1e3:8.0f} MB{_up_to(g.peak_gb, g.peak_up_to_gb)}  held after "
                       f"loading {g.held_gb * 1e3:,.0f} MB{_up_to(g.held_gb, g.held_up_to_gb)}{large}")
            out += [f"    {n:<{w - 2}} {gb * 1e3:8.1f} MB  {why}" for n, gb, why in g.items]
    if plan.rank_steps:
        out += ["", "Per rank — RSS growth at the peak of the first steps (cpu target, every rank alike):"]
        out.append(f"  {'every rank: peak':<{w}} {plan.rank_steps.peak_gb * 1e3:8.0f} MB")
        out += [f"    {n:<{w - 2}} {gb * 1e3:8.1f} MB  {why}" for n, gb, why in plan.rank_steps.items]
        out.append(f"  {'RSS before loading':<{w}} {plan.rank_steps.baseline_gb * 1e3:8.0f} MB  each rank's, which these "
                   "figures grow from: python's, torch's and the libraries' own memory, the tokenized data (measured)")
        out.append(f"  {'':<{w}} {'':>8}     not planned: the pages of the libraries' files each rank maps, on top of every "
                   "figure here (how many is the filesystem's page cache's: pages.py)")
    out += ["", "Per node — CPU RAM:"] + [line(i) for i in plan.cpu] + [f"  {'= peak per node':<{w}} {plan.cpu_total_gb:8.2f} GB"]
    if plan.comm:
        out += ["", "Communication per GPU per optimizer step:"] + [line(i) for i in plan.comm]
    out += [""] + [f"note: {n}" for n in plan.notes] + [w_ for w_ in (warnings or [])]
    if plan.fits is None:
        verdict = f"VERDICT: needs {plan.gpu_total_gb:.1f} GB per GPU (no launch.gpu_memory_gb to compare with)"
    else:
        verdict = (f"VERDICT: {'fits' if plan.fits else 'DOES NOT FIT'}: {plan.gpu_total_gb:.1f} GB of "
                   f"{plan.gpu_limit_gb:g} GB per GPU")
    if plan.cpu_fits is not None:
        verdict += f"; CPU RAM {plan.cpu_total_gb:.0f} of {plan.cpu_limit_gb:g} GB per node {'fits' if plan.cpu_fits else 'DOES NOT FIT'}"
    if evaluation:
        verdict = (verdict.replace("VERDICT: ", "VERDICT of one training step (an upper bound for this evaluation-only "
                                   "recipe, which is not refused on it): ", 1))
    out += ["", verdict] + ([f"  {plan.reference}"] if plan.reference else [])
    if plan.alternatives:
        out += ["", "Strategies (fitting first; same model before * (changes what is trained); then by network + PCIe time "
                f"per step at {NVLINK / 1e9:.0f} GB/s in a node, {INFINIBAND / 1e9:.0f} GB/s across nodes, {PCIE / 1e9:.0f} GB/s PCIe):",
                f"  {'strategy':<38} {'GPUs':>4} {'GB/GPU':>7} {'fits':>5} {'net GB':>7} {'PCIe GB':>7} {'~s/step':>7}"]
        for a in plan.alternatives:
            fits = "?" if a.fits is None else "yes" if a.fits else "no"
            out.append(f"  {a.name:<38} {a.gpus:>4} {a.gpu_gb:7.1f} {fits:>5} {a.comm_gb:7.1f} {a.pcie_gb:7.1f} {a.seconds:7.2f} {a.note}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """`plan RECIPE.yaml [--key value ...]`: print the plan; exit 0 when it fits (or no GPU memory is given), 2 when not."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        recipe = load_recipe(argv)
        ok, text = verdict(recipe)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    if not ok:
        L = recipe.launch
        print(f"error: launch.gpu_memory_gb: the plan above does not fit {L.gpu_memory_gb:g} GB per GPU"
              + (f" or {L.cpu_ram_gb:g} GB of CPU RAM per node" if L.cpu_ram_gb else "")
              + "; pick a strategy from its table", file=sys.stderr)
        return 2
    return 0
