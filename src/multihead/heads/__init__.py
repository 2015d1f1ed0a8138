"""Heads of a real model: what they do, which matter, and how to have fewer.

    maps = mh.heads.attention_maps(model, texts)            # per text (L, H, N, N)
    table = mh.heads.roles(maps, mh.heads.token_strings(model, texts))   # Clark et al. statistics
    scores = mh.heads.importance(model, texts)               # (L, H), Michel et al.
    mh.heads.prune(model, {0: [3, 7], 5: [1]})               # really removes them
    mh.heads.to_gqa(model, 4, method="aligned")              # MHA -> GQA, Procrustes-aligned merge
    small = mh.heads.to_mla(model, 128, calibration=texts)   # MHA -> MLA copy, joint SVD of W_K, W_V
    mla_lm = mh.heads.to_mla(lm, 64, rope_dims=8, calibration=ids)   # rotary LM: partial RoPE (MHA2MLA)
    mh.heads.recover(small, model, mh.heads.mixed_lengths(texts), minutes=5)   # distil the original back

Every tool addresses heads as (layer, head): layer i is the model's i-th TransformerLayer, head h its
self-attention's query head h.
"""

from .access import layers_of, token_strings
from .checkpoint import apply_surgery, load_converted, save_converted
from .gqa import kv_cache_bytes_per_token, procrustes, rotate_heads, to_gqa
from .labels import HeadRole, roles, roles_grid, roles_table
from .maps import attention_maps, capture_attention
from .mla import max_kv_rank, to_mla
from .pruning import EmptyAttention, prune
from .recover import changed_parameters, distillation_loss, mixed_lengths, recover
from .scoring import gate_heads, importance, lm_loss, span_contrastive_loss

__all__ = [
    "EmptyAttention",
    "HeadRole",
    "apply_surgery",
    "attention_maps",
    "capture_attention",
    "changed_parameters",
    "distillation_loss",
    "gate_heads",
    "importance",
    "kv_cache_bytes_per_token",
    "layers_of",
    "lm_loss",
    "load_converted",
    "max_kv_rank",
    "mixed_lengths",
    "procrustes",
    "prune",
    "recover",
    "roles",
    "roles_grid",
    "roles_table",
    "rotate_heads",
    "save_converted",
    "span_contrastive_loss",
    "to_gqa",
    "to_mla",
    "token_strings",
]
