"""The project's varlen attention kernel (`sft_varlen`), registered with transformers: packed samples attend within
their own segment, with no dense block-diagonal mask.

Packed (padding-free) batches reach the model as one row of several samples; their boundaries come from the
collator's `cu_seq_lens_q` (TRL's padding-free collator) or from `position_ids` restarting. Under sdpa, transformers
turns them into a dense (tokens x tokens) mask whose every block the kernel computes; here each sample is attended on
its own:
- on CUDA in bf16/fp16: torch's `torch.nn.attention.varlen.varlen_attn` (flash kernels with a backward pass) reads the
  segment boundaries directly (causal, sliding windows and GQA in the kernel);
- otherwise (CPU, fp32, dropout, or a torch without varlen_attn): the segments, grouped by similar length, are
  gathered into a padded batch per group and attended with causal sdpa (right padding needs no mask under a causal
  kernel: a real token never sees a later position); a sliding window is one shared band mask per group.
Anything that is not a packed or plain causal self-attention (a padded batch with a 2-D attention mask, decoding with
a KV cache) goes to transformers' own sdpa function, mask included: there this kernel is exactly sdpa.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

log = logging.getLogger("sftrecipes")

NAME = "sft_varlen"

# Segments are grouped longest first; a group takes the next segment while it is at least this share of the group's
# longest (its padded cost is then at most 1/0.7^2 ~ 2x its own). Measured on this CPU (2 layers' worth of a packed
# tiny-llama batch, 2048 tokens, ~50 samples + 144 pad tokens, fwd+bwd): one call per segment 36-41 ms, one padded
# batch of all 40 ms, groups at 0.5 16 ms, at 0.7 12 ms, at 0.85 12 ms; dense masked sdpa 172 ms.
GROUP_RATIO = 0.7

_warned: set[str] = set()
_plan_cache: dict = {}


def _once(key: str, msg: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def _torch_varlen():
    """torch.nn.attention.varlen.varlen_attn, or None where this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def segment_bounds(batch: int, length: int, device, cu_seq_lens=None, position_ids=None,
                   trust: bool = False) -> tuple[torch.Tensor, bool]:
    """(cumulative segment boundaries (int64, from 0 to batch*length) of a (batch, length) input flattened into one
    row, whether they are the collator's): the collator's cu_seq_lens where they describe this input, else where
    position_ids restart (any step that is not +1, as transformers' find_packed_sequence_indices reads them), else one
    segment per row. trust: take the collator's boundaries of a one-row input without reading their last value (on a
    GPU that read is a host sync in every layer; transformers' flash path takes them as given too)."""
    total = batch * length
    if (cu_seq_lens is not None and batch == 1 and cu_seq_lens.numel() >= 2
            and (trust or int(cu_seq_lens[-1]) == total)):
        return cu_seq_lens.to(device=device, dtype=torch.long), True
    if position_ids is not None and position_ids.shape[-1] == length:
        pos = position_ids.reshape(-1, length).expand(batch, length).to(device)
        starts = torch.ones_like(pos, dtype=torch.bool)
        starts[:, 1:] = pos[:, 1:] - pos[:, :-1] != 1
        first = starts.reshape(-1).nonzero().flatten()
        return torch.cat([first, torch.tensor([total], device=device)]), False
    return torch.arange(0, total + 1, length, device=device), False


def _plan(cu: torch.Tensor):
    """The padded-batch layout of these segments, cached for the next layer: (groups [(flat gather index of n
    segments padded to M tokens, n, M)], each token's row in the groups' concatenated outputs, None, None), or
    (None, None, n, M) when all n segments have the same length M (a plain reshape)."""
    lens = cu.diff().tolist()
    key = (str(cu.device), tuple(lens))
    if key in _plan_cache:
        return _plan_cache[key]
    device = cu.device
    if len(set(lens)) == 1:
        plan = (None, None, len(lens), lens[0])
    else:
        starts = cu[:-1].tolist()
        order = sorted((i for i in range(len(lens)) if lens[i] > 0), key=lambda i: -lens[i])
        groups: list[list[int]] = []
        for i in order:
            if not groups or lens[i] < GROUP_RATIO * lens[groups[-1][0]]:
                groups.append([])
            groups[-1].append(i)
        total = int(cu[-1])
        gathers, where, offset = [], torch.empty(total, dtype=torch.long), 0
        for g in groups:
            n, m = len(g), lens[g[0]]
            s = torch.tensor([starts[i] for i in g])
            ln = torch.tensor([lens[i] for i in g])
            col = torch.arange(m)
            valid = col[None, :] < ln[:, None]
            idx = torch.where(valid, s[:, None] + col[None, :], 0)  # padding reads token 0: never seen by a real token
            where[idx[valid]] = offset + valid.flatten().nonzero().flatten()
            gathers.append((idx.flatten().to(device), n, m))
            offset += n * m
        plan = (gathers, where.to(device), None, None)
    _plan_cache.clear()
    _plan_cache[key] = plan
    return plan


