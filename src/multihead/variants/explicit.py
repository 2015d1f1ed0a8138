"""Attention with the full score tensor in hand, for designs that mix heads' scores (talking heads, DCMHA).

Mixing across heads at each (query, key) needs every head's score at once, which no fused kernel exposes,
so these designs compute eq. (2) explicitly::

    S = Q K^T * scale                      (B, Hq, Nq, Nk), GQA grouped without repeating K
    S = compose_logits(S) + bias           head mixing before the softmax, then the score bias
    W = softmax(mask(S))                   masked entries -> -inf; an all-masked row gives zeros
    W = mask(compose_weights(W))           head mixing after the softmax; masked entries back to 0
    O = W V                                (B, Hq, Nq, Dv)

The bias is added after the pre-softmax mixing so that positional biases (ALiBi) stay per head, and the
mask is applied again after the post-softmax mixing because a head-dependent mask would otherwise let one
head's weight leak into a position another head may not see. Scores and weights are kept in float32
(float64 for float64 inputs), as the design contract requires for reduced precision.

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Nq queries, Nk keys, D, Dv head dims.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backends.dense import modify_scores, safe_softmax
from ..core.biases import Bias
from ..core.masks import Mask
from ..core.problem import make_problem

__all__ = ["explicit_attention", "grouped_pv", "grouped_scores"]

Compose = Callable[[Tensor], Tensor]


def grouped_scores(q: Tensor, k: Tensor) -> Tensor:
    """q (B, Hq, Nq, D) . k (B, Hkv, Nk, D) -> (B, Hq, Nq, Nk); query head i reads kv head i // G."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, Hq // Hkv, Nq, D)  # (B, Hkv, G, Nq, D)
    s = qg @ k.unsqueeze(2).transpose(-1, -2)  # (B, Hkv, G, Nq, Nk)
    return s.reshape(B, Hq, Nq, Nk)  # (B, Hq, Nq, Nk)


def grouped_pv(w: Tensor, v: Tensor) -> Tensor:
    """w (B, Hq, Nq, Nk) @ v (B, Hkv, Nk, Dv) -> (B, Hq, Nq, Dv) with the same grouping."""
    B, Hq, Nq, Nk = w.shape
    Hkv = v.shape[1]
    wg = w.reshape(B, Hkv, Hq // Hkv, Nq, Nk)  # (B, Hkv, G, Nq, Nk)
    return (wg @ v.unsqueeze(2)).reshape(B, Hq, Nq, v.shape[-1])  # (B, Hq, Nq, Dv)


def explicit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None,
    bias: Bias | Tensor | None,
    compose_logits: Compose,
    compose_weights: Compose,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> Tensor:
    """Attention whose scores are mixed across heads before and after the softmax (see module doc).

    Args:
        q, k, v: (B, Hq, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, Dv) as in :func:`multihead.attention`.
        mask, bias: as in :func:`multihead.attention` (True = may attend; bias added to the scores).
        compose_logits: (B, Hq, Nq, Nk) -> (B, Hq, Nq, Nk), applied to the scaled scores.
        compose_weights: the same, applied to the softmax weights.
        dropout_p: dropout on the final weights (pass 0 in eval mode).
        scale: score scale, default 1/sqrt(D).

    Returns:
        (B, Hq, Nq, Dv) in q's dtype.

    Raises:
        ValueError: what :func:`multihead.attention` raises for shapes, masks and biases.
    """
    p = make_problem(q, k, v, mask=mask, bias=bias, scale=scale, dropout_p=dropout_p)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = grouped_scores(q.to(work), k.to(work)) * p.scale  # (B, Hq, Nq, Nk)
    s = compose_logits(s)  # (B, Hq, Nq, Nk)
    allowed = (
        None if p.mask is None else p.mask.block(p.ctx, (0, p.Nq), (0, p.Nk), s.device)
    )  # (B|1, Hq|1, Nq, Nk)
    s = modify_scores(s, p, allowed=allowed)  # bias, then mask: (B, Hq, Nq, Nk)
    w, _ = safe_softmax(s)  # (B, Hq, Nq, Nk)
    w = compose_weights(w)  # (B, Hq, Nq, Nk)
    if allowed is not None:
        w = w.masked_fill(~allowed, 0.0)
    if p.dropout_p > 0.0:
        w = F.dropout(w, p=p.dropout_p)
    return grouped_pv(w, v.to(work)).to(q.dtype)  # (B, Hq, Nq, Dv)
