"""The mask as data for the Triton kernels: tile lists and bit masks of the partial tiles.

Shape legend: B batch, Hq query heads, Nq queries, Nk keys; tiles are BM query rows x BN keys, nqb / nkb
blocks, nnz non-empty tiles, P partial tiles; Bm / Hm are B / Hq where the mask depends on them, else 1.

The mask's tile grid (:meth:`multihead.core.problem.Problem.grid`, key edges shifted by ``(Nk - Nq) % BN``
so that a causal diagonal falls on whole tiles) becomes

* per query block the non-empty key tiles (CSR: ``row_ptr`` (nqb + 1,), ``row_cols`` (nnz,)) for the
  forward and dQ kernels, and per key block the non-empty query tiles (``col_ptr``, ``col_rows``) for the
  dK/dV kernel;
* per tile a code (``row_code`` / ``col_code``): ``>= 0`` a partial tile, the index of its bit mask;
  :data:`FULL_TILE` a full tile (no mask evaluated); :data:`EDGE_TILE` a full tile that reaches past the
  keys (only the bounds ``0 <= k < Nk`` are checked);
* ``bits`` (Bm, Hm, P, BM, W) int32: the mask on each partial tile, evaluated once in torch on index
  tensors (any predicate: padding, documents, tensors, custom functions), 0 outside the problem, packed
  one bit per score: bit ``c % WB`` of word ``c // WB`` is key ``c`` of the tile's row, ``WB = min(32,
  BN)`` keys a word and ``W = BN // WB`` words a row (a kernel reads a tile's row as one or two words,
  not as BN bytes: a (BM, BN) tensor of byte pointers spilled the forward's registers on sm_90).

Key tile ``j`` covers keys ``kbase + j * BN + [0, BN)`` with ``kbase = shift - BN`` (shift = the first key
block's size), so the first tile starts before key 0 when the edges are shifted. Everything here is a
tensor or an int, so a new mask never changes what the kernels are compiled for.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from ...core.masks import EMPTY, FULL, PARTIAL, AndMask, Causal, Mask, NotMask, PrefixLM, SlidingWindow
from ...core.problem import Problem
from ...core.tiles import Grid, edges

__all__ = ["EDGE_TILE", "FULL_TILE", "TilePlan", "clear_cache", "pack_bits", "plan_for", "unpack_bits"]

FULL_TILE = -1
EDGE_TILE = -2
# Plans kept per (mask, shape, blocks, device); a model calls with a few masks and lengths at a time.
CACHE_SIZE = 32
# Mask positions evaluated at once when a mask without analytic tile kinds is classified (64 MiB bools).
EVAL_CHUNK = 1 << 26
_CACHE: OrderedDict[tuple, TilePlan] = OrderedDict()
_LOCK = threading.Lock()  # threads share the cache: lookups, inserts and evictions under it


@dataclass
class TilePlan:
    """The tile lists and partial-tile bit masks of one (mask, shape, BM, BN), on the kernels' device."""

    bm: int
    bn: int
    kbase: int
    nqb: int
    nkb: int
    row_ptr: Tensor  # (nqb + 1,) int32
    row_cols: Tensor  # (nnz,) int32
    row_code: Tensor  # (nnz,) int32
    col_ptr: Tensor  # (nkb + 1,) int32
    col_rows: Tensor  # (nnz,) int32
    col_code: Tensor  # (nnz,) int32
    bits: Tensor  # (Bm, Hm, P, BM, W) int32, one bit per score (one zero tile when P == 0)

    def bit_strides(self) -> tuple[int, int]:
        """Batch and head strides of ``bits``, 0 where the mask does not depend on that dim."""
        Bm, Hm = self.bits.shape[:2]
        return (self.bits.stride(0) if Bm > 1 else 0, self.bits.stride(1) if Hm > 1 else 0)

    def unpacked_bits(self) -> Tensor:
        """``bits`` as (Bm, Hm, P, BM, BN) bools (what the kernels read, for tests and inspection)."""
        return unpack_bits(self.bits, self.bn)

    @property
    def n_partial(self) -> int:
        return int((self.row_code >= 0).sum())


