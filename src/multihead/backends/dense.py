"""Shared pieces of the dense (materialised N x N) paths: masked, biased scores and a safe softmax."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.problem import Problem


def modify_scores(s: Tensor, p: Problem, rows: tuple[int, int] | None = None) -> Tensor:
    """Apply the bias and the mask to scores ``s`` (B, Hq, nq, Nk) of the query rows ``rows`` = (q0, q1)
    (default all Nq rows, nq = q1 - q0) against every key; masked entries become -inf."""
    ctx = p.ctx
    q_range = (0, ctx.Nq) if rows is None else rows
    if p.bias is not None:
        s = p.bias.apply_block(s, ctx, q_range, (0, ctx.Nk))
    if p.mask is not None:
        allowed = p.mask.block(ctx, q_range, (0, ctx.Nk), s.device)  # (B|1, Hq|1, nq, Nk)
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def safe_softmax(s: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim that returns zeros (and zero gradients) for rows with no finite score.

    Returns ``(weights, lse)`` with lse = -inf on empty rows.
    """
    m = s.amax(dim=-1, keepdim=True)  # (..., 1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)  # (..., 1)
    w = e / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = (torch.log(denom) + m).squeeze(-1)  # (...,); log(0) = -inf on empty rows
    return w, lse
