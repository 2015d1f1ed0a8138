"""The tile grid of a mask: every (query block x key block) tile is EMPTY, FULL or PARTIAL.

Key edges are shifted by ``(Nk - Nq) mod bk`` so that, with bottom-right alignment, a square query block
sits exactly on a key block (the diagonal of a causal mask is then whole tiles). Kinds come from the
mask's analytic :meth:`~multihead.core.masks.Mask.block_kinds` when it has one, else from evaluating the
mask one block row at a time. :meth:`multihead.core.problem.Problem.grid` keeps the result, so a call is
classified once whoever asks (``auto``'s checks, ``explain``, the tiled and decode kernels).

Shape legend: Nq queries, Nk keys, bq / bk block sizes, nqb / nkb blocks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from .masks import EMPTY, FULL, PARTIAL, Mask, MaskContext

__all__ = ["Grid", "classify", "edges", "evaluate_kinds", "nonempty_fraction"]


@dataclass
class Grid:
    """Tile edges and kinds: ``kinds[i, j]`` for rows ``q_edges[i]:q_edges[i+1]``, keys ``k_edges[j]:...``."""

    q_edges: list[int]
    k_edges: list[int]
    kinds: Tensor  # (nqb, nkb) int8

    def counts(self) -> dict[str, int]:
        names = (("empty", EMPTY), ("partial", PARTIAL), ("full", FULL))
        return {name: int((self.kinds == code).sum()) for name, code in names}


def edges(n: int, block: int, shift: int = 0) -> list[int]:
    """Block edges ``[0, s, s + block, ..., n]`` with the first block of ``shift`` (0 = none) positions."""
    inner = range(shift if shift > 0 else block, n, block)
    return [0, *inner, n]


def classify(mask: Mask | None, ctx: MaskContext, bq: int, bk: int, *, evaluate: bool = True) -> Grid | None:
    """The tile grid and the kind of every tile (see the module docstring).

    Returns None only when ``evaluate`` is False and the mask has no analytic classification (finding
    the kinds would mean evaluating it).
    """
    q_edges = edges(ctx.Nq, bq)
    k_edges = edges(ctx.Nk, bk, ctx.offset % bk)
    nqb, nkb = len(q_edges) - 1, len(k_edges) - 1
    if mask is None:
        return Grid(q_edges, k_edges, torch.full((nqb, nkb), FULL, dtype=torch.int8))
    qe, ke = torch.tensor(q_edges), torch.tensor(k_edges)
    kinds = mask.block_kinds(ctx, qe[:-1, None], qe[1:, None], ke[None, :-1], ke[None, 1:])
    if kinds is None:
        if not evaluate:
            return None
        kinds = evaluate_kinds(mask, ctx, q_edges, ke)
    return Grid(q_edges, k_edges, kinds.expand(nqb, nkb).contiguous())


def nonempty_fraction(grid: Grid) -> float:
    """Fraction of the (Nq x Nk) area in tiles the mask does not empty (1.0 for an empty area)."""
    qe, ke = torch.tensor(grid.q_edges), torch.tensor(grid.k_edges)
    total = grid.q_edges[-1] * grid.k_edges[-1]
    if total == 0:
        return 1.0
    area = (qe[1:] - qe[:-1])[:, None] * (ke[1:] - ke[:-1])[None, :]  # (nqb, nkb)
    return float((area * (grid.kinds != EMPTY)).sum()) / total


def evaluate_kinds(mask: Mask, ctx: MaskContext, q_edges: list[int], ke: Tensor) -> Tensor:
    """Kinds by evaluating the mask one block row at a time (masks with no analytic form)."""
    rows = []
    zero = torch.zeros(1, dtype=torch.long)
    for q0, q1 in itertools.pairwise(q_edges):
        allowed = mask.block(ctx, (q0, q1), (0, ctx.Nk)).cpu()  # (B|1, H|1, nq|1, Nk|1)
        allowed = allowed.expand(*allowed.shape[:2], q1 - q0, ctx.Nk)  # (B|1, H|1, nq, Nk)
        flat = allowed.reshape(-1, ctx.Nk)  # (B'*H'*nq, Nk)
        n_any = torch.cat([zero, flat.any(0).long().cumsum(0)])  # (Nk + 1,)
        n_all = torch.cat([zero, flat.all(0).long().cumsum(0)])  # (Nk + 1,)
        any_t = n_any[ke[1:]] - n_any[ke[:-1]] > 0  # (nkb,)
        all_t = n_all[ke[1:]] - n_all[ke[:-1]] == ke[1:] - ke[:-1]  # (nkb,)
        rows.append(torch.where(all_t, FULL, torch.where(any_t, PARTIAL, EMPTY)).to(torch.int8))
    return torch.stack(rows)  # (nqb, nkb)
