"""Scores made attention-ready, written once for every kernel: score -> bias -> mask, and a safe softmax.

Shape legend: B batch, Hq query heads, Nq query rows, Nk keys; a tile covers rows q0:q1 and keys k0:k1
(nq = q1 - q0, nk = k1 - k0). Scores may also arrive broadcastable, e.g. (1, 1, nq, nk).

:func:`modify_scores` serves the dense paths (``reference``, ``matrix``: the whole (B, Hq, Nq, Nk)
matrix), the tiled loop engine and the ring backward (one tile at a time) and the fused engine (an
additive mask made from zero scores). :func:`safe_softmax` is the softmax of the dense paths.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ..core.biases import TensorBias, bias_parts
from ..core.limits import SCORE_LIMIT_ENV, SMALL_BYTES, available_bytes, format_bytes, max_score_bytes
from ..core.masks import index_grid
from ..core.problem import Problem

__all__ = ["check_dense_size", "check_score_size", "dense_size_problem", "modify_scores", "safe_softmax"]


def check_score_size(p: Problem, backend: str, dtype: torch.dtype) -> None:
    """Refuse, before allocating, a (B, Hq, Nq, Nk) score matrix of ``dtype`` larger than the documented
    limit (:func:`~multihead.core.limits.max_score_bytes`, 4 GiB unless ``MULTIHEAD_MAX_SCORE_BYTES``
    says otherwise) or than the free memory. The softmax keeps a few such matrices alive at once.

    Raises:
        ValueError: naming the backend, the shape, the bytes it needs and the ways out.
    """
    need = p.B * p.Hq * p.Nq * p.Nk * torch.empty(0, dtype=dtype).element_size()
    what = (
        f"the (B, Hq, Nq, Nk) = ({p.B}, {p.Hq}, {p.Nq}, {p.Nk}) score matrix in "
        f"{str(dtype).replace('torch.', '')}"
    )
    check_dense_size(p, backend, need, what)


def dense_size_problem(p: Problem, need: int) -> str | None:
    """Why ``need`` bytes of dense (.., Nq, Nk) tensors may not be materialised for ``p``: over the limit
    of :func:`~multihead.core.limits.max_score_bytes` or the free memory; None when they may."""
    limit = max_score_bytes()
    if need <= min(limit, SMALL_BYTES):
        return None  # small: no need to ask how much memory is free
    if need > limit:
        return f"{format_bytes(need)}, over the limit of {format_bytes(limit)} ({SCORE_LIMIT_ENV})"
    free = available_bytes(p.q.device)
    if free is not None and need > free:
        return f"{format_bytes(need)}, more than the {format_bytes(free)} free"
    return None


def check_dense_size(p: Problem, backend: str, need: int, what: str) -> None:
    """Refuse, before allocating, ``need`` bytes of (.., Nq, Nk) tensors (``what``) over the limit of
    :func:`~multihead.core.limits.max_score_bytes` or the free memory: every dense path asks here.

    Raises:
        ValueError: naming the backend, what it would materialise, the bytes and the ways out.
    """
    over = dense_size_problem(p, need)
    if over is None:
        return
    ways = (
        "drop return_weights (backend 'auto' or 'tiled' then needs O(N) memory), or ask for the weights "
        "of fewer query rows at a time"
        if p.return_weights
        else "use backend='tiled' or 'auto' (O(N) memory)"
    )
    raise ValueError(
        f"backend {backend!r} would materialise {what}: {over}; {ways}, "
        f"or, to allow it, set {SCORE_LIMIT_ENV} to a larger byte count"
    )


def modify_scores(
    s: Tensor,
    p: Problem,
    rows: tuple[int, int] | None = None,
    keys: tuple[int, int] | None = None,
    *,
    allowed: Tensor | Literal["mask"] | None = "mask",
    leaves: list[Tensor] | None = None,
) -> Tensor:
    """Apply ``p``'s bias, then its mask, to the scores ``s`` of rows ``rows`` and keys ``keys``.

    Args:
        s: scaled scores q k^T * scale, (B, Hq, nq, nk) or broadcastable to it.
        p: the problem whose bias and mask apply (at the tile's global positions).
        rows, keys: the tile's (start, stop) query rows and keys; None for all of them.
        allowed: the tile's keep-mask (B|1, Hq|1, nq, nk) when the caller already has it (it skipped
            empty tiles with it), None for a tile with nothing masked; by default (``"mask"``) it is
            evaluated from ``p.mask``.
        leaves: when a list is given, every tensor bias that requires grad enters as a fresh leaf holding
            just this tile's values, appended to ``leaves`` in order, so a tiled backward can take its
            gradient without touching the full (.., Nq, Nk) tensor.

    Returns:
        The modified scores, masked entries -inf, in ``s``'s dtype; ``s`` itself when there is nothing
        to apply (``s`` is never changed in place).
    """
    ctx = p.ctx
    rows = (0, ctx.Nq) if rows is None else rows
    keys = (0, ctx.Nk) if keys is None else keys
    if p.bias is not None:
        s = p.bias.apply_block(s, ctx, rows, keys) if leaves is None else _leaf_bias(s, p, rows, keys, leaves)
    if isinstance(allowed, str):
        allowed = None if p.mask is None else p.mask.block(ctx, rows, keys, s.device)  # (B|1, Hq|1, nq, nk)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _leaf_bias(
    s: Tensor, p: Problem, rows: tuple[int, int], keys: tuple[int, int], leaves: list[Tensor]
) -> Tensor:
    """The bias on one tile, each grad-requiring tensor bias a fresh leaf (see :func:`modify_scores`)."""
    ctx = p.ctx
    b, h, q, k = index_grid(ctx, rows, keys, s.device)
    for part in bias_parts(p.bias):
        if isinstance(part, TensorBias) and part.t.requires_grad:
            val = part.values(b, h, q, k, ctx).detach().to(s.dtype).requires_grad_(True)  # natural shape
            leaves.append(val)
            s = s + val
        else:
            s = part.apply(s, b, h, q, k, ctx)
    return s


def safe_softmax(s: Tensor, sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim that returns zeros (and zero gradients) for rows with no finite score.

    Args:
        s: (B, H, Nq, Nk) modified scores, -inf where masked.
        sinks: None, or (H,) attention-sink logits: each joins its head's row denominators as one more
            column whose weight is not returned (the rows then sum to ``1 - p_sink``).

    Returns ``(weights, lse)`` with lse = -inf on empty rows (``sink_h`` with a sink; the sink included).
    """
    m = s.amax(dim=-1, keepdim=True)  # (..., 1)
    col = None if sinks is None else sinks.to(s.dtype).view(1, -1, 1, 1)  # (1, H, 1, 1)
    if col is not None:
        m = torch.maximum(m, col)  # (B, H, Nq, 1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)  # (..., 1)
    if col is not None:
        denom = denom + torch.exp(col - m)  # (B, H, Nq, 1): the sink's column
    w = e / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = (torch.log(denom) + m).squeeze(-1)  # (...,); log(0) = -inf on empty rows
    return w, lse
