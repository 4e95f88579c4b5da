"""The torch-free fast path of config.model_shape: a flat config.json of one of ten layouts (DEFAULTS) read into a
shape.Shape, weight by weight as transformers 5.24 names them (`models/*/modeling_*.py`).

The layouts: Llama/Mistral, Qwen2 (q/k/v biases), Qwen3 and Gemma-3 (q/k norms over head_dim), Gemma-2/3 (four norms
per layer), Phi-3 (fused `qkv_proj`, `gate_up_proj`), and mixtures of experts: Mixtral, Qwen2-MoE (a shared expert
behind a sigmoid gate), Qwen3-MoE (dense `mlp_only_layers`, `decoder_sparse_step`). Experts are fused 3-D parameters
(`mlp.experts.gate_up_proj` [E, 2*inter, hidden], `mlp.experts.down_proj` [E, hidden, inter]) behind a router
`mlp.gate` (weight [E, hidden]). Keys a config.json leaves out take the config class's default (`DEFAULTS`; a test
compares them with transformers). tests/facts/test_shape.py proves every layout equal to the model transformers builds.
"""

from __future__ import annotations

from typing import Any

from sftrecipes.facts.shape import Layer, Shape, Weight

# Class defaults (transformers 5.24 config classes) of every key the layouts read. None: derived (kv heads = heads,
# head_dim = hidden / heads). A key absent here is read with getattr(config, key, fallback) by the model itself.
_DENSE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "tie_word_embeddings", "max_position_embeddings")
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(zip(_DENSE, (32000, 4096, 11008, 32, 32, None, False, 2048)), head_dim=None, attention_bias=False,
                  mlp_bias=False),
    "mistral": dict(zip(_DENSE, (32000, 4096, 14336, 32, 32, 8, False, 131072)), head_dim=None),
    "qwen2": dict(zip(_DENSE, (151936, 4096, 22016, 32, 32, 32, False, 32768))),
    "qwen3": dict(zip(_DENSE, (151936, 4096, 22016, 32, 32, 32, False, 32768)), head_dim=128, attention_bias=False),
    "gemma2": dict(zip(_DENSE, (256000, 2304, 9216, 26, 8, 4, True, 8192)), head_dim=256, attention_bias=False),
    "gemma3_text": dict(zip(_DENSE, (262208, 2304, 9216, 26, 8, 4, True, 131072)), head_dim=256, attention_bias=False),
    "phi3": dict(zip(_DENSE, (32064, 3072, 8192, 32, 32, None, False, 4096))),
    "mixtral": dict(zip(_DENSE, (32000, 4096, 14336, 32, 32, 8, False, 131072)), head_dim=None, num_local_experts=8,
                    num_experts_per_tok=2),
    "qwen2_moe": dict(zip(_DENSE, (151936, 2048, 5632, 24, 16, 16, False, 32768)), num_experts=60,
                      num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                      decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True),
    "qwen3_moe": dict(zip(_DENSE, (151936, 2048, 6144, 24, 32, 4, False, 32768)), attention_bias=False,
                      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1,
                      mlp_only_layers=[]),
}
# types whose q/k/v/o biases follow attention_bias (Qwen2 has q/k/v biases always, Qwen2-MoE per qkv_bias, the others none)
ATTENTION_BIAS = ("llama", "qwen3", "qwen3_moe", "gemma2", "gemma3_text")