def plan_for(p: Problem, bm: int, bn: int) -> TilePlan:
    """The plan of ``p``'s mask for (bm x bn) tiles, from a bounded cache when this mask object (with its
    tensors unchanged) was planned before at this shape and device."""
    key = _cache_key(p, bm, bn)
    with _LOCK:
        plan = _CACHE.get(key)
        if plan is not None:
            _CACHE.move_to_end(key)
            return plan
    plan = build_plan(p, bm, bn)  # outside the lock: threads planning other masks do not wait
    with _LOCK:
        _CACHE[key] = plan
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return plan


def clear_cache() -> None:
    """Forget every cached plan."""
    with _LOCK:
        _CACHE.clear()


def _cache_key(p: Problem, bm: int, bn: int) -> tuple:
    shape = (p.B, p.Hq, p.Nq, p.Nk, bm, bn, p.q.device)
    if _by_value(p.mask):  # causal(), sliding_window(w), ...: models build a new one per call
        return (repr(p.mask), *shape)
    # Otherwise the mask object itself (identity) plus the version counters of the tensors it holds: an
    # in-place change of a key-padding or document tensor makes a new key, never a stale plan.
    versions = tuple((id(t), t._version) for t in _mask_tensors(p.mask))
    return (p.mask, versions, *shape)


def _by_value(m: object) -> bool:
    """Whether ``m`` is one of the library's masks given entirely by their repr (causal, sliding window,
    prefix LM and their combinations; not tensors, nor functions whose repr is only their name)."""
    if isinstance(m, AndMask | NotMask):  # OrMask derives from AndMask
        return all(_by_value(v) for v in vars(m).values())
    return type(m) in (Causal, SlidingWindow, PrefixLM)


def _mask_tensors(m: object) -> list[Tensor]:
    if isinstance(m, Tensor):
        return [m]
    if isinstance(m, list | tuple):
        return [t for x in m for t in _mask_tensors(x)]
    if isinstance(m, Mask):
        return [t for v in vars(m).values() for t in _mask_tensors(v)]
    return []