def _band(m: int, window: int, device) -> torch.Tensor:
    i = torch.arange(m, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


def _segments_sdpa(q, k, v, cu, scaling, dropout, window):
    """(T, H, D) queries and (T, Hkv, D) keys/values of concatenated segments -> (T, H, D): causal sdpa within each
    segment, segments grouped into padded batches."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # repeating kv measured faster than sdpa's enable_gqa on this CPU
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    gathers, where, n_same, m_same = _plan(cu)

    def attend(qg, kg, vg, m):  # (n, H, m, D) each
        mask = _band(m, window, q.device) if window is not None and window < m else None
        return F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                              is_causal=mask is None)

    if gathers is None:  # equal segments: a reshape
        def rows(x):
            return x.view(n_same, m_same, x.shape[1], x.shape[2]).transpose(1, 2)
        out = attend(rows(q), rows(k), rows(v), m_same)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], v.shape[2])
    outs = []
    for idx, n, m in gathers:
        def rows(x, idx=idx, n=n, m=m):
            return x.index_select(0, idx).view(n, m, x.shape[1], x.shape[2]).transpose(1, 2)
        o = attend(rows(q), rows(k), rows(v), m)
        outs.append(o.transpose(1, 2).reshape(n * m, q.shape[1], v.shape[2]))
    return torch.cat(outs).index_select(0, where)


def _flash_kernel_applies(query: torch.Tensor, dropout: float) -> bool:
    """torch's varlen flash kernel serves this call: CUDA, 16-bit, no dropout."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and not dropout


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """transformers' attention interface: (B, H, S, D) query, (B, Hkv, S, D) key/value -> ((B, S, H, D), None).
    Packed or plain causal self-attention (no mask from varlen_mask) attends per segment; anything else is sdpa's."""
    if softcap is not None:
        raise ValueError(f"{NAME} has no logit soft-capping (attn_logit_softcapping); use eager")
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{NAME} has no attention sinks; use eager or flash_attention_2")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    b, h, s, d = query.shape
    if attention_mask is not None or key.shape[2] != s or not causal or s == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    window = sliding_window if sliding_window is not None and sliding_window > 0 else None
    q = query.transpose(1, 2).reshape(b * s, h, d)
    k = key.transpose(1, 2).reshape(b * s, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * s, value.shape[1], value.shape[3])
    flash = _flash_kernel_applies(query, dropout)
    varlen_attn = _torch_varlen() if flash else None
    # with the flash kernel, the collator's boundaries and their longest segment (a Python int) are used unread: no
    # host sync per layer (tests/model/test_attention.py counts the reads)
    trust = varlen_attn is not None and kwargs.get("max_length_q") is not None
    cu, from_collator = segment_bounds(b, s, query.device, kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids"), trust)
    if flash:
        if varlen_attn is not None:
            max_len = int(kwargs["max_length_q"]) if from_collator and trust else int(cu.diff().max())
            cu32 = cu.to(torch.int32)
            out = varlen_attn(q, k, v, cu32, cu32, max_len, max_len, scale=scaling,
                              window_size=(window - 1, 0) if window is not None else (-1, 0),
                              enable_gqa=k.shape[1] != h)
            return out.view(b, s, h, -1), None
        _once("no-varlen", "attention: %s: torch %s has no torch.nn.attention.varlen.varlen_attn; packed samples attend "
              "through per-segment sdpa instead (slower on a GPU; a newer torch has the flash kernel)", NAME, torch.__version__)
    out = _segments_sdpa(q, k, v, cu, scaling, dropout, window)
    return out.view(b, s, h, -1), None


def varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                attention_mask=None, **kwargs):
    """transformers' mask interface: no mask at all for causal self-attention without padding (packed or not: the
    kernel reads segments itself), sdpa's mask for anything else (a padded batch, decoding over a cache)."""
    plain = (attention_mask is None and q_length == kv_length and isinstance(q_offset, int) and q_offset == 0
             and isinstance(kv_offset, int) and kv_offset == 0)
    if plain:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=mask_function or causal_mask_function, attention_mask=attention_mask, **kwargs)


def register(slot: str = NAME) -> str:
    """Register the kernel and its mask with transformers (idempotent); returns its name for attn_implementation.
    slot "sdpa": in the place of transformers' sdpa for the whole process (sequence parallelism: DeepSpeed's Ulysses
    wraps the sdpa slot, and this kernel, given no mask there, keeps the packed samples apart by their position_ids)."""
    AttentionInterface.register(slot, varlen_attention_forward)
    AttentionMaskInterface.register(slot, varlen_mask)
    return slot


def kernel_of(model) -> str:
    """The kernel a loaded model attends with: its config's attn_implementation, or this one where it sits in the
    sdpa slot (register(slot="sdpa"), under sequence parallelism)."""
    name = model.config._attn_implementation
    if name == "sdpa" and AttentionInterface._global_mapping.get("sdpa") is varlen_attention_forward:
        return NAME
    return name
