"""LoRA adapters for a merge: reading and refusing adapter folders, planning which base tensor each adapter tensor
changes (plan_merge), checking that the factors fit, and applying a plan entry to a base tensor (_apply)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from sftrecipes.core.errors import RecipeError
from sftrecipes.export.layout import _cut, _meta_model
from sftrecipes.export.readers import _Reader
from sftrecipes.facts.folders import adapter_config
from sftrecipes.facts.shape import pattern_value

PREFIX = "base_model.model."
ADAPTER_MARKS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.", ".modules_to_save.",
                 ".token_adapter.")


def _peft_name(key: str) -> str:
    """A trainable tensor's name in the training model -> its name in adapter_model.safetensors: accelerate's
    'model.' prefix (DCP) and PEFT's adapter name ('.default') are dropped, as get_peft_model_state_dict does."""
    key = key.removeprefix("model.") if key.startswith("model.base_model.") else key
    key = re.sub(r"\.default(?=\.|$)", "", key)
    key = re.sub(r"\.lora_magnitude_vector\.weight$", ".lora_magnitude_vector", key)  # DoRA's magnitude, as peft saves it
    return key.replace(".modules_to_save.", ".")  # a whole trained module is saved under the base name


def read_adapter(adapter: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = adapter_config(adapter)  # (torch-free: cli.py asks it before torch loads)
    weights = adapter / "adapter_model.safetensors"
    reader = _Reader()
    return cfg, {k: reader.get(weights, k) for k in reader.header(weights)}


def param_wrappers(config_dir: Path, target_parameters: list[str]) -> dict[str, tuple[str, bool]]:
    """Where peft keeps the LoRA of each parameter it adapts as a parameter (target_parameters: MoE experts, a router):
    module path in the adapter -> (the parameter's name in the base model, whether it is stored [E, in, out]).
    peft wraps the matching parameters of one module inside each other in the module's registration order, the first
    innermost, so that one's LoRA is saved under `<module>.base_layer.`, the last's under `<module>.`. The order and
    the layout flag (is_transposed) are read from the model built from config.json on the meta device."""
    model = _meta_model(config_dir)
    out = {}
    for mname, module in model.named_modules():
        matched = [pn for pn, _ in module.named_parameters(recurse=False)
                   if any(f"{mname}.{pn}" == t or f"{mname}.{pn}".endswith("." + t) for t in target_parameters)]
        for i, pn in enumerate(matched):
            out[mname + ".base_layer" * (len(matched) - 1 - i)] = (f"{mname}.{pn}", bool(getattr(module, "is_transposed", False)))
    return out


def _wrapped(config_dir: Path, cfg: dict) -> dict[str, tuple[str, bool]]:
    """param_wrappers for an adapter config: only adapters with target_parameters need the base's structure."""
    return param_wrappers(config_dir, list(cfg["target_parameters"])) if cfg.get("target_parameters") else {}


def plan_merge(cfg: dict, tensors: dict[str, torch.Tensor], base_names: set[str],
               wrapped: dict[str, tuple[str, bool]] | None = None) -> dict[str, dict]:
    """base tensor name -> what to apply: {'A', 'B', 'scale'[, 'magnitude' (DoRA)][, 'transposed' (3-D experts)]} |
    {'replace': T} | {'rows': (idx, T)}. `wrapped` (param_wrappers) places the LoRA of parameter targets."""
    r, alpha = cfg["r"], cfg["lora_alpha"]
    wrapped = wrapped or {}
    plan: dict[str, dict] = {}
    token_idx = cfg.get("trainable_token_indices") or {}
    tied_rows: dict[str, torch.Tensor] = {}  # a tied head's token adapter: the embedding's, saved a second time
    for key, t in tensors.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        module = name.split(".token_adapter.", 1)[0]
        if ".token_adapter." in name and module + ".weight" not in base_names and module.rsplit(".", 1)[-1] == "lm_head":
            tied_rows[name.split(".token_adapter.", 1)[1]] = t  # the base ties lm_head to the embedding: no tensor of its own
            continue
        lora = re.fullmatch(r"(.+)\.lora_([AB])\.weight", name)
        if lora or name.endswith(".lora_magnitude_vector"):
            module = lora.group(1) if lora else name[: -len(".lora_magnitude_vector")]
            target, transposed = wrapped.get(module, (module + ".weight", False))
            entry = plan.setdefault(target, {})
            if not lora:
                entry["magnitude"] = t
                continue
            entry[lora.group(2)] = t
            pattern_key = target if module in wrapped else module  # peft matches a parameter target by its own name
            r_m = pattern_value(cfg.get("rank_pattern"), pattern_key, r)
            a_m = pattern_value(cfg.get("alpha_pattern"), pattern_key, alpha)
            entry["scale"] = a_m / math.sqrt(r_m) if cfg.get("use_rslora") else a_m / r_m
            # GPT-2's Conv1D holds its weight [in, out]: peft's fan_in_fan_out, its delta (B @ A) transposed
            entry["transposed"] = transposed or (bool(cfg.get("fan_in_fan_out")) and module not in wrapped)
        elif name.endswith(".token_adapter.trainable_tokens_delta"):
            module = name[: -len(".token_adapter.trainable_tokens_delta")]
            leaf = module.rsplit(".", 1)[-1]
            idx = token_idx.get(leaf) if isinstance(token_idx, dict) else token_idx
            if idx is None:
                raise RecipeError(f"adapter: {key} has no trainable_token_indices entry in adapter_config.json; the adapter is inconsistent")
            plan.setdefault(module + ".weight", {})["rows"] = (torch.tensor(idx), t)
        elif ".original_module." in name:
            continue  # modules_to_save: the untrained copy peft saves with resized embeddings (save_embedding_layers)
        elif ".modules_to_save." in name and name.replace(".modules_to_save.", ".") in base_names:
            plan.setdefault(name.replace(".modules_to_save.", "."), {})["replace"] = t  # the trained module, again
        elif name.endswith(".token_adapter.base_layer.weight"):  # full (resized) embedding saved beside the rows
            plan.setdefault(name[: -len(".token_adapter.base_layer.weight")] + ".weight", {})["replace"] = t
        elif name.endswith(".base_layer.bias") and name.replace(".base_layer.bias", ".bias") in base_names:
            plan.setdefault(name.replace(".base_layer.bias", ".bias"), {})["replace"] = t  # bias: all / lora_only
        elif name in base_names:  # modules_to_save, bias: the whole trained tensor
            plan.setdefault(name, {})["replace"] = t
        else:
            raise RecipeError(f"adapter: tensor '{key}' matches nothing in the base model; wrong --base for this adapter?")
    embed = next((k for k in plan if k.endswith("embed_tokens.weight")), None)
    for part, t in tied_rows.items():  # must repeat the embedding's rows exactly, or the head was trained on its own
        same = plan.get(embed, {}).get("rows" if part == "trainable_tokens_delta" else "replace")
        mine = same[1] if isinstance(same, tuple) else same
        if mine is None or not (t.is_meta or torch.equal(mine, t)):  # meta: a layout check before any data is read
            raise RecipeError(f"adapter: lm_head.token_adapter.{part} differs from the embedding's, but the base ties lm_head to the embedding; wrong --base for this adapter?")
    for target, entry in plan.items():
        if target not in base_names:
            raise RecipeError(f"adapter: targets '{target}', which the base model does not have; wrong --base for this adapter?")
        if ("A" in entry) != ("B" in entry) or ("magnitude" in entry and "A" not in entry):
            raise RecipeError(f"adapter: '{target}' has only part of its LoRA (lora_A/lora_B/magnitude); the adapter file is incomplete")
    return plan


def _lora_fits(shape: tuple, a: tuple, b: tuple, entry: dict) -> bool:
    """lora_B @ lora_A fits a 2-D weight [out, in] ([in, out] if transposed: Conv1D); for a 3-D expert tensor [E, out, in] ([E, in, out] if transposed)
    peft's factors are lora_A [r*E, in] and lora_B [out, r*E]."""
    if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
        return False
    if len(shape) == 2:
        out_f, in_f = (shape[1], shape[0]) if entry.get("transposed") else shape
        return b[0] == out_f and a[1] == in_f
    if len(shape) == 3:
        out_f, in_f = (shape[2], shape[1]) if entry.get("transposed") else (shape[1], shape[2])
        return b[0] == out_f and a[1] == in_f and a[0] % shape[0] == 0
    return False


def _apply(w: torch.Tensor, entry: dict, name: str, piece: tuple | None = None) -> torch.Tensor:
    """The stored tensor `name` (base value `w`) after the plan entry of the tensor it is (a piece of, see
    stored_layout) in the model: replaced, rows set, LoRA added (DoRA rescaled)."""
    out = (_cut(entry["replace"], piece) if "replace" in entry else w).to(torch.float32)
    if "rows" in entry:
        idx, rows = entry["rows"]
        need = int(idx.max()) + 1
        if need > out.shape[0]:  # vocabulary grown by added tokens: the adapter holds every new row
            missing = set(range(out.shape[0], need)) - set(idx.tolist())
            if missing:
                raise RecipeError(f"adapter: '{name}' grows to {need} rows but rows {sorted(missing)[:3]} are not in the adapter")
            out = torch.cat([out, out.new_zeros(need - out.shape[0], out.shape[1])])
        out[idx] = rows.to(torch.float32)
    if "A" in entry:
        a, b, shape = entry["A"].to(torch.float32), entry["B"].to(torch.float32), entry.get("shape", tuple(w.shape))
        want = tuple(_cut(torch.empty(shape, device="meta"), piece).shape)
        if not _lora_fits(tuple(shape), tuple(a.shape), tuple(b.shape), entry) or tuple(out.shape) != want:
            raise RecipeError(f"adapter: '{name}' lora_B{tuple(b.shape)} @ lora_A{tuple(a.shape)} does not fit the base weight {tuple(out.shape)}; wrong base model")
        expert, rows = (piece[1], piece[2]) if piece else (None, None)
        if len(shape) == 3:
            # peft's ParamWrapper.get_delta_weight: lora_A [r*E, in] is (E, r, in) expert-major, lora_B [out, r*E] is
            # (out, r, E) expert-minor; expert e's delta is scale * B[:, :, e] @ A[e], stored transposed for [E, in, out]
            n = shape[0]
            a3, b3 = a.reshape(n, -1, a.shape[1]), b.reshape(b.shape[0], -1, n)
            for e in range(n) if expert is None else [expert]:
                lhs, rhs = (a3[e].T, b3[:, :, e].T) if entry.get("transposed") else (b3[:, :, e], a3[e])
                (out[e] if expert is None else out).addmm_(lhs if rows is None else lhs[rows], rhs, alpha=entry["scale"])
        else:
            lhs, rhs = (a.T, b.T) if entry.get("transposed") else (b, a)
            out.addmm_(lhs if rows is None else lhs[rows], rhs, alpha=entry["scale"])  # in place: no (out x in) temporaries beside W
        if "magnitude" in entry:
            # DoRA (peft's DoraLinearVariant.merge): W' = m * (W + s*B@A) / ||W + s*B@A||, the norm over each output row
            m = entry["magnitude"].to(torch.float32)
            m = m if rows is None else m[rows]
            if m.shape != out.shape[:1]:
                raise RecipeError(f"adapter: '{name}' DoRA magnitude{tuple(m.shape)} does not fit the base weight {tuple(out.shape)}; wrong base model")
            out.mul_((m / torch.linalg.norm(out, dim=1)).unsqueeze(1))
    return out


def _check_fits(plan: dict[str, dict], shape_of) -> None:
    """Every LoRA pair must fit the base weight it targets: checked before anything is written."""
    for target, e in plan.items():
        if "A" in e:
            shape, a, b = tuple(shape_of(target)), tuple(e["A"].shape), tuple(e["B"].shape)
            e["shape"] = shape  # the weight as the model holds it (a 3-D expert tensor may be stored in pieces)
            if "magnitude" in e and len(shape) == 2 and e.get("transposed"):  # checked here, before anything is written
                raise RecipeError(f"adapter: '{target}' is DoRA on a transposed (Conv1D) weight, which the streaming merge does not apply; merge with peft's merge_and_unload")
            if not _lora_fits(tuple(shape), a, b, e) or ("magnitude" in e and tuple(e["magnitude"].shape) != tuple(shape[:1])):
                raise RecipeError(f"adapter: '{target}' lora_B{b} @ lora_A{a} does not fit the base weight {tuple(shape)}; wrong base model — pass the base it was trained on (--base)")
