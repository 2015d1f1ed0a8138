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
- biases: a key bias adds q . b_K to every score of a query row, which softmax ignores, so it is dropped
  (on the rotary features it turns with the key's position, so there it stays, on the rope key);
  a value bias adds b_V to every head's output (the probabilities sum to one), so it moves into the W^O
  bias as W^O b_V. (A row that attends to no key at all would differ; the models here have none.)

Positions. Models with absolute positions (BERT/MiniLM, GPT-2) have no rotary, so the latent carries
everything (``rope_dims = 0``). Rotary models (LLaMA, Mistral, Qwen2) convert with MHA2MLA's partial RoPE:
per kv head, keep R / 2 of the D / 2 rotary frequency pairs and remove the rotation from the others, whose
features become position-free ("nope") dims:

    q_i . k_g  ->  q_i^nope . k_g^nope  +  RoPE(q_i^rope) . RoPE(k_g^rope)        (D - R) + R features

The nope keys of every kv head are factorised jointly with the values, ``[W_K^nope; W_V]`` (Hkv (2D - R),
d) -> rank r, one latent shared by all heads as in DeepSeek's MLA; the kept rope keys stay exact, one per
kv head: :class:`LatentAttention` with
``rope_heads = Hkv`` and a :class:`~multihead.nn.positions.PartialRotary` that rotates each head's kept
pairs at their original frequencies. That is MHA2MLA's layout (each head keeps its own rope dims and
caches them), not DeepSeek's single shared rotary key: a shared key would have to merge heads whose kept
pairs differ, an approximation the per-head key does not need. The cache holds r + Hkv R numbers per
token and layer. Removing rotary from the dropped pairs is the one change that is not exact at full rank
(MHA2MLA recovers it by fine-tuning: ``mh.heads.recover``); keeping every pair (R = D) with r =
:func:`max_kv_rank` reproduces the model. Which pairs to keep (``rope_select``, MHA2MLA's choices):

- "norm": per kv head, the R / 2 pairs of largest contribution ``sum_t sum_(i in group) ||q_i,t^(p)||
  ||k_t^(p)||`` (2-norms of the pair's two features; rotation keeps them) over the calibration tokens,
  or without calibration over the expected norms under white inputs (the Frobenius norms of the pair's
  weight rows and biases);
- "high": the R / 2 highest frequencies (pairs 0 .. R/2 - 1), the same for every head;
- "low": the R / 2 lowest frequencies;
- "uniform": R / 2 pairs evenly spaced over the D / 2 (pair ``floor(j D / R)`` for j < R / 2), starting
  with the highest frequency;
- "disjoint": the "norm" scores, but each pair kept by at most one kv head (greedily, strongest
  (head, pair) first), so Hkv R <= D. Then every kv head's rotary key fits in one shared rotary key of
  width D at the original frequencies: the layout of DeepSeek-V3, which ``mh.pretrained.to_hf`` writes
  exactly (a frequency kept by two heads would need two rotary features of that frequency, which a
  single rotary key of geometric frequencies does not have).

Shape legend: d width, Hq query heads, Hkv kv heads, G = Hq / Hkv, D head dim, r kv_rank, R rope_dims kept
per head, P = R / 2 kept pairs, T calibration tokens.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import Tensor, nn

from ..core.checks import check_int
from ..nn.attention import MultiHeadAttention
from ..nn.positions import PartialRotary, RotaryEmbedding
from ..pretrained.corpus import stdlib_docstrings
from ..pretrained.sentence_encoder import SentenceEncoder
from ..variants.latent import LatentAttention
from .access import layers_of, plain_attention
from .gqa import calibration_inputs

__all__ = [
    "ENCODER_CALIBRATION_DOCS",
    "ROPE_SELECT",
    "default_calibration",
    "default_rope_dims",
    "latent_from_attention",
    "max_kv_rank",
    "select_rope_pairs",
    "to_mla",
]

#: How :func:`to_mla` chooses the rotary pairs each kv head keeps (see the module docstring).
ROPE_SELECT = ("norm", "high", "low", "uniform", "disjoint")


def max_kv_rank(attn: MultiHeadAttention, rope_dims: int = 0) -> int:
    """The rank at which the joint factorisation is exact: min(2 Hkv D, d), or with ``rope_dims`` = R
    rotary dims kept per head (outside the latent) min(Hkv (2D - R), d)."""
    return min(attn.n_kv_heads * (2 * attn.head_dim - rope_dims), attn.d_model)


def _pair_features(rotary: RotaryEmbedding, D: int) -> tuple[Tensor, Tensor]:
    """The two features of each rotary pair within a head: (D/2,) first, (D/2,) second."""
    i = torch.arange(D // 2)
    return (2 * i, 2 * i + 1) if rotary.interleaved else (i, i + D // 2)


def _pair_norms(t: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """2-norms of each pair of t (..., D): (..., D/2)."""
    return (t[..., first].square() + t[..., second].square()).sqrt()


def select_rope_pairs(
    attn: MultiHeadAttention, rope_dims: int, select: str = "norm", x: Tensor | None = None
) -> Tensor:
    """The rotary frequency pairs each kv head of ``attn`` keeps: (Hkv, R / 2) indices, ascending per row
    (pair p rotates features p and p + D/2 - or 2p, 2p + 1 interleaved - by ``pos * base^(-2p/D)``).

    Args:
        attn: a MultiHeadAttention with a RotaryEmbedding over its whole head dim.
        rope_dims: R, the rotary dims kept per head: even, 2 <= R <= D.
        select: one of :data:`ROPE_SELECT` (see the module docstring).
        x: None, or (T, d) inputs of this layer for the "norm" scores.

    Raises:
        ValueError: an attention without such a rotary, a bad rope_dims or select.
    """
    Hkv, D = attn.n_kv_heads, attn.head_dim
    rotary = attn.rotary
    if not isinstance(rotary, RotaryEmbedding) or rotary.head_dim != D:
        raise ValueError(
            f"to_mla keeps rotary pairs of a RotaryEmbedding over the whole head dim {D}; this layer has "
            f"{rotary!r}"
        )
    _check_rope_dims(rope_dims, D)
    if select not in ROPE_SELECT:
        raise ValueError(f"rope_select must be one of {list(ROPE_SELECT)}, got {select!r}")
    half, P = D // 2, rope_dims // 2
    if select == "high":
        return torch.arange(P).expand(Hkv, P).clone()  # (Hkv, P)
    if select == "low":
        return torch.arange(half - P, half).expand(Hkv, P).clone()  # (Hkv, P)
    if select == "uniform":
        return (torch.arange(P) * half // P).expand(Hkv, P).clone()  # (Hkv, P)
    score = _pair_scores(attn, x)  # (Hkv, D/2)
    if select == "norm":
        return score.topk(P, dim=1).indices.sort(dim=1).values  # (Hkv, P)
    return _disjoint_pairs(score, P, D)


def _pair_scores(attn: MultiHeadAttention, x: Tensor | None) -> Tensor:
    """Each kv head's contribution score per rotary pair (Hkv, D/2); see the module docstring ("norm")."""
    Hq, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    assert isinstance(attn.rotary, RotaryEmbedding)
    half = D // 2
    first, second = _pair_features(attn.rotary, D)
    w, b = attn.qkv_proj.weight.double(), attn.qkv_proj.bias
    w_q, w_k = w[: Hq * D], w[Hq * D : (Hq + Hkv) * D]  # (Hq D, d), (Hkv D, d)
    b_q = None if b is None else b[: Hq * D].double()
    b_k = None if b is None else b[Hq * D : (Hq + Hkv) * D].double()
    if x is None:  # E ||W x + b||^2 over white x = ||W||_F^2 + ||b||^2, per feature
        q2 = w_q.square().sum(1) + (0 if b_q is None else b_q.square())  # (Hq D,)
        k2 = w_k.square().sum(1) + (0 if b_k is None else b_k.square())  # (Hkv D,)
        qn = _pair_norms(q2.sqrt().reshape(Hq, D), first, second)  # (Hq, D/2)
        kn = _pair_norms(k2.sqrt().reshape(Hkv, D), first, second)  # (Hkv, D/2)
        return qn.reshape(Hkv, Hq // Hkv, half).sum(1) * kn  # (Hkv, D/2)
    xd = x.double()
    q = xd @ w_q.T + (0 if b_q is None else b_q)  # (T, Hq D)
    k = xd @ w_k.T + (0 if b_k is None else b_k)  # (T, Hkv D)
    qn = _pair_norms(q.reshape(-1, Hkv, Hq // Hkv, D), first, second).sum(2)  # (T, Hkv, D/2)
    kn = _pair_norms(k.reshape(-1, Hkv, D), first, second)  # (T, Hkv, D/2)
    return (qn * kn).sum(0)  # (Hkv, D/2)


def _disjoint_pairs(score: Tensor, P: int, D: int) -> Tensor:
    """P pairs per kv head, no pair in two heads: greedy over (head, pair) by descending score.

    Raises:
        ValueError: Hkv P > D / 2 (not enough pairs to go round).
    """
    Hkv, half = score.shape
    if Hkv * P > half:
        raise ValueError(
            f"rope_select='disjoint' keeps each rotary pair in at most one kv head, so kv heads x rope_dims "
            f"= {Hkv} x {2 * P} must be <= the head dim {D}; pass rope_dims <= {max(2, D // Hkv // 2 * 2)}"
        )
    taken = torch.zeros(half, dtype=torch.bool)
    chosen: list[list[int]] = [[] for _ in range(Hkv)]
    for flat in score.flatten().argsort(descending=True).tolist():
        g, p = divmod(flat, half)
        if len(chosen[g]) < P and not taken[p]:
            chosen[g].append(p)
            taken[p] = True
    return torch.tensor(chosen).sort(dim=1).values  # (Hkv, P)


def _check_rope_dims(rope_dims: Any, D: int) -> int:
    """rope_dims for a rotary layer: an even int in [2, D]."""
    R = check_int(
        "rope_dims", rope_dims, 2, D,
        fix=f"the rotary dims kept per head, an even number up to the head dim {D} (pairs rotate together)",
    )  # fmt: skip
    if R % 2:
        raise ValueError(
            f"rope_dims must be even (rotary features rotate in pairs), got {R}; pass {R - 1} or {R + 1}"
        )
    return R


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
def latent_from_attention(
    attn: MultiHeadAttention,
    kv_rank: int,
    x: Tensor | None = None,
    *,
    rope_dims: int = 0,
    rope_select: str = "norm",
) -> LatentAttention:
    """A :class:`LatentAttention` (no latent norm) approximating ``attn``'s keys and values with a
    rank-``kv_rank`` latent (see the module docstring); exact at :func:`max_kv_rank` without rotary, or
    with rotary when every pair is kept (rope_dims = D).

    Args:
        attn: a plain MultiHeadAttention without attention sinks; with rotary, a RotaryEmbedding over its
            whole head dim.
        kv_rank: r, 1 <= r <= :func:`max_kv_rank` (attn, rope_dims).
        x: None, or (T, d) calibration inputs of this layer (activation-aware factorisation, and the
            "norm" pair scores).
        rope_dims: R, rotary dims kept per head: 0 without rotary; with rotary an even 2 <= R <= D.
        rope_select: which pairs, one of :data:`ROPE_SELECT`.

    Raises:
        ValueError: a sink attention, a rope_dims that does not fit the layer (non-zero without rotary,
            odd, out of [2, D] with rotary), an unknown rope_select, a kv_rank out of range.
    """
    Hq, Hkv, D, d = attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.d_model
    if attn.sinks is not None:
        raise ValueError(
            "to_mla cannot convert attention with sinks (its value bias would not fold into W^O)"
        )
    if attn.rotary is None and rope_dims != 0:
        raise ValueError(
            f"rope_dims={rope_dims!r}: to_mla converts models without rotary (absolute positions) with "
            "rope_dims=None or 0 - there is no rotary key to keep"
        )
    R = 0 if attn.rotary is None else _check_rope_dims(rope_dims, D)
    pairs = None if attn.rotary is None else select_rope_pairs(attn, R, rope_select, x)  # (Hkv, P)
    top = max_kv_rank(attn, R)
    if isinstance(kv_rank, bool) or not isinstance(kv_rank, int) or not 1 <= kv_rank <= top:
        why = f"min(2 * kv heads * head dim, d_model) = min({2 * Hkv * D}, {d})"
        if R:
            why = f"min(kv heads * (2 * head dim - rope_dims), d_model) = min({Hkv * (2 * D - R)}, {d})"
        raise ValueError(
            f"kv_rank must be an int in [1, {top}] ({why}, where the factorisation is exact), got {kv_rank!r}"
        )
    w, b = attn.qkv_proj.weight.double(), attn.qkv_proj.bias
    bd = None if b is None else b.double()
    # Each head's features reordered [nope | rope] (rope: the kept pairs' first then second features).
    order = torch.arange(D).expand(Hkv, D)  # (Hkv, D): no rotary, all nope
    rot = attn.rotary
    if pairs is not None:
        assert isinstance(rot, RotaryEmbedding)  # select_rope_pairs checked it
        first, second = _pair_features(rot, D)
        rope = torch.cat([first[pairs], second[pairs]], dim=1)  # (Hkv, R)
        keep = torch.ones(Hkv, D, dtype=torch.bool)
        keep.scatter_(1, rope, False)
        nope = torch.arange(D).expand(Hkv, D)[keep].reshape(Hkv, D - R)  # (Hkv, D - R), ascending
        order = torch.cat([nope, rope], dim=1)  # (Hkv, D)
    G, Dn = Hq // Hkv, D - R
    q_rows = (torch.arange(Hq)[:, None] * D + order.repeat_interleave(G, 0)).flatten()  # (Hq D,)
    k_rows = (Hq * D + torch.arange(Hkv)[:, None] * D + order).flatten()  # (Hkv D,)
    k_nope_rows = k_rows.reshape(Hkv, D)[:, :Dn].flatten()  # (Hkv Dn,)
    k_rope_rows = k_rows.reshape(Hkv, D)[:, Dn:].flatten()  # (Hkv R,)
    w_q, w_kn, w_kr = w[q_rows], w[k_nope_rows], w[k_rope_rows]  # (Hq D, d), (Hkv Dn, d), (Hkv R, d)
    w_v = w[(Hq + Hkv) * D :]  # (Hkv D, d)
    xd = None if x is None else x.double()
    nk = (w_kn if xd is None else xd @ w_kn.T).norm()
    nv = (w_v if xd is None else xd @ w_v.T).norm()
    a = math.sqrt(float(nv / nk)) if nk > 0 and nv > 0 else 1.0  # nope keys x a, values x 1/a: equal norms
    up, down = _factor(torch.cat([w_kn * a, w_v / a]), kv_rank, xd)  # (Hkv (Dn + D), r), (r, d)
    uk = up[: Hkv * Dn].reshape(Hkv, Dn, kv_rank).repeat_interleave(G, dim=0)  # (Hq, Dn, r)
    uv = up[Hkv * Dn :].reshape(Hkv, D, kv_rank).repeat_interleave(G, dim=0)  # (Hq, D, r)
    q_scale = torch.ones(Hq, D, dtype=torch.float64)
    q_scale[:, :Dn] = 1 / a  # the nope queries carry 1 / a; the rope part is untouched
    wo = attn.o_proj.weight.double()  # (d, Hq D)
    has_bias = b is not None or attn.o_proj.bias is not None
    ref = attn.qkv_proj.weight
    rotary = (
        PartialRotary(pairs, D, rot.base) if pairs is not None and isinstance(rot, RotaryEmbedding) else None
    )
    new = LatentAttention(
        d, Hq, kv_rank=kv_rank, rope_dims=R, nope_dims=Dn, v_head_dim=D, rope_heads=Hkv if R else 1,
        rotary=rotary, kv_norm=False,
        scale=attn.score_scale if attn.score_scale is not None else 1.0 / math.sqrt(D),
        bias=has_bias, dropout=attn.dropout, backend=attn.backend, device=ref.device, dtype=ref.dtype,
    )  # fmt: skip
    assert new.q_proj is not None
    new.q_proj.weight.copy_(w_q * q_scale.reshape(Hq * D, 1))
    new.kv_down.weight.copy_(torch.cat([down, w_kr]))  # (r + Hkv R, d): [W_DKV | W_KR^1 .. W_KR^Hkv]
    new.kv_up.weight.copy_(torch.cat([uk, uv], dim=1).reshape(Hq * (Dn + D), kv_rank))  # head by head
    new.o_proj.weight.copy_(wo * a)
    if has_bias:
        bq = torch.zeros(Hq * D, dtype=torch.float64) if bd is None else bd[q_rows]  # (Hq D,)
        bkr = torch.zeros(Hkv * R, dtype=torch.float64) if bd is None else bd[k_rope_rows]  # (Hkv R,)
        bv = torch.zeros(Hkv * D, dtype=torch.float64) if bd is None else bd[(Hq + Hkv) * D :]  # (Hkv D,)
        bo = torch.zeros(d, dtype=torch.float64) if attn.o_proj.bias is None else attn.o_proj.bias.double()
        bv_q = bv.reshape(Hkv, D).repeat_interleave(G, dim=0).reshape(Hq * D)  # (Hq D,)
        new.q_proj.bias.copy_(bq * q_scale.flatten())
        # the nope key bias only adds q . b to every score of a row (softmax ignores it); the rope key bias
        # rotates with the key's position, so it stays
        new.kv_down.bias.copy_(torch.cat([torch.zeros(kv_rank, dtype=torch.float64), bkr]))
        new.o_proj.bias.copy_(bo + wo @ bv_q)  # the value bias, through W^O
    return new.train(attn.training)


def default_rope_dims(attn: MultiHeadAttention, rope_select: str = "norm") -> int:
    """The rope_dims :func:`to_mla` keeps when given None: 0 without rotary, else a quarter of the head
    dim rounded down to an even number (at least 2); for ``rope_select="disjoint"`` at most D / Hkv (the
    kv heads share the D / 2 pairs)."""
    if attn.rotary is None:
        return 0
    quarter = attn.head_dim // 4
    if rope_select == "disjoint":
        quarter = min(quarter, attn.head_dim // attn.n_kv_heads)
    return max(2, quarter // 2 * 2)


#: Docstrings that calibrate a sentence encoder by default: on MiniLM, calibrating MLA r=128 on 256
#: instead of 64 raised the lowest human-judged score from 94.6% to 97.3% of the original before any
#: recovery (BENCHMARKS.md, "Head surgery that keeps quality").
ENCODER_CALIBRATION_DOCS = 256


def default_calibration(model: nn.Module) -> list[str] | None:
    """What ``to_mla(..., calibration="auto")`` calibrates on: for a SentenceEncoder the first
    :data:`ENCODER_CALIBRATION_DOCS` standard-library docstrings (at most 600 characters each); None for
    a model that carries no tokenizer (Bert, TransformerLM: pass token ids of your own text)."""
    if isinstance(model, SentenceEncoder):
        return stdlib_docstrings(ENCODER_CALIBRATION_DOCS, max_chars=600)
    return None


def to_mla(
    model: nn.Module,
    kv_rank: int,
    rope_dims: int | None = None,
    calibration: Any = "auto",
    *,
    rope_select: str = "norm",
) -> nn.Module:
    """A copy of ``model`` whose every self-attention is multi-head latent attention with a latent of
    width ``kv_rank`` (joint low-rank factorisation of the keys and values; see the module docstring).

    The KV cache per token and layer shrinks from 2 Hkv D numbers to ``kv_rank`` (absolute positions) or
    ``kv_rank + Hkv * rope_dims`` (rotary: the kept rotary keys of every kv head;
    :func:`~multihead.heads.kv_cache_bytes_per_token` counts it). At ``kv_rank`` = :func:`max_kv_rank`
    the copy computes the same function as the model (up to rounding) - for a rotary model when
    ``rope_dims`` is the whole head dim; fewer rotary dims remove the rotation from the others (MHA2MLA's
    partial RoPE), a change ``mh.heads.recover`` trains the copy to absorb.

    Args:
        model: a multihead model whose layers are plain MultiHeadAttention without sinks: MiniLM, Bert,
            GPT-2 (absolute positions), or a rotary TransformerLM (LLaMA / Mistral / Qwen2 from_hf, MHA
            or GQA). It is not changed.
        kv_rank: r, the latent width, 1 <= r <= :func:`max_kv_rank` in every layer: min(2 Hkv D, d), or
            with rotary min(Hkv (2D - rope_dims), d).
        rope_dims: rotary models: R, the rotary dims each head keeps (even, 2 <= R <= D; R / 2 frequency
            pairs); None: D / 4 rounded down to even (at least 2; with "disjoint" at most D / Hkv).
            Absolute positions: None or 0.
        calibration: inputs - texts for a SentenceEncoder, token ids ((n, N) int tensor or id lists)
            for any model - for the activation-aware factorisation and the "norm" pair scores; "auto"
            (default): :func:`default_calibration` (256 docstrings for a SentenceEncoder, the weights
            alone for a model without a tokenizer); None: factorise the weights.
        rope_select: which pairs each kv head keeps: "norm" (largest 2-norm contribution, on the
            calibration inputs when given), "high" / "low" (highest / lowest frequencies), "uniform"
            (evenly spaced), "disjoint" ("norm" with no pair kept by two kv heads: the choice that
            ``mh.pretrained.to_hf`` writes as a DeepSeek-V3 checkpoint); see the module docstring.

    Returns:
        the converted copy, in the model's training mode.

    Raises:
        ValueError: a layer that is not a plain MultiHeadAttention, a sink layer, a rotary other than a
            RotaryEmbedding over the whole head dim, a rope_dims other than None/0 without rotary or odd /
            out of [2, D] with rotary, an unknown rope_select, a kv_rank out of range, calibration inputs
            the model cannot take.
    """
    if rope_select not in ROPE_SELECT:
        raise ValueError(f"rope_select must be one of {list(ROPE_SELECT)}, got {rope_select!r}")
    layers = layers_of(model)
    attns = [plain_attention(layer, i, "to_mla") for i, layer in enumerate(layers)]
    dims = []
    for attn in attns:
        if attn.rotary is not None and not (
            isinstance(attn.rotary, RotaryEmbedding) and attn.rotary.head_dim == attn.head_dim
        ):
            raise ValueError(
                f"to_mla converts rotary attention with a RotaryEmbedding over the whole head dim "
                f"{attn.head_dim}; this layer has {attn.rotary!r}"
            )
        R = default_rope_dims(attn, rope_select) if rope_dims is None else rope_dims
        dims.append(R)
        if attn.sinks is not None or (attn.rotary is None and R != 0):
            latent_from_attention(attn, kv_rank, rope_dims=R)  # raises the reason
        if attn.rotary is not None:
            _check_rope_dims(R, attn.head_dim)
            if rope_select == "disjoint":
                select_rope_pairs(attn, R, "disjoint")  # raises when Hkv R > D, before any work
        top = max_kv_rank(attn, R)
        if isinstance(kv_rank, bool) or not isinstance(kv_rank, int) or not 1 <= kv_rank <= top:
            latent_from_attention(attn, kv_rank, rope_dims=R)  # raises the reason
    if isinstance(calibration, str) and calibration == "auto":
        calibration = default_calibration(model)
    xs: list[Tensor | None] = [None] * len(layers)
    if calibration is not None:
        xs = list(calibration_inputs(model, calibration, what="to_mla(calibration=...)"))
    out = copy.deepcopy(model)
    for layer, x, R in zip(layers_of(out), xs, dims):
        layer.self_attn = latent_from_attention(
            layer.self_attn, kv_rank, x, rope_dims=R, rope_select=rope_select
        )
    return out
