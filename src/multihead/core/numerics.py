"""Numerics every kernel shares: where statistics accumulate, the exact merge of partial softmaxes, and
the learned attention sinks as one more term of that merge.

Shape legend: B batch, H heads, N rows, Dv value width.

Attention sinks (OpenAI 2025, gpt-oss model card; the phenomenon: Xiao et al. 2024, "Efficient Streaming
Language Models with Attention Sinks"): head h has a learned logit ``sink_h`` that joins every row's
softmax denominator as an extra column with value 0. For row scores ``s_j`` (after scale, bias, mask)::

    p_j = exp(s_j) / (exp(sink_h) + sum_j exp(s_j)),   out = sum_j p_j v_j,   lse = logaddexp(lse_s, sink_h)

A kernel that computed ``out_s`` normalised over the keys and their ``lse_s`` adds the sink exactly like
one more partial with lse ``sink_h`` and output 0 (:func:`add_sink`). In the backward the sink is a
column whose value is 0, so (with ``lse`` including the sink and ``delta = rowsum(dO * O)``) the keys'
gradients keep the FlashAttention-2 form ``dS = P * (dP - delta)`` and the sink's is
``d sink_h = -sum_{b, i} exp(sink_h - lse_{b,h,i}) * delta_{b,h,i}`` (:func:`sink_grad`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["acc_dtype", "add_sink", "add_sink_", "merge_partials", "merge_partials_", "sink_grad"]


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


def _sink_column(sinks: Tensor, lse: Tensor) -> Tensor:
    """The (H,) sinks as a (1, H, 1) column in ``lse``'s dtype, to broadcast against (B, H, N)."""
    return sinks.to(lse.dtype).view(1, -1, 1)  # (1, H, 1)


def add_sink(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Add the attention sinks to a finished softmax: one more partial with lse ``sink_h`` and output 0::

        lse' = logaddexp(lse, sink_h),   out' = out * exp(lse - lse')

    Differentiable in ``out``, ``lse`` and ``sinks`` (an adapter whose kernel returns a differentiable lse
    gets every gradient by autograd).

    Args:
        out: (B, H, N, Dv) outputs normalised over the keys; zero on rows no key reached.
        lse: (B, H, N) their log-sum-exp, -inf on rows no key reached.
        sinks: (H,) the sink logits.

    Returns:
        (out' (B, H, N, Dv) in out's dtype, lse' (B, H, N) in lse's dtype); a row no key reached keeps
        output 0 and gets lse' = sink_h.
    """
    new = torch.logaddexp(lse, _sink_column(sinks, lse))  # (B, H, N)
    return out * torch.exp(lse - _safe(new)).unsqueeze(-1).to(out.dtype), new


def add_sink_(out: Tensor, lse: Tensor, sinks: Tensor) -> None:
    """:func:`add_sink` in place into ``(out, lse)`` (no autograd; rows no key reached must be 0 already)."""
    new = torch.logaddexp(lse, _sink_column(sinks, lse))  # (B, H, N)
    out.mul_(torch.exp(lse - _safe(new)).unsqueeze(-1))  # (B, H, N, Dv)
    lse.copy_(new)


def sink_grad(sinks: Tensor, lse: Tensor, delta: Tensor) -> Tensor:
    """The sinks' gradient: ``d sink_h = -sum_{b, i} p_sink(b, h, i) * delta(b, h, i)``.

    Args:
        sinks: (H,) the sink logits.
        lse: (B, H, N) the final log-sum-exp, sink included (+-inf on rows with no key and no sink).
        delta: (B, H, N) ``rowsum(dO * O)`` of the final output.

    Returns:
        (H,) in sinks' dtype.
    """
    col = _sink_column(sinks, lse)  # (1, H, 1)
    p_sink = torch.where(torch.isfinite(lse), torch.exp(col - lse), torch.zeros_like(lse))  # (B, H, N)
    return -(p_sink * delta.to(lse.dtype)).sum(dim=(0, 2)).to(sinks.dtype)  # (H,)
