"""Tiny configs of any architecture transformers has a config class for (`tiny_config`): the class defaults with every
size key small, for a random-init model of a few MB that keeps each kind of layer the full config has, in its pattern
(Gemma-3's 5 sliding : 1 full), and the sizes its per-layer overrides give some layers (Gemma-4's full-attention layers
with twice the head size) in the same proportion. The tests' `arch_models` and the compatibility sweep (bench/sweep.py)
build their models from it.

    tiny_config("gemma4_text", vocab_size=512)     # a config dict: AutoConfig.for_model(**it) builds the tiny model
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass

from transformers import AutoConfig

# Small values for the size keys transformers' config classes use, set only where a config class has the key. The
# layers kept are one of each kind the per-layer settings tell apart (_layers_kept: sliding/full, linear/full attention,
# dense/sparse MLP, per-layer overrides ...) with the first period of their pattern, and at least one dense and one
# sparse layer where a mixture of experts starts with dense ones.
TINY_SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=4096, num_experts=4, num_local_experts=4, n_routed_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, n_shared_experts=1,
                  first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=32,
                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, sliding_window=32,
                  attention_chunk_size=32, global_head_dim=16, num_global_key_value_heads=2,
                  mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, hidden_size_per_layer_input=16,
                  attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  attn_layer_indices=[1], mamba_d_ssm=128, index_head_dim=16, index_n_heads=2, num_expert_group=1,
                  linear_head_dim=16, linear_num_heads=4, n_mamba_heads=4, adapter_rank=8, num_experts_per_token=2,
                  swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, lru_width=64,
                  encoder_hash_byte_group_vocab=512, num_heads=8, n_groups=1, time_step_rank=8, indexer_n_heads=2,
                  indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4, d_head=16, rotary_dim=8)
# Keys set even where the class leaves them unset (None): a model built from such defaults fails without them.
UNSET_TOO = {"head_dim", "sliding_window", "attn_layer_indices", "num_key_value_heads", "indexer_n_heads",
             "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio"}
MOE_UNSET_TOO = {"n_routed_experts", "num_local_experts", "num_experts", "num_experts_per_tok", "n_shared_experts"}  # where moe_intermediate_size is set
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                   patch_size=8, depth=1, out_hidden_size=64, num_channels=3)


def _size(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _small(x, small: dict, d: dict):
    """A layer's overrides ({"head_dim": 512} on Gemma-4's full-attention layers, whose global head_dim is 256) made
    tiny: each size in the same proportion to the tiny model's global size as to the full config's (32 beside 16), so
    the layers still differ as released; a layer whose q/k head is its nope and rope parts (dots3's sliding layers)
    keeps that sum."""
    if not isinstance(x, dict):
        return x
    out = {}
    for k, v in x.items():
        tiny = small.get(k, TINY_SIZES.get(k))
        if _size(v) and _size(tiny):  # (None, a flag, a name: as the full config has it)
            out[k] = max(1, round(tiny * v / d[k])) if _size(d.get(k)) else tiny
        else:
            out[k] = v
    full, mine = {**d, **x}, {**d, **small, **out}
    parts = ("qk_nope_head_dim", "qk_rope_head_dim")
    if all(_size(full.get(k)) for k in ("head_dim", *parts)) and full["head_dim"] == sum(full[k] for k in parts):
        if mine["head_dim"] != sum(mine[k] for k in parts):
            out["head_dim"] = sum(mine[k] for k in parts)
    return out


def _is_index_list(v, n: int | None) -> bool:
    """A list of layer indices (strictly increasing ints below the layer count), e.g. mlp_only_layers."""
    return (isinstance(v, list) and bool(n) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
            and all(a < b for a, b in zip(v, v[1:])) and all(0 <= i < n for i in v) and (len(v) < n or v == list(range(n))))


def _is_per_layer(v, n: int | None) -> bool:
    """A value per layer: a list as long as the layers (layer_types, mlp_layer_types, no_rope_layers' 0/1 flags)
    or a pattern string with a character per layer (hybrid_override_pattern)."""
    if not n or n < 2:
        return False
    if isinstance(v, list):
        return len(v) == n and not _is_index_list(v, n) and all(isinstance(x, (str, int, float, bool)) for x in v)
    return isinstance(v, str) and len(v) == n and len(set(v)) > 1


def _layers_kept(d: dict) -> list[int]:
    """The layers a tiny model keeps: the first of each kind the per-layer settings tell apart (every column of
    layer_types, mlp_layer_types, layer-index lists, per_layer_config's overrides ... together), at least two, and the
    first period of a pattern whose kinds all appear within 8 layers (Gemma-3's 5 sliding : 1 full, Qwen3-Next's 3
    linear : 1 full), so the tiny model has it as released."""
    n = d.get("num_hidden_layers")
    if not isinstance(n, int) or n < 2:
        return [0, 1]
    columns = [list(v) for v in d.values() if _is_per_layer(v, n)]
    columns += [[i in set(v) for i in range(n)] for v in d.values() if _is_index_list(v, n)]
    shared = d.get("num_kv_shared_layers") or 0  # Gemma-3n/4: the last layers reuse the cache of earlier ones
    columns.append([i >= n - shared for i in range(n)])
    overrides = {int(i): repr(sorted(v.items())) for i, v in (d.get("per_layer_config") or {}).items() if v}
    columns.append([overrides.get(i, "") for i in range(n)])
    first: dict = {}
    for i in range(n):
        first.setdefault(tuple(c[i] for c in columns), i)
    keep = sorted(first.values())
    if len(keep) > 8:  # a value that differs on every layer (a per-layer factor) tells no kinds apart
        return [0, 1]
    period = max((p for p in (max(c.index(x) for x in c) + 1 for c in columns) if p <= 8), default=0)
    whole = sorted(set(keep) | set(range(period)))
    keep = whole if len(whole) <= 12 else keep
    return keep if len(keep) >= 2 else sorted({keep[0], keep[0] + 1})


def tiny_config(model_type: str, vocab_size: int = 512, token_ids: tuple[int, int, int] = (1, 2, 3),
                vision: dict | None = None, **extra) -> dict:
    """A tiny config dict of any architecture transformers has a config class for: the class defaults with the size
    keys it has set small (TINY_SIZES; a vision tower's TINY_VISION), for a random-init model of a few MB; its
    bos/eos/pad token ids (where it has them) those of the tiny tokenizers (token_ids)."""
    cfg = AutoConfig.for_model(model_type)
    text = cfg.get_text_config()
    names = dict(getattr(type(text), "attribute_map", {}))  # hidden_size -> n_embd (GPT-2, CodeGen, BLOOM ...)
    names = {k: a for k, a in names.items() if a != k}
    canonical = {a: k for k, a in names.items()}
    d = {canonical.get(k, k): v for k, v in text.to_dict().items() if k not in ("transformers_version", "architectures")}
    unset_too = UNSET_TOO | (MOE_UNSET_TOO if d.get("moe_intermediate_size") else set())
    small = {k: v for k, v in TINY_SIZES.items() if k in d and d[k] != 0 and (d[k] is not None or k in unset_too)}
    for k in ("num_experts_per_tok", "num_experts_per_token"):  # a class that routes to one expert only keeps one
        if isinstance(d.get(k), int) and k in small:
            small[k] = min(small[k], d[k])
    small.update({k: vocab_size for k in d if "vocab_size" in k})  # Gemma-4's vocab_size_per_layer_input too
    if "qk_rope_head_dim" in small and "head_dim" in d:  # MLA (DeepSeek): RoPE runs over the rope part of each head
        small["head_dim"] = small["qk_rope_head_dim"]
    if "kv_lora_rank" in small and "num_key_value_heads" in small:  # MLA: keys and values have every query head
        small["num_key_value_heads"] = small["num_attention_heads"]
    if "qk_head_dim" in d and "qk_rope_head_dim" in small:  # MLA's whole query head, where a config stores it
        small["qk_head_dim"] = small["qk_rope_head_dim"] + small.get("qk_nope_head_dim", 0)
    keep = _layers_kept(d)
    if d.get("num_kv_shared_layers"):
        small["num_kv_shared_layers"] = sum(i >= d["num_hidden_layers"] - d["num_kv_shared_layers"] for i in keep)
    small["num_hidden_layers"] = len(keep)
    for k, v in d.items():  # per-layer lists, layer-index lists and {layer: ...} tables cut to the layers kept
        if _is_index_list(v, d.get("num_hidden_layers")):
            small[k] = [j for j, i in enumerate(keep) if i in set(v)]
        elif _is_per_layer(v, d.get("num_hidden_layers")) and k in TINY_SIZES:  # a size per layer (Gemma-3n's MLPs)
            small[k] = [TINY_SIZES[k]] * len(keep)
        elif _is_per_layer(v, d.get("num_hidden_layers")):
            small[k] = [v[i] for i in keep] if isinstance(v, list) else "".join(v[i] for i in keep)
        elif isinstance(v, dict) and v and all(str(i).isdigit() for i in v) and k not in ("id2label", "label2id"):
            at = {int(i): i for i in v}  # keys as the config has them: ints, or digits in json
            small[k] = {type(at[i])(j): _small(v[at[i]], small, d) for j, i in enumerate(keep) if i in at}
    if d.get("rope_parameters") == {} and small.get("layer_types"):  # Cohere-Compass: RoPE per layer type, unset
        small["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": 10000.0} for t in small["layer_types"]}
    if isinstance(d.get("attn_config"), dict) and "rope_theta" not in d["attn_config"]:  # DBRX reads it there, as the
        small["attn_config"] = {**d["attn_config"], "rope_theta": 10000.0,           # hub's config.json has it
                                "clip_qkv": d["attn_config"].get("clip_qkv") or 8.0}
    if isinstance(d.get("ffn_config"), dict):
        small["ffn_config"] = {**d["ffn_config"], **{k: v for k, v in {"ffn_hidden_size": 128, "moe_num_experts": 4}.items()
                                                    if k in d["ffn_config"]}}
    if "axial_pos_embds_dim" in d:  # Reformer: the axial position factors sum to the hidden size
        small["axial_pos_embds_dim"] = [small.get("hidden_size", 64) // 2] * 2
    if "is_decoder" in d:  # a class that is a causal LM only as a decoder (Reformer's LM head asks for it)
        small["is_decoder"] = True
    for k, i in zip(("bos_token_id", "eos_token_id", "pad_token_id"), token_ids):
        if k in d:
            small[k] = i
    # What the class derives is derived again from the tiny sizes, not kept stale from the defaults: keys that are
    # not its fields (Zamba2's attention_hidden_size), and int fields whose default None means "derive it" (RWKV's
    # attention_hidden_size, xLSTM's embedding_dim, Falcon's ffn_hidden_size).
    if is_dataclass(text):
        own = {canonical.get(f.name, f.name): f for f in fields(text)}
        derived = {k for k, f in own.items() if f.default is None and isinstance(d.get(k), int)}
        d = {k: v for k, v in d.items() if (k in own and k not in derived) or k in small or k == "model_type"}
    d.update(small)
    d = {names.get(k, k): v for k, v in d.items()}  # the class's own names again
    for k, v in d.items():  # a text decoder's own parts as sub-configs (BLT's encoder/global/decoder) made tiny too
        if isinstance(v, dict) and "hidden_size" in v and k not in ("vision_config", "audio_config"):
            d[k] = {**v, **{x: y for x, y in TINY_SIZES.items() if v.get(x) is not None}, "num_hidden_layers": 2,
                    **{x: vocab_size for x in v if "vocab_size" in x}}
    if "layer_types" in d and d["layer_types"] is None and getattr(type(text)(**d), "layer_types", None) is None:
        d["layer_types"] = ["full_attention"] * d["num_hidden_layers"]  # a class that leaves them unset (LFM2-MoE)
    d.update(extra)
    if text is cfg:
        _tiny_towers(d, vision)
        return d
    top = {k: v for k, v in cfg.to_dict().items() if k not in ("transformers_version", "architectures")}
    top[next(k for k in ("text_config", "language_config", "llm_config") if k in top)] = d
    _tiny_towers(top, vision)
    return top


def _tiny_towers(d: dict, vision: dict | None) -> None:
    """A config's vision and audio towers made tiny in place (TINY_VISION), and `vision` over the vision tower's."""
    for key in ("vision_config", "audio_config"):
        if isinstance(d.get(key), dict):
            sub = d[key]
            sub.update({k: v for k, v in TINY_VISION.items() if k in sub})
    if vision and isinstance(d.get("vision_config"), dict):
        d["vision_config"].update(vision)