def build_plan(p: Problem, bm: int, bn: int) -> TilePlan:
    """Classify ``p``'s tiles (kept on the problem) and build the lists and bit masks (no cache)."""
    grid = tile_grid(p, bm, bn)
    kinds = grid.kinds  # (nqb, nkb) int8
    nqb, nkb = kinds.shape
    kbase = grid.k_edges[1] - bn
    rows, cols = (kinds != EMPTY).nonzero(as_tuple=True)  # (nnz,) each, row-major
    partial = kinds[rows, cols] == PARTIAL  # (nnz,)
    code = torch.full(rows.shape, -1, dtype=torch.long)
    code[partial] = torch.arange(int(partial.sum()))
    k_lo = kbase + cols * bn  # (nnz,) first key of each tile's window
    edge = ~partial & ((k_lo < 0) | (k_lo + bn > p.Nk))
    code[edge] = EDGE_TILE
    order = (cols * nqb + rows).argsort()  # (nnz,) column-major: the transposed lists
    lists = [_ptr(rows, nqb), cols, code, _ptr(cols, nkb), rows[order], code[order]]  # the plan's six lists
    lists += [rows[partial], cols[partial]]  # (P,) each: the partial tiles, in code order
    # One copy to the device, which does not wait for the GPU (from pageable memory the copy is staged
    # before it returns): a new mask's plan adds no synchronisation of its own. Each list starts 16 bytes
    # into the block after the last (padded to 4 ints): Triton specialises a pointer on its alignment to
    # 16 bytes, which must not change with the lengths.
    sizes = [-(-t.numel() // 4) * 4 for t in lists]
    host = torch.zeros(sum(sizes), dtype=torch.int32)  # (all,)
    for part, t in zip(host.split(sizes), lists, strict=True):
        part[: t.numel()] = t
    on_dev = host.to(p.q.device, non_blocking=True).split(sizes)
    row_ptr, row_cols, row_code, col_ptr, col_rows, col_code, p_rows, p_cols = (
        d[: t.numel()] for d, t in zip(on_dev, lists, strict=True)
    )
    return TilePlan(
        bm=bm,
        bn=bn,
        kbase=kbase,
        nqb=nqb,
        nkb=nkb,
        row_ptr=row_ptr,
        row_cols=row_cols,
        row_code=row_code,
        col_ptr=col_ptr,
        col_rows=col_rows,
        col_code=col_code,
        bits=partial_bits(p, p_rows, p_cols, bm, bn, kbase),
    )


def tile_grid(p: Problem, bm: int, bn: int) -> Grid:
    """``p``'s (bm x bn) tile grid: the analytic one when the mask has it, else classified here on the
    call's device in a few vectorised evaluations (not one CPU pass per query block); kept on ``p``."""
    grid = p.analytic_grid(bm, bn)
    if grid is not None:
        return grid
    assert p.mask is not None  # no mask always has an analytic grid
    q_edges, k_edges = edges(p.Nq, bm), edges(p.Nk, bn, p.ctx.offset % bn)
    kinds = _evaluated_kinds(p, p.mask, bm, bn, k_edges[1] - bn, len(q_edges) - 1, len(k_edges) - 1)
    grid = Grid(q_edges, k_edges, kinds)
    p.grids[(bm, bn)] = grid
    return grid


def _evaluated_kinds(p: Problem, mask: Mask, bm: int, bn: int, kbase: int, nqb: int, nkb: int) -> Tensor:
    """EMPTY / PARTIAL / FULL per tile from the mask evaluated a chunk of query blocks at a time."""
    ctx, dev = p.ctx, p.q.device
    k = kbase + torch.arange(nkb * bn, device=dev)  # (nkb*BN,)
    b = torch.arange(ctx.B, device=dev).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
    h = torch.arange(ctx.H, device=dev).view(1, -1, 1, 1)  # (1, H, 1, 1)
    ki = k.clamp(0, ctx.Nk - 1).view(1, 1, 1, -1)  # (1, 1, 1, nkb*BN)
    per_chunk = max(1, EVAL_CHUNK // (ctx.B * ctx.H * bm * nkb * bn))  # query blocks per evaluation
    rows = []
    for i0 in range(0, nqb, per_chunk):
        n = min(nqb, i0 + per_chunk) - i0
        q = torch.arange(i0 * bm, (i0 + n) * bm, device=dev)  # (n*BM,)
        inside = (q < ctx.Nq)[:, None] & (k >= 0)[None, :] & (k < ctx.Nk)[None, :]  # (n*BM, nkb*BN)
        qi = q.clamp(0, ctx.Nq - 1).view(1, 1, -1, 1)  # (1, 1, n*BM, 1)
        allowed = torch.as_tensor(mask.evaluate(b, h, qi, ki, ctx), dtype=torch.bool, device=dev) & inside
        tiles = allowed.reshape(-1, n, bm, nkb, bn)  # (Bm*Hm, n, BM, nkb, BN)
        outside = ~inside.view(1, n, bm, nkb, bn)  # (1, n, BM, nkb, BN)
        any_t = tiles.any(4).any(2).any(0)  # (n, nkb)
        all_t = (tiles | outside).all(4).all(2).all(0)  # (n, nkb): every in-bounds position allowed
        rows.append(torch.where(all_t, FULL, torch.where(any_t, PARTIAL, EMPTY)))
    return torch.cat(rows).to(torch.int8).cpu()  # (nqb, nkb)


def _ptr(index: Tensor, n: int) -> Tensor:
    """CSR offsets (n + 1,) of a sorted-by-group index (nnz,)."""
    counts = torch.bincount(index, minlength=n)  # (n,)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # (n + 1,)


def word_bits(bn: int) -> int:
    """Keys packed into one int32 word of a tile row's bit mask: 32, or BN when the tile is narrower."""
    return min(32, bn)


def pack_bits(allowed: Tensor) -> Tensor:
    """(..., BN) bools -> (..., BN // WB) int32 words, bit ``c % WB`` of word ``c // WB`` = key ``c``."""
    bn = allowed.shape[-1]
    wb = word_bits(bn)
    if bn % wb:
        raise ValueError(f"pack_bits: the tile width BN={bn} must be a multiple of {wb}")
    shifts = torch.arange(wb, device=allowed.device, dtype=torch.int64)  # (WB,)
    words = allowed.reshape(*allowed.shape[:-1], bn // wb, wb).to(torch.int64) << shifts  # (..., W, WB)
    words = words.sum(-1)  # (..., W) in [0, 2^WB)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # two's complement of bit 31
    return words.to(torch.int32)


def unpack_bits(words: Tensor, bn: int) -> Tensor:
    """The inverse of :func:`pack_bits`: (..., W) int32 -> (..., BN) bools."""
    wb = word_bits(bn)
    shifts = torch.arange(wb, device=words.device, dtype=torch.int64)  # (WB,)
    bits = (words.to(torch.int64)[..., None] >> shifts) & 1  # (..., W, WB)
    return bits.reshape(*words.shape[:-1], bn).bool()  # (..., BN)


def partial_bits(p: Problem, rows: Tensor, cols: Tensor, bm: int, bn: int, kbase: int) -> Tensor:
    """The mask on the partial tiles ``(rows[t], cols[t])`` as (Bm, Hm, P, BM, W) packed int32 words
    (:func:`pack_bits`), one vectorised evaluation of the predicate; positions outside the problem are 0."""
    dev = p.q.device
    P = rows.numel()
    if P == 0 or p.mask is None:
        w = bn // word_bits(bn)
        return torch.zeros(1, 1, 1, bm, w, dtype=torch.int32, device=dev)  # (1, 1, 1, BM, W) unused
    ctx = p.ctx
    q = rows.to(dev)[:, None] * bm + torch.arange(bm, device=dev)  # (P, BM)
    k = kbase + cols.to(dev)[:, None] * bn + torch.arange(bn, device=dev)  # (P, BN)
    qi = q.reshape(1, 1, P * bm, 1)  # (1, 1, P*BM, 1)
    ki = k[:, None, :].expand(P, bm, bn).reshape(1, 1, P * bm, bn)  # (1, 1, P*BM, BN)
    b = torch.arange(ctx.B, device=dev).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
    h = torch.arange(ctx.H, device=dev).view(1, -1, 1, 1)  # (1, H, 1, 1)
    # Indices are clamped into the problem so that predicates which index their tensors stay in range;
    # the positions outside it are then cleared.
    allowed = p.mask.evaluate(b, h, qi.clamp(0, ctx.Nq - 1), ki.clamp(0, ctx.Nk - 1), ctx)
    allowed = torch.as_tensor(allowed, dtype=torch.bool, device=dev)
    inside = (qi < ctx.Nq) & (ki >= 0) & (ki < ctx.Nk)  # (1, 1, P*BM, BN)
    allowed = allowed & inside  # (Bm, Hm, P*BM, BN)
    Bm, Hm = allowed.shape[0], allowed.shape[1]
    allowed = allowed.expand(Bm, Hm, P * bm, bn).reshape(Bm, Hm, P, bm, bn)  # (Bm, Hm, P, BM, BN)
    return pack_bits(allowed).contiguous()  # (Bm, Hm, P, BM, W)