def table_shape(c: dict, mt: str, name: str) -> Shape:
    """The Shape of a flat config dict of a layout DEFAULTS holds (model_type mt), every layer with the same sizes
    (config.model_shape hands a config with per-layer overrides to the meta path)."""
    d = DEFAULTS[mt]

    def get(key, fallback=None):
        v = c.get(key, d.get(key, fallback))
        return fallback if v is None else v

    h, heads, n = get("hidden_size"), get("num_attention_heads"), get("num_hidden_layers")
    kv = get("num_key_value_heads", heads)
    hd = get("head_dim", h // heads)
    inter, vocab = get("intermediate_size"), get("vocab_size")
    q, kvd = heads * hd, kv * hd
    experts = 0
    if mt in ("mixtral", "qwen2_moe", "qwen3_moe"):  # one count, two spellings (an attribute_map aliases them)
        experts = next((c[k] for k in ("num_experts", "num_local_experts") if c.get(k) is not None),
                       d.get("num_experts", d.get("num_local_experts")))
    top_k = get("num_experts_per_tok", 0) if experts else 0
    e_inter = (inter if mt == "mixtral" else get("moe_intermediate_size")) if experts else 0
    shared = get("shared_expert_intermediate_size", 0) if mt == "qwen2_moe" else 0

    def lin(path, fan_in, fan_out, bias=False):
        return [Weight(path, "linear", (fan_out, fan_in))] + ([Weight(path + ".bias", "bias", (fan_out,))] if bias else [])

    def mlp(prefix, width):
        return lin(f"{prefix}.gate_proj", h, width) + lin(f"{prefix}.up_proj", h, width) + lin(f"{prefix}.down_proj", width, h)

    # attention
    if mt == "phi3":
        attn = lin("self_attn.qkv_proj", h, q + 2 * kvd) + lin("self_attn.o_proj", q, h)
    else:
        o_bias = mt in ATTENTION_BIAS and bool(get("attention_bias", False))
        qkv_bias = o_bias or mt == "qwen2" or (mt == "qwen2_moe" and bool(get("qkv_bias")))
        attn = (lin("self_attn.q_proj", h, q, qkv_bias) + lin("self_attn.k_proj", h, kvd, qkv_bias)
                + lin("self_attn.v_proj", h, kvd, qkv_bias) + lin("self_attn.o_proj", q, h, o_bias))
    if mt in ("qwen3", "qwen3_moe", "gemma3_text"):
        attn += [Weight("self_attn.q_norm", "norm", (hd,)), Weight("self_attn.k_norm", "norm", (hd,))]
    norm_names = ["input_layernorm", "post_attention_layernorm"]
    if mt in ("gemma2", "gemma3_text"):
        norm_names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    norms = [Weight(x, "norm", (h,)) for x in norm_names]

    # MLP: dense, fused (Phi-3) or sparse
    if mt == "phi3":
        dense = lin("mlp.gate_up_proj", h, 2 * inter) + lin("mlp.down_proj", inter, h)
    else:
        bias = mt == "llama" and bool(get("mlp_bias", False))
        dense = lin("mlp.gate_proj", h, inter, bias) + lin("mlp.up_proj", h, inter, bias) + lin("mlp.down_proj", inter, h, bias)
    sizes = dict(heads=heads, kv_heads=kv, head_dim=hd)
    dense_layer = Layer(tuple(attn + dense + norms), intermediate=inter, **sizes)
    sparse_layer = None
    if experts:
        moe = [Weight("mlp.gate", "router", (experts, h)),
               Weight("mlp.experts.gate_up_proj", "experts", (experts, 2 * e_inter, h)),
               Weight("mlp.experts.down_proj", "experts", (experts, h, e_inter))]
        if shared:
            moe += mlp("mlp.shared_expert", shared) + lin("mlp.shared_expert_gate", h, 1)
        sparse_layer = Layer(tuple(attn + moe + norms), experts, top_k, shared, **sizes)
    if mt == "mixtral":
        decoder = tuple(sparse_layer for _ in range(n))
    elif experts:  # Qwen2/3-MoE: sparse unless listed in mlp_only_layers or off the decoder_sparse_step
        only, step = set(get("mlp_only_layers", [])), get("decoder_sparse_step", 1)
        decoder = tuple(sparse_layer if (i not in only and (i + 1) % step == 0) else dense_layer for i in range(n))
    else:
        decoder = tuple(dense_layer for _ in range(n))
    return Shape(name, mt, h, vocab, bool(get("tie_word_embeddings", False)),
                 get("max_position_embeddings", 0), decoder, experts, top_k, e_inter, shared)
