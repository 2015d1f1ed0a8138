"""``matrix``: eq. (2) as one batched matmul over all heads, the path that can return the weights.

    A = softmax(mask(Q K^T / sqrt(d_k))) V                       (docs/equations.md, eq. (2))

Scores and softmax are computed in fp32 (float64 stays float64); P is cast back to the input dtype for
the P @ V matmul, as FlashAttention does. GQA is a broadcasted matmul over a (Hkv, G) split of the query
heads, so K and V are never repeated. Memory is O(B * Hq * Nq * Nk). Attention sinks join each row's
softmax denominator (:func:`~.dense.safe_softmax`); autograd differentiates them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.numerics import acc_dtype
from ..core.problem import AttentionOutput, Problem
from .dense import check_score_size, modify_scores, safe_softmax

# Refuse under `auto` when the fp32 score matrix would exceed this many bytes.
MAX_SCORE_BYTES = 1 << 30


class MatrixBackend:
    name = "matrix"
    summary = "eq. (2) as one batched matmul; materialises the (B, Hq, Nq, Nk) scores"

    def why_not(self, p: Problem) -> str | None:
        nbytes = p.B * p.Hq * p.Nq * p.Nk * 4
        if nbytes > MAX_SCORE_BYTES:
            return f"the score matrix would take {nbytes / 2**20:.0f} MiB (limit {MAX_SCORE_BYTES >> 20} MiB)"
        return None

    def run(self, p: Problem) -> AttentionOutput:
        B, Hq, Hkv, G, Nq, Nk = p.B, p.Hq, p.Hkv, p.G, p.Nq, p.Nk
        acc = acc_dtype(p.dtype)
        check_score_size(p, self.name, acc)
        q = p.q.to(acc).reshape(B, Hkv, G * Nq, p.D)  # (B, Hkv, G*Nq, D): groups folded into rows
        s = torch.matmul(q, p.k.to(acc).transpose(-1, -2))  # (B, Hkv, G*Nq, Nk)
        s = s.reshape(B, Hq, Nq, Nk) * p.scale  # (B, Hq, Nq, Nk)
        s = modify_scores(s, p)
        w, lse = safe_softmax(s, p.sinks)  # the sinks join each row's denominator
        if p.dropout_p > 0.0:
            w = F.dropout(w, p=p.dropout_p)
        wv = w.to(p.dtype).reshape(B, Hkv, G * Nq, Nk)  # (B, Hkv, G*Nq, Nk)
        out = torch.matmul(wv, p.v).reshape(B, Hq, Nq, p.Dv)  # (B, Hq, Nq, Dv)
        return AttentionOutput(
            out,
            w.to(p.dtype) if p.return_weights else None,
            lse if p.return_lse else None,
        )


BACKEND = MatrixBackend()
