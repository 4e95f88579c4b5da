"""Whether vLLM can serve a LoRA adapter as a LoRA (from its adapter_config.json, or the one a recipe's run will write):
what stands in the way, each named with its key and targets, and the --max-lora-rank it needs.

vLLM's rules, read from its source: `vllm/config/lora.py` accepts --max-lora-rank only from MaxLoRARanks
(VLLM_LORA_RANKS) and `vllm/lora/peft_helper.py` refuses a rank above it, `modules_to_save`, DoRA (`use_dora`) and a
bias; `vllm/lora/lora_weights.py` gives every module the one scaling lora_alpha/r (alpha/sqrt(r) with rsLoRA), so
rank_pattern/alpha_pattern that scale a module otherwise would be served wrong; `vllm/lora/utils.py` maps LoRA onto the
model's linear layers, so peft's parameter targets (a mixture-of-experts model's fused expert tensors, its router) and
the rows of tokens a run added (`trainable_token_indices`: the vocabulary grew past the base's) have no place there.
Stdlib only: the emitted serve scripts run it with whatever python is at hand, before vLLM starts.

    python -m sftrecipes.facts.servable ADAPTER_DIR MAX_LORA_RANK PROG [-- VLLM ARGS...]
        prints what keeps vLLM from serving it as a LoRA ("; "-joined; nothing where vLLM can), exit 0; one line
        `PROG: ...` on stderr and exit 2 where only MAX_LORA_RANK is too small for it (a --max-lora-rank among VLLM ARGS
        replaces it: vLLM takes the later flag) or adapter_config.json cannot be read.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from sftrecipes.facts.shape import pattern_value

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks


def top_rank(cfg: dict) -> int:
    """The largest rank a module of the adapter has: r, or a rank_pattern value above it."""
    return max([int(cfg.get("r") or 0), *(int(v) for v in (cfg.get("rank_pattern") or {}).values())])


def max_lora_rank(cfg: dict) -> int | None:
    """The --max-lora-rank vLLM needs for this adapter: the smallest value it accepts at or above the adapter's largest
    rank; None above vLLM's largest."""
    rank = top_rank(cfg)
    return next((v for v in VLLM_LORA_RANKS if v >= rank), None)


def _scaling(alpha: float, r: int, rslora: bool) -> float:
    return alpha / math.sqrt(r) if rslora else alpha / r


def _names(value) -> str:
    return value if isinstance(value, str) else ", ".join(str(v) for v in value)


def obstacles(cfg: dict) -> list[str]:
    """What keeps vLLM from serving this adapter as a LoRA, one phrase each naming the key and its targets; [] when
    nothing does. `cfg`: an adapter_config.json, or what a recipe's run will write (launch/serve.planned_adapter)."""
    found = []
    targets = _names(cfg.get("target_modules") or "")
    if cfg.get("use_dora"):
        found.append(f"use_dora: DoRA on {targets}")
    if cfg.get("modules_to_save"):
        found.append(f"modules_to_save: {_names(cfg['modules_to_save'])} (whole copies, not low-rank)")
    if cfg.get("target_parameters"):
        found.append(f"target_parameters: {_names(cfg['target_parameters'])} (parameters, not the linear layers vLLM "
                     "puts LoRA on)")
    tokens = cfg.get("trainable_token_indices")
    if tokens:
        where = _names(tokens) if isinstance(tokens, dict) else "embed_tokens"
        found.append(f"trainable_token_indices: rows of {where} for the tokens the run's chat template added (the base's "
                     "vocabulary lacks them)")
    if (cfg.get("bias") or "none") != "none":
        found.append(f"bias: {cfg['bias']} (vLLM serves adapters without biases)")
    if cfg.get("lora_bias"):
        found.append("lora_bias: true (vLLM serves adapters without biases)")
    rank = top_rank(cfg)
    if max_lora_rank(cfg) is None:
        found.append(f"rank {rank} on {targets} (lora_r/rank_pattern) above {VLLM_LORA_RANKS[-1]}, vLLM's largest "
                     "--max-lora-rank")
    r, alpha, rslora = int(cfg.get("r") or 1), cfg.get("lora_alpha") or 8, bool(cfg.get("use_rslora"))
    scale = _scaling(alpha, r, rslora)
    ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    for key in dict.fromkeys([*ranks, *alphas]):
        a_k = alphas[key] if key in alphas else pattern_value(alphas, key, alpha)  # the pattern's own modules
        r_k = ranks[key] if key in ranks else pattern_value(ranks, key, r)
        mine = _scaling(a_k, r_k, rslora)
        if not math.isclose(mine, scale, rel_tol=1e-6):
            found.append(f"rank_pattern/alpha_pattern: {key} scaled {mine:g}, not {scale:g} as every other module (vLLM "
                         "scales every module alike)")
    return found


def _asked_rank(default: int, vllm_args: list[str]) -> int:
    """The --max-lora-rank vLLM will use: the last one among its arguments, else `default`."""
    rank = default
    for i, a in enumerate(vllm_args):
        if a == "--max-lora-rank" and i + 1 < len(vllm_args) and vllm_args[i + 1].isdigit():
            rank = int(vllm_args[i + 1])
        elif a.startswith("--max-lora-rank=") and a.partition("=")[2].isdigit():
            rank = int(a.partition("=")[2])
    return rank


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[1].isdigit():
        sys.stderr.write("usage: python -m sftrecipes.facts.servable ADAPTER_DIR MAX_LORA_RANK PROG [-- VLLM ARGS...]\n")
        return 2
    folder, rank, prog, rest = argv[0], int(argv[1]), argv[2], argv[3:]
    path = Path(folder) / "adapter_config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        sys.stderr.write(f"{prog}: {path} cannot be read ({e.__class__.__name__}: {e}); the run writes it with the adapter: "
                         "train it again\n")
        return 2
    found = obstacles(cfg)
    asked, need = _asked_rank(rank, rest[1:] if rest[:1] == ["--"] else rest), top_rank(cfg)
    if not found and need > asked:
        sys.stderr.write(f"{prog}: {folder}: the adapter's rank {need} (the run's lora_r or rank_pattern) is above "
                         f"--max-lora-rank {asked}; pass --max-lora-rank {max_lora_rank(cfg)} (vLLM takes "
                         f"{', '.join(map(str, VLLM_LORA_RANKS))})\n")
        return 2
    print("; ".join(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
