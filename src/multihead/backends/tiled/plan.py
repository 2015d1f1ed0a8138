"""The tiled kernel's plan: classify (query block x key block) tiles once, then cut the work into pieces.

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Nq queries, Nk keys, bq / bk the block
sizes, L the key length of a piece.

Step 1 - classify. The grid has query blocks of ``bq`` rows and key blocks of ``bk`` keys; key edges are
shifted by ``(Nk - Nq) mod bk`` so that, with bottom-right alignment, a square query block sits exactly on
a key block (the diagonal of a causal mask is then whole tiles). Each tile is EMPTY, FULL or PARTIAL,
from the mask's analytic :meth:`~multihead.core.masks.Mask.block_kinds` when it has one, else by
evaluating the mask one block row at a time (:mod:`multihead.core.tiles`; the problem keeps the grid, so
``auto``'s checks and the kernel classify once).

Step 2 - rows. Each run of non-empty tiles in a query block row becomes one of (rows with no allowed
key get none and return zeros; a row with several runs - global tokens plus a band - gets one per run,
and its pieces are merged like any others)
    full      one key span of FULL tiles: no per-element mask
    stair     FULL tiles then the causal diagonal tile: a full span plus a causal square
    masked    one key span from the first to the last non-empty tile, with a per-element mask

Step 3 - pieces. Consecutive rows are merged into :class:`Piece` s that one kernel call runs:
    rect      rows r0:r1 against keys k0:k1 (stationary spans, a run of stair rows, or one masked row)
    band      ``nb`` blocks of ``bq`` rows, block j against keys ``k0 + j*bq : k1 + j*bq`` with one shared
              mask: a sliding window, the diagonal of a causal mask ... as one batched call over strided
              views of K/V (no copy)
A row's pieces are merged by their log-sum-exp (see :mod:`.merge`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...core.biases import ALiBi, Bias, bias_parts
from ...core.masks import EMPTY, FULL, PARTIAL, AndMask, Causal, Mask, MaskContext
from ...core.tiles import Grid

# Merge at most this many mask elements (B * H * rows * L) into one masked rect piece.
MAX_MASK_ELEMS = 1 << 22
# Check a run of causal diagonal tiles of a non-shift-invariant mask as one square up to this side.
MAX_STAIR_CHECK = 2048
# Evaluate at most this many mask elements at once when checking that a square is causal.
CHECK_ELEMS = 1 << 16


@dataclass(frozen=True)
class Piece:
    """One kernel call: query rows ``r0 : r0 + nb * bq`` against keys ``k0 : k1`` (shifted by ``bq`` per
    block when ``nb > 1``). ``kind`` is "full" (no mask), "causal" (top-left causal over a square) or
    "masked" (mask and/or bias built for rows ``r0 : r0 + bq`` and keys ``k0 : k1``, shared by the blocks).
    """

    r0: int
    bq: int
    nb: int
    k0: int
    k1: int
    kind: str

    @property
    def r1(self) -> int:
        return self.r0 + self.nb * self.bq

    @property
    def area(self) -> int:
        """(query, key) pairs the kernel computes (a causal square counts half)."""
        n = self.nb * self.bq * (self.k1 - self.k0)
        return n // 2 if self.kind == "causal" else n


@dataclass
class _Row:
    kind: str  # empty | full | stair | masked
    r0: int
    r1: int
    k0: int = 0
    k1: int = 0
    diag: int = 0  # stair rows: first key of the causal diagonal tile


def _lanes(grid: Grid, ctx: MaskContext, diagonal_ok: bool) -> list[list[_Row]]:
    """Step 2: each query block row's runs of non-empty tiles as :class:`_Row` s, run r of every row in
    lane r (one lane for most masks; a local window plus global tokens has two: the global key column and
    the band). Rows that see no key appear in no lane (their output is zero)."""
    kinds = grid.kinds
    nqb = kinds.shape[0]
    pad = torch.zeros(nqb, 1, dtype=torch.int8)
    ne = torch.cat([pad, (kinds != EMPTY).to(torch.int8), pad], 1)  # (nqb, nkb + 2)
    step = ne[:, 1:] - ne[:, :-1]  # (nqb, nkb + 1): +1 where a run starts, -1 one past its end
    starts, ends = (step == 1).nonzero().tolist(), (step == -1).nonzero().tolist()  # row-major
    n_full = torch.cat([pad.int(), (kinds == FULL).int().cumsum(1)], 1).tolist()  # (nqb, nkb + 1)
    qe, ke = grid.q_edges, grid.k_edges
    lanes: list[list[_Row]] = []
    prev_row, lane = -1, 0
    for (i, a), (_, b) in zip(starts, ends, strict=True):  # tiles a:b of block row i, none empty
        lane = lane + 1 if i == prev_row else 0
        prev_row = i
        r0, r1, k0, k1 = qe[i], qe[i + 1], ke[a], ke[b]
        full = n_full[i][b] - n_full[i][a]
        if full == b - a:
            row = _Row("full", r0, r1, k0, k1)
        elif (
            diagonal_ok
            and full == b - a - 1
            and int(kinds[i, b - 1]) == PARTIAL
            and ke[b - 1] == r0 + ctx.offset
            and k1 == r1 + ctx.offset
        ):
            row = _Row("stair", r0, r1, k0, k1, ke[b - 1])
        else:
            row = _Row("masked", r0, r1, k0, k1)
        if lane == len(lanes):
            lanes.append([])
        lanes[lane].append(row)
    return lanes


def _is_causal_tile(mask: Mask, ctx: MaskContext, r0: int, r1: int, k0: int) -> bool:
    """Whether the square tile rows r0:r1, keys k0:k0+(r1-r0) is exactly lower-triangular for all (b, h).

    Evaluated in strips of rows (at most :data:`CHECK_ELEMS` mask elements at a time): a whole
    2048 x 2048 square at once was the largest allocation of a ring attention rank (measured: 12 MiB
    against 3 MiB for the kernel itself), more than the attention it plans.
    """
    n = r1 - r0
    cols = torch.arange(n)  # (n,)
    step = max(1, CHECK_ELEMS // n)
    for s0 in range(0, n, step):
        s1 = min(n, s0 + step)
        allowed = mask.block(ctx, (r0 + s0, r0 + s1), (k0, k0 + n)).cpu()  # (B|1, H|1, s, n)
        tri = torch.arange(s0, s1)[:, None] >= cols[None, :]  # (s, n): the strip of the lower triangle
        if not bool((allowed == tri).all()):
            return False
    return True


class _CausalCheck:
    """Whether the square tile rows ``r0:r1``, keys ``k0:k0 + (r1 - r0)`` is exactly lower-triangular.

    For ``causal() & other`` the answer comes from ``other``'s analytic tile kinds, computed once on the
    grid: a diagonal square is causal when ``other`` is FULL on all its tiles (packed documents: no
    per-tile evaluation). Otherwise the square is evaluated.
    """

    def __init__(self, mask: Mask, ctx: MaskContext, grid: Grid):
        self.mask, self.ctx = mask, ctx
        self.full: Tensor | None = None
        if isinstance(mask, AndMask) and Causal in (type(mask.a), type(mask.b)):
            other = mask.b if type(mask.a) is Causal else mask.a
            qe, ke = torch.tensor(grid.q_edges), torch.tensor(grid.k_edges)
            kinds = other.block_kinds(ctx, qe[:-1, None], qe[1:, None], ke[None, :-1], ke[None, 1:])
            if kinds is not None:
                self.full = (kinds == FULL).expand(len(qe) - 1, len(ke) - 1)  # (nqb, nkb)
                self.qi = {e: i for i, e in enumerate(grid.q_edges)}
                self.ki = {e: i for i, e in enumerate(grid.k_edges)}

    def __call__(self, r0: int, r1: int, k0: int, evaluate_up_to: int | None = None) -> bool:
        """``evaluate_up_to``: give up (False) rather than evaluate a square with a longer side."""
        k1 = k0 + r1 - r0
        if self.full is not None and k0 == r0 + self.ctx.offset:
            i0, i1, j0, j1 = (self.qi.get(r0), self.qi.get(r1), self.ki.get(k0), self.ki.get(k1))
            if None not in (i0, i1, j0, j1) and bool(self.full[i0:i1, j0:j1].all()):
                return True
        if evaluate_up_to is not None and r1 - r0 > evaluate_up_to:
            return False
        return _is_causal_tile(self.mask, self.ctx, r0, r1, k0)


def shift_invariant_bias(bias: Bias | None) -> bool:
    """Whether every tile on one diagonal gets the same bias (ALiBi, or none)."""
    parts = bias_parts(bias)
    return all(isinstance(p, ALiBi) for p in parts)


#: block sizes tried (largest first) for the diagonal bands of a causal mask with a shift-invariant bias
DIAGONAL_BLOCKS = (256, 128, 64)


def diagonal_bands(mask: Mask | None, bias: Bias | None, ctx: MaskContext) -> list[Piece] | None:
    """Causal + ALiBi as one band per diagonal of (b x b) tiles, or None when that does not apply.

    With a bias every tile needs its per-element values, so the row-by-row plan builds one mask per block
    row (N/64 pieces, each with a fresh bq x L bias). A shift-invariant bias is the same on every tile of
    a diagonal, and so is the causal mask, so diagonal d (key block = query block + offset/b - d) is one
    band piece sharing one (b x b) mask tile: about N/b kernel calls over the lower triangle only::

        d=0 (masked: causal + bias)   d=1 (bias)         d=2 (bias)
        X . . .                       . . . .            . . . .
        . X . .                       X . . .            . . . .
        . . X .                       . X . .            X . . .
        . . . X                       . . X .            . X . .

    Applies when the mask is exactly ``causal()``, the bias is shift-invariant and not None, and the
    query count and the offset ``Nk - Nq`` are multiples of a block size in :data:`DIAGONAL_BLOCKS`.
    """

    if bias is None or type(mask) is not Causal or not shift_invariant_bias(bias):
        return None
    nq, off = ctx.Nq, ctx.offset
    b = next((b for b in DIAGONAL_BLOCKS if nq % b == 0 and off % b == 0 and nq >= 2 * b), None)
    if b is None:
        return None
    nqb, lead = nq // b, off // b  # query blocks; key blocks left of the first diagonal tile
    out = []
    for d in range(nqb + lead):
        i0 = max(0, d - lead)  # first query block whose key block i + lead - d exists
        k0 = (i0 + lead - d) * b
        out.append(Piece(i0 * b, b, nqb - i0, k0, k0 + b, "masked"))
    return out


def pieces(grid: Grid, mask: Mask | None, bias: Bias | None, ctx: MaskContext, n_heads: int) -> list[Piece]:
    """Step 3: merge rows into pieces (see the module docstring)."""
    bands = diagonal_bands(mask, bias, ctx)
    if bands is not None:
        return bands
    lanes = _lanes(grid, ctx, diagonal_ok=bias is None and mask is not None)
    out: list[Piece] = []
    has_stairs = mask is not None and any(r.kind == "stair" for rows in lanes for r in rows)
    check = _CausalCheck(mask, ctx, grid) if mask is not None and has_stairs else None
    for rows in lanes:
        i = 0
        while i < len(rows):
            if rows[i].kind == "stair":
                assert check is not None
                i = _take_stair(rows, i, mask, check, out)
            else:
                i = _take_span(rows, i, mask, bias, ctx, n_heads, out)
    return bundle_causal(out)


def _take_stair(rows: list[_Row], i: int, mask, check: _CausalCheck, out: list[Piece]) -> int:
    """A run of stair rows with one start: a full rect left of the diagonal plus one causal square."""
    row = rows[i]
    j = i + 1
    while (
        j < len(rows) and rows[j].kind == "stair" and rows[j].k0 == row.k0 and rows[j].r0 == rows[j - 1].r1
    ):  # the run's shape; whether its diagonal tiles are exactly causal is checked below
        j += 1
    # every diagonal tile of a shift-invariant mask equals the first; otherwise one check of the whole
    # square (packed documents: one lookup per document) or, when that fails, tile by tile
    whole = not mask.shift_invariant and check(row.r0, rows[j - 1].r1, row.diag, MAX_STAIR_CHECK)
    if not whole:
        if not check(row.r0, row.r1, row.diag):
            rows[i] = _Row("masked", row.r0, row.r1, row.k0, row.k1)
            return i
        if not mask.shift_invariant:
            j = i + 1
            while (
                j < len(rows)
                and rows[j].kind == "stair"
                and rows[j].k0 == row.k0
                and rows[j].r0 == rows[j - 1].r1
                and check(rows[j].r0, rows[j].r1, rows[j].diag)
            ):
                j += 1
    r1 = rows[j - 1].r1
    if row.diag > row.k0:
        out.append(Piece(row.r0, r1 - row.r0, 1, row.k0, row.diag, "full"))
    out.append(Piece(row.r0, r1 - row.r0, 1, row.diag, rows[j - 1].k1, "causal"))
    return j


def bundle_causal(plan: list[Piece]) -> list[Piece]:
    """Consecutive equal causal squares on the diagonal (packed documents of one length) as one band.

    Piece ``(r0, n, 1, k0, k0 + n, causal)`` followed by ``(r0 + n, n, 1, k0 + n, k0 + 2n, causal)`` ...
    is a band of ``n``-row blocks whose keys move by ``n``: one batched kernel call instead of one per
    document (on 8 documents of 512 tokens, ~29 ms instead of ~36 ms here).
    """
    out: list[Piece] = []
    for pc in plan:
        last = out[-1] if out else None
        if (
            last is not None
            and pc.kind == last.kind == "causal"
            and pc.nb == 1
            and pc.bq == last.bq == pc.k1 - pc.k0
            and pc.r0 == last.r1
            and pc.k0 == last.k0 + last.nb * last.bq
        ):
            out[-1] = Piece(last.r0, last.bq, last.nb + 1, last.k0, last.k1, "causal")
        else:
            out.append(pc)
    return out


def _take_span(rows, i, mask, bias, ctx: MaskContext, n_heads: int, out: list[Piece]) -> int:
    """Rows with one span each: merge a run that stays put (rect) or moves by one block per row (band)."""
    row = rows[i]
    kind = "full" if row.kind == "full" and bias is None else "masked"
    bq, length = row.r1 - row.r0, row.k1 - row.k0

    def same(j: int) -> bool:  # row j continues the run: same kind and shape, the next block of rows
        r = rows[j]
        return r.kind == row.kind and r.r1 - r.r0 == bq and r.k1 - r.k0 == length and r.r0 == rows[j - 1].r1

    # stationary: same keys for every row (dense, a prefix column, padding ...)
    j = i + 1
    limit = max(1, MAX_MASK_ELEMS // max(1, ctx.B * n_heads * bq * length)) if kind == "masked" else 1 << 30
    while j < len(rows) and j - i < limit and same(j) and rows[j].k0 == row.k0:
        j += 1
    if j > i + 1 or (kind == "masked" and not _band_ok(mask if row.kind == "masked" else None, bias)):
        out.append(Piece(row.r0, rows[j - 1].r1 - row.r0, 1, row.k0, row.k1, kind))
        return j
    # band: the span moves by bq keys per block of bq rows (sliding window, diagonals ...)
    while j < len(rows) and same(j) and rows[j].k0 == rows[j - 1].k0 + bq:
        j += 1
    out.append(Piece(row.r0, bq, j - i, row.k0, row.k1, kind))
    return j


def _band_ok(mask: Mask | None, bias: Bias | None) -> bool:
    """A masked band shares one mask tile, which is exact only for shift-invariant masks and biases."""
    return (mask is None or mask.shift_invariant) and shift_invariant_bias(bias)
