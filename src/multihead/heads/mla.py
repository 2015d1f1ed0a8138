"""MHA / GQA -> MLA: rebuild every layer's keys and values from one low-rank latent per token.

Multi-head latent attention (DeepSeek-AI, 2024, "DeepSeek-V2") caches ``c = x W_DKV`` (width r) and
rebuilds each head's key and value as ``c W_UK^i``, ``c W_UV^i``. An existing model's keys and values are
two linear maps of the same input, stacked ``W_KV = [W_K; W_V]`` (2 Hkv D, d); its best rank-r
factorisation ``W_KV ~ W_UP W_DKV`` is a truncated SVD, the joint factorisation of keys and values that
MHA2MLA uses (Ji et al., 2025, "Towards Economical Inference: Enabling DeepSeek's Multi-Head Latent
Attention in Any Transformer-based LLMs"):

    W_KV = U S V^T,    W_DKV = V_r^T (r, d),    W_UP = U_r S_r (2 Hkv D, r)     (Eckart-Young)

With calibration inputs X (T, d) the factorisation minimises the error on the activations instead,
||X W_KV^T - X W_DKV^T W_UP^T||_F (activation-aware SVD, as SVD-LLM, Wang et al., 2025): with the Cholesky
factor X^T X = L L^T, take the SVD of ``W_KV L`` and ``W_DKV = V_r^T L^-1``.

Exact reparametrisations applied first (the converted model computes the same function at full rank):

- balance: keys enter only through q . k and values only through W^O v, so ``k -> a k, q -> q / a`` and
  ``v -> b v, W^O -> W^O / b`` change nothing; a and b make the key and value blocks equally large
  (Frobenius norm, on X when given) so that the shared rank is not spent on whichever is larger;
- biases: a key bias adds q . b_K to every score of a query row, which softmax ignores, so it is dropped;
  a value bias adds b_V to every head's output (the probabilities sum to one), so it moves into the W^O
  bias as W^O b_V. (A row that attends to no key at all would differ; the models here have none.)

Positions: models with absolute positions (BERT/MiniLM, GPT-2) have no rotary, so the latent carries
everything (``rope_dims = 0``); rotary models are not converted yet.

Shape legend: d width, Hq query heads, Hkv kv heads, D head dim, r kv_rank, T calibration tokens.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import Tensor, nn

from ..nn.attention import MultiHeadAttention
from ..variants.latent import LatentAttention
from .access import layers_of, plain_attention
from .gqa import calibration_inputs

__all__ = ["latent_from_attention", "max_kv_rank", "to_mla"]


def max_kv_rank(attn: MultiHeadAttention) -> int:
    """The rank at which the joint factorisation is exact: min(2 Hkv D, d)."""
    return min(2 * attn.n_kv_heads * attn.head_dim, attn.d_model)


def _top_right_vectors(m: Tensor, r: int) -> Tensor:
    """The r leading right singular vectors (d, r) of m (k, d), from the eigenvectors of m^T m (float64;
    much faster on CPU than an SVD of m for these sizes, and as exact at full rank: V is orthogonal)."""
    _, vecs = torch.linalg.eigh(m.T @ m)  # ascending eigenvalues s^2
    return vecs.flip(-1)[:, :r]  # (d, r)


def _factor(w: Tensor, r: int, x: Tensor | None) -> tuple[Tensor, Tensor]:
    """Rank-r ``w ~ up @ down`` for w (m, d): up (m, r), down (r, d); on activations x (T, d) when given."""
    if x is None:
        v = _top_right_vectors(w, r)  # (d, r) = V_r
        return w @ v, v.T  # U_r S_r = W V_r, V_r^T
    gram = x.T @ x  # (d, d)
    damp = 1e-6 * gram.diagonal().mean().clamp(min=1e-12)
    chol = torch.linalg.cholesky(gram + damp * torch.eye(gram.shape[0], dtype=gram.dtype))  # (d, d) L
    wl = w @ chol  # (m, d): W L
    v = _top_right_vectors(wl, r)  # (d, r)
    down = torch.linalg.solve_triangular(chol, v.T, upper=False, left=False)  # (r, d): V_r^T L^-1
    return wl @ v, down


@torch.no_grad()
def latent_from_attention(attn: MultiHeadAttention, kv_rank: int, x: Tensor | None = None) -> LatentAttention:
    """A :class:`LatentAttention` (rope_dims 0, no latent norm) approximating ``attn``'s keys and values
    with a rank-``kv_rank`` latent (see the module docstring); exact at :func:`max_kv_rank`.

    Args:
        attn: a plain MultiHeadAttention without rotary and without attention sinks.
        kv_rank: r, 1 <= r <= min(2 Hkv D, d).
        x: None, or (T, d) calibration inputs of this layer (activation-aware factorisation).

    Raises:
        ValueError: a rotary or sink attention, a kv_rank out of range.
    """
    Hq, Hkv, D, d = attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.d_model
    if attn.rotary is not None:
        raise ValueError(
            f"to_mla converts attention without rotary (absolute positions: BERT, GPT-2); this layer has "
            f"{attn.rotary!r}; use mh.heads.to_gqa for rotary models"
        )
    if attn.sinks is not None:
        raise ValueError(
            "to_mla cannot convert attention with sinks (its value bias would not fold into W^O)"
        )
    top = max_kv_rank(attn)
    if isinstance(kv_rank, bool) or not isinstance(kv_rank, int) or not 1 <= kv_rank <= top:
        raise ValueError(
            f"kv_rank must be an int in [1, {top}] (min(2 * kv heads * head dim, d_model) = "
            f"min({2 * Hkv * D}, "
            f"{d}), where the factorisation is exact), got {kv_rank!r}"
        )
    w, b = attn.qkv_proj.weight.double(), attn.qkv_proj.bias
    w_q, w_k, w_v = w.split([Hq * D, Hkv * D, Hkv * D])  # (Hq D, d), (Hkv D, d), (Hkv D, d)
    xd = None if x is None else x.double()
    nk = (w_k if xd is None else xd @ w_k.T).norm()
    nv = (w_v if xd is None else xd @ w_v.T).norm()
    a = math.sqrt(float(nv / nk)) if nk > 0 and nv > 0 else 1.0  # keys x a, values x 1/a: equal norms
    up, down = _factor(torch.cat([w_k * a, w_v / a]), kv_rank, xd)  # (2 Hkv D, r), (r, d)
    G = Hq // Hkv
    uk = up[: Hkv * D].reshape(Hkv, D, kv_rank).repeat_interleave(G, dim=0)  # (Hq, D, r)
    uv = up[Hkv * D :].reshape(Hkv, D, kv_rank).repeat_interleave(G, dim=0)  # (Hq, D, r)
    wo = attn.o_proj.weight.double()  # (d, Hq D)
    has_bias = b is not None or attn.o_proj.bias is not None
    ref = attn.qkv_proj.weight
    new = LatentAttention(
        d, Hq, kv_rank=kv_rank, rope_dims=0, nope_dims=D, v_head_dim=D, kv_norm=False,
        scale=attn.score_scale if attn.score_scale is not None else 1.0 / math.sqrt(D),
        bias=has_bias, dropout=attn.dropout, backend=attn.backend, device=ref.device, dtype=ref.dtype,
    )  # fmt: skip
    assert new.q_proj is not None
    with torch.no_grad():
        new.q_proj.weight.copy_(w_q / a)
        new.kv_down.weight.copy_(down)
        new.kv_up.weight.copy_(torch.cat([uk, uv], dim=1).reshape(Hq * 2 * D, kv_rank))  # head by head
        new.o_proj.weight.copy_(wo * a)
        if has_bias:
            bq, bv = (
                (torch.zeros(Hq * D), torch.zeros(Hkv * D)) if b is None else (b[: Hq * D], b[-Hkv * D :])
            )
            bo = torch.zeros(d) if attn.o_proj.bias is None else attn.o_proj.bias.double()
            bv_q = bv.double().reshape(Hkv, D).repeat_interleave(G, dim=0).reshape(Hq * D)  # (Hq D,)
            new.q_proj.bias.copy_(bq / a)
            new.kv_down.bias.zero_()
            new.o_proj.bias.copy_(bo + wo @ bv_q)  # the value bias, through W^O
    return new.train(attn.training)


def to_mla(
    model: nn.Module, kv_rank: int, rope_dims: int | None = None, calibration: Any = None
) -> nn.Module:
    """A copy of ``model`` whose every self-attention is multi-head latent attention with a latent of
    width ``kv_rank`` (joint low-rank factorisation of the keys and values; see the module docstring).

    The KV cache per token and layer shrinks from 2 Hkv D numbers to ``kv_rank``
    (:func:`~multihead.heads.kv_cache_bytes_per_token` counts it). At ``kv_rank`` = min(2 Hkv D, d) the
    copy computes the same function as the model (up to rounding).

    Args:
        model: a multihead model whose layers are plain MultiHeadAttention without rotary (MiniLM,
            Bert, GPT-2 from_hf). It is not changed.
        kv_rank: r, the latent width, 1 <= r <= min(2 Hkv D, d) in every layer.
        rope_dims: None or 0: no decoupled rotary key (absolute positions).
        calibration: None (factorise the weights) or inputs - texts for a SentenceEncoder, token ids
            ((n, N) int tensor or id lists) for any model - for the activation-aware factorisation.

    Returns:
        the converted copy, in the model's training mode.

    Raises:
        ValueError: a rope_dims other than None/0, a layer that is not a plain MultiHeadAttention, a
            rotary or sink layer, a kv_rank out of range, calibration inputs the model cannot take.
    """
    if rope_dims not in (None, 0):
        raise ValueError(
            f"rope_dims={rope_dims!r}: to_mla converts models without rotary (absolute positions) only, so "
            "there is no rotary key to keep; pass rope_dims=None or 0"
        )
    layers = layers_of(model)
    attns = [plain_attention(layer, i, "to_mla") for i, layer in enumerate(layers)]
    for attn in attns:
        if attn.rotary is not None or attn.sinks is not None:
            latent_from_attention(attn, kv_rank)  # raises the reason
        top = max_kv_rank(attn)
        if isinstance(kv_rank, bool) or not isinstance(kv_rank, int) or not 1 <= kv_rank <= top:
            latent_from_attention(attn, kv_rank)  # raises the reason
    xs: list[Tensor | None] = [None] * len(layers)
    if calibration is not None:
        xs = list(calibration_inputs(model, calibration, what="to_mla(calibration=...)"))
    out = copy.deepcopy(model)
    for layer, x in zip(layers_of(out), xs):
        layer.self_attn = latent_from_attention(layer.self_attn, kv_rank, x)
    return out
