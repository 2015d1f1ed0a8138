"""Keys that no query may attend, and why their contents must not reach a kernel.

A padded batch or a preallocated buffer often holds garbage (NaN, Inf, 1e30) in its pad slots. A mask
that hides a key from every query of its (batch, head) should make its contents irrelevant, but kernels
leak them: an additive ``-inf`` mask plus a NaN score is NaN (SDPA's math path, the fused tiled kernel),
and a zero weight times a NaN value is NaN in P @ V (every backend), in the output and in dq.

:func:`clear_dead_keys` zeroes those keys and values once, before any backend runs, with ``torch.where``
(so their gradients are exactly zero, as in a clean run). Which keys are dead is read from what the mask
*allows*, not from how it is written: ``key_padding(real)``, ``~key_padding(~real)`` and
``~~padding(lengths)`` hide the same keys and are cleared alike. :func:`seen_keys` finds the keys some
query may see, exactly, in bounded memory (never the (Nq, Nk) mask of a long sequence at once):

- ``a | b``: the keys either part shows; ``~~a`` is ``a``; ``~(a & b)`` is ``~a | ~b`` and ``~(a | b)``
  is ``~a & ~b`` (De Morgan);
- ``a & b`` where ``b`` does not read the query row (padding, key padding, a bool tensor of one row):
  the keys ``a`` shows that ``b`` allows;
- a mask that does not read the query row: its first row; a mask that knows its answer
  (:meth:`~multihead.core.masks.Mask.seen_keys`: causal, windows, prefix LM, bool tensors) says it;
- anything else (documents, custom predicates, ``~causal()``, ...): its 64 x 64 tile kinds, analytic
  where the mask has them. A key block with a FULL tile is seen, one of EMPTY tiles is dead, and only
  the PARTIAL tiles of the remaining key blocks are evaluated, a few rows at a time. A mask with no
  analytic tile kinds (a custom predicate) is evaluated over all rows, a bounded chunk of rows at a time:
  O(Nq x Nk) work, as the tiled kernel pays to classify it.

Masks whose hidden keys hold the caller's own finite values opt out
(:attr:`~multihead.core.masks.Mask.clear_hidden_keys`): ``TransformerLM.generate``'s left-padding mask,
whose pad slots the model itself writes, where clearing would copy the whole cache at every decode step.

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Nq queries, Nk keys; "B|1" a dim that
may be 1.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from .masks import EMPTY, FULL, PARTIAL, AndMask, Mask, MaskContext, NotMask, OrMask
from .problem import Problem
from .tiles import Grid, classify

__all__ = ["clear_dead_keys", "dead_keys", "seen_keys"]

#: Tile size of the grid the keys are read from (the tiled kernel's, so its grid is classified once).
BLOCK = 64
#: Key blocks evaluated together (their PARTIAL rows are evaluated as one span).
SPAN = 4
#: Most (b, h, q, k) elements one evaluation materialises (and never more than BLOCK rows of all keys).
BUDGET = 1 << 22

#: a mask's tile grid for this call (the Problem's own, kept for the kernel, for the whole mask)
GridOf = Callable[[Mask], "Grid | None"]


def seen_keys(
    mask: Mask, ctx: MaskContext, device: torch.device, grid_of: GridOf | None = None
) -> Tensor | None:
    """(B|1, Hq|1, Nk) bool, True where some query row of that (batch, head) may attend the key; None
    when every key is seen (the common case, answered without a tensor). ``ctx.Nq`` must be >= 1.

    ``grid_of(m)`` gives ``m``'s analytic tile grid (None: it has none); by default it is classified here.
    """
    grid_of = grid_of or (lambda m: classify(m, ctx, BLOCK, BLOCK, evaluate=False))
    if isinstance(mask, OrMask):  # OrMask derives from AndMask: test it first
        a = seen_keys(mask.a, ctx, device, grid_of)
        b = None if a is None else seen_keys(mask.b, ctx, device, grid_of)
        return None if a is None or b is None else _keys(a | b, device)
    if isinstance(mask, NotMask) and isinstance(mask.a, (NotMask, AndMask)):
        return seen_keys(_push_not(mask.a), ctx, device, grid_of)
    if not mask.reads_queries:
        return _keys(_first_row(mask, ctx, device), device)
    if isinstance(mask, AndMask):
        for x, y in ((mask.a, mask.b), (mask.b, mask.a)):
            if not y.reads_queries:  # exists q: x(q, k) & y(k)  =  y(k) & exists q: x(q, k)
                row = _first_row(y, ctx, device)
                sx = seen_keys(x, ctx, device, grid_of)
                return _keys(row if sx is None else row & sx, device)
    own = mask.seen_keys(ctx, device)
    if own is True:
        return None
    if isinstance(own, Tensor):
        return _keys(own.expand(*own.shape[:-1], ctx.Nk), device)
    grid = grid_of(mask)
    return _by_rows(mask, ctx, device) if grid is None else _by_tiles(mask, ctx, device, grid)


def _push_not(inner: Mask) -> Mask:
    """``~inner`` rewritten one level down (De Morgan): ``~~a`` -> ``a``, ``~(a & b)`` -> ``~a | ~b``,
    ``~(a | b)`` -> ``~a & ~b``."""
    if isinstance(inner, NotMask):
        return inner.a
    assert isinstance(inner, AndMask)
    na, nb = NotMask(inner.a), NotMask(inner.b)
    return AndMask(na, nb) if isinstance(inner, OrMask) else OrMask(na, nb)


def _keys(t: Tensor, device: torch.device) -> Tensor | None:
    """``t`` (B|1, H|1, Nk) on ``device``, or None when it shows every key (checked on the CPU only: on a
    GPU the question would wait for the device)."""
    if t.device.type == "cpu" and bool(t.all()):
        return None
    return t.to(device)


def _first_row(mask: Mask, ctx: MaskContext, device: torch.device) -> Tensor:
    """(B|1, H|1, Nk) the mask on query row 0 (all rows, for a mask that does not read the row)."""
    row = mask.block(ctx, (0, 1), (0, ctx.Nk), device)  # (B|1, H|1, 1, Nk|1)
    return row[:, :, 0, :].expand(*row.shape[:2], ctx.Nk)


def _any_rows(mask: Mask, ctx: MaskContext, device, rows: tuple[int, int], keys: tuple[int, int]) -> Tensor:
    """(B|1, H|1, nk): the keys ``keys`` some row of ``rows`` may attend, a bounded chunk of rows at once."""
    k0, k1 = keys
    # never more than one block row over all keys (what classifying the tiles evaluates at once)
    step = max(1, min(BUDGET, ctx.B * ctx.H * BLOCK * ctx.Nk) // max(1, ctx.B * ctx.H * (k1 - k0)))
    seen: Tensor | None = None
    for r0 in range(rows[0], rows[1], step):
        part = mask.block(ctx, (r0, min(r0 + step, rows[1])), keys, device).any(dim=-2)  # (B|1, H|1, nk|1)
        seen = part if seen is None else seen | part
    assert seen is not None  # rows is never empty
    return seen.expand(*seen.shape[:-1], k1 - k0)


def _by_rows(mask: Mask, ctx: MaskContext, device) -> Tensor | None:
    """Every row evaluated (a mask with no analytic tile kinds)."""
    return _keys(_any_rows(mask, ctx, device, (0, ctx.Nq), (0, ctx.Nk)), device)


def _by_tiles(mask: Mask, ctx: MaskContext, device, grid: Grid) -> Tensor | None:
    """Keys read from the tile kinds; only the PARTIAL tiles of key blocks with no FULL tile evaluated."""
    kinds = grid.kinds  # (nqb, nkb)
    seen_block = (kinds == FULL).any(dim=0)  # (nkb,) some tile lets every (b, h, q) see every key
    dead_block = (kinds == EMPTY).all(dim=0)  # (nkb,) no (b, h, q) sees any key
    todo = (~seen_block & ~dead_block).nonzero().flatten().tolist()
    if not todo and not bool(dead_block.any()):
        return None
    ke = grid.k_edges
    spans = []
    for _, run in itertools.groupby(enumerate(todo), key=lambda t: t[1] - t[0]):  # runs of adjacent blocks
        blocks = [j for _, j in run]
        for i in range(0, len(blocks), SPAN):
            cols = blocks[i : i + SPAN]
            rows = (kinds[:, cols] == PARTIAL).any(dim=1).nonzero().flatten()  # row blocks to evaluate
            r = (grid.q_edges[int(rows[0])], grid.q_edges[int(rows[-1]) + 1])
            k = (ke[cols[0]], ke[cols[-1] + 1])
            spans.append((k, _any_rows(mask, ctx, device, r, k)))  # (B|1, H|1, nk)
    Bs = max([1] + [t.shape[0] for _, t in spans])
    Hs = max([1] + [t.shape[1] for _, t in spans])
    seen = torch.ones(Bs, Hs, ctx.Nk, dtype=torch.bool)  # (B|1, H|1, Nk)
    for j in dead_block.nonzero().flatten().tolist():
        seen[:, :, ke[j] : ke[j + 1]] = False
    seen = seen.to(device)
    for (k0, k1), t in spans:
        seen[:, :, k0:k1] = t
    return _keys(seen, device)


def dead_keys(p: Problem) -> Tensor | None:
    """(B|1, Hq|1, Nk) bool, True where no query row of that (batch, head) may attend the key; None when
    there are none, or the mask opts out (:attr:`~multihead.core.masks.Mask.clear_hidden_keys`)."""
    if p.mask is None or p.Nq == 0 or not p.mask.clear_hidden_keys:
        return None

    def grid_of(m: Mask) -> Grid | None:  # the whole mask's grid is kept on the Problem for the kernel
        return (
            p.analytic_grid(BLOCK, BLOCK) if m is p.mask else classify(m, p.ctx, BLOCK, BLOCK, evaluate=False)
        )

    seen = seen_keys(p.mask, p.ctx, p.k.device, grid_of)
    return None if seen is None else ~seen


def clear_dead_keys(p: Problem) -> Problem:
    """``p`` with k and v zeroed at the keys no query of their (batch, kv head) may attend (see the
    module docstring); ``p`` itself when the mask hides no key from every query.

    A kv head's key is dead only when it is dead for all G query heads that read it.
    """
    dead = dead_keys(p)
    if dead is None:
        return p
    if dead.shape[1] != 1:  # per query head -> per kv head
        dead = dead.reshape(dead.shape[0], p.Hkv, p.G, p.Nk).all(dim=2)  # (B|1, Hkv, Nk)
    if p.k.device.type == "cpu" and not bool(dead.any()):
        return p  # nothing dead: no copies (on a GPU, asking would wait for the device)
    zero = torch.zeros((), dtype=p.k.dtype, device=p.k.device)
    hide = dead[..., None]  # (B|1, Hkv|1, Nk, 1)
    return replace(p, k=torch.where(hide, zero, p.k), v=torch.where(hide, zero, p.v))
