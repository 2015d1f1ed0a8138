"""Numerics every kernel shares: where statistics accumulate, and the exact merge of partial softmaxes.

Shape legend: B batch, H heads, N rows, Dv value width.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["acc_dtype", "merge_partials", "merge_partials_"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where scores, softmax statistics and partial outputs accumulate: float64 for float64 inputs, float32
    for everything else (bf16/fp16 accumulate in fp32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _safe(lse: Tensor) -> Tensor:
    """``lse`` with -inf (a row no key reached) replaced by 0, so ``exp(x - safe)`` never gives NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge_partials(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two partial attentions over disjoint key sets exactly (FlashAttention's split-K rule)::

        lse = logaddexp(lse_a, lse_b),   o = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)

    Args:
        o_a, o_b: (..., N, Dv) partial outputs, each normalised over its own keys.
        lse_a, lse_b: (..., N) their log-sum-exp; -inf for a row that saw no key (its output is ignored).

    Returns:
        (o (..., N, Dv) in ``o_a``'s dtype, lse (..., N) in ``lse_a``'s dtype); rows that no key reached in
        either part stay zero with lse = -inf.
    """
    lse_b = lse_b.to(lse_a.dtype)
    new = torch.logaddexp(lse_a, lse_b)  # (..., N)
    safe = _safe(new)
    out = o_a * torch.exp(lse_a - safe).unsqueeze(-1) + o_b.to(o_a.dtype) * torch.exp(lse_b - safe).unsqueeze(
        -1
    )
    return out, new


def merge_partials_(o_acc: Tensor, lse_acc: Tensor, o: Tensor, lse: Tensor) -> None:
    """:func:`merge_partials` in place into the running ``(o_acc, lse_acc)`` (no temporary of o's size)."""
    new = torch.logaddexp(lse_acc, lse.to(lse_acc.dtype))  # (..., N)
    safe = _safe(new)
    o_acc.mul_(torch.exp(lse_acc - safe).unsqueeze(-1))  # (..., N, Dv)
    o_acc.addcmul_(o, torch.exp(lse - safe).unsqueeze(-1))
    lse_acc.copy_(new)
