"""Smallest and largest value of each position range of a row of ids: what a document mask's tiles are
classified by (a tile whose query and key ranges hold one id is full, one whose id ranges never meet is
empty).

Shape legend: Bi batch rows of ids (1 or B), N positions, T ranges.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["range_min_max", "regular_min_max"]


def range_min_max(ids: Tensor, lo: list[int], hi: list[int]) -> tuple[Tensor, Tensor]:
    """Min and max of ``ids`` (Bi, N) over each position range ``lo[t]:hi[t]``; empty ranges give
    (max + 1, min - 1) so they match nothing."""
    # an id above every id and one below every id (ids may be negative: -big is not below them all)
    big, small = (int(ids.max()) + 1, int(ids.min()) - 1) if ids.numel() else (1, -1)
    regular = regular_min_max(ids, lo, hi, big, small)
    if regular is not None:
        return regular
    if len(lo) <= 4:  # a few ranges: slicing beats the vectorised gather below
        above, below = ids.new_full((ids.shape[0],), big), ids.new_full((ids.shape[0],), small)
        lows = [ids[:, a:b].amin(1) if b > a else above for a, b in zip(lo, hi, strict=True)]
        highs = [ids[:, a:b].amax(1) if b > a else below for a, b in zip(lo, hi, strict=True)]
        return torch.stack(lows, 1), torch.stack(highs, 1)  # (Bi, ntiles) each
    lo_t, hi_t = torch.tensor(lo, dtype=torch.long), torch.tensor(hi, dtype=torch.long)
    n = (hi_t - lo_t).clamp(min=0)  # (T,) positions per range
    seg = torch.repeat_interleave(torch.arange(len(lo)), n)  # (P,) the range of each position
    pos = lo_t[seg] + torch.arange(seg.numel()) - torch.repeat_interleave(n.cumsum(0) - n, n)  # (P,)
    vals = ids[:, pos]  # (Bi, P)
    seg2 = seg.expand(ids.shape[0], -1)  # (Bi, P)
    mins = ids.new_full((ids.shape[0], len(lo)), big).scatter_reduce(1, seg2, vals, "amin")
    maxs = ids.new_full((ids.shape[0], len(lo)), small).scatter_reduce(1, seg2, vals, "amax")
    return mins, maxs  # (Bi, ntiles) each


def regular_min_max(
    ids: Tensor, lo: list[int], hi: list[int], big: int, small: int
) -> tuple[Tensor, Tensor] | None:
    """:func:`range_min_max` for what tile edges give: the non-empty ranges consecutive and adjacent, all
    of one length ``s`` but the first and last (shorter or equal). The run is padded to whole ``s`` and
    reduced as a (Bi, n, s) view: a few ops, where the general gather takes ~30 (a new document layout's
    plan is host work on every call). None when the ranges are not of that form."""
    used = [t for t, (a, b) in enumerate(zip(lo, hi, strict=True)) if b > a]
    if len(used) < 2 or used[-1] - used[0] + 1 != len(used):
        return None
    t0, t1 = used[0], used[-1]
    s = hi[t0 + 1] - lo[t0 + 1] if len(used) > 2 else max(hi[t0] - lo[t0], hi[t1] - lo[t1])
    if any(hi[t] != lo[t + 1] for t in range(t0, t1)) or any(hi[t] - lo[t] != s for t in range(t0 + 1, t1)):
        return None
    if hi[t0] - lo[t0] > s or hi[t1] - lo[t1] > s:
        return None
    Bi, n = ids.shape[0], len(used)
    left = s - (hi[t0] - lo[t0])  # pad so that the first range ends on a multiple of s
    right = n * s - left - (hi[t1] - lo[t0])
    run = ids[:, lo[t0] : hi[t1]]  # (Bi, L)
    mins = torch.nn.functional.pad(run, (left, right), value=big).view(Bi, n, s).amin(2)  # (Bi, n)
    maxs = torch.nn.functional.pad(run, (left, right), value=small).view(Bi, n, s).amax(2)  # (Bi, n)
    if n == len(lo):
        return mins, maxs
    out_min, out_max = ids.new_full((Bi, len(lo)), big), ids.new_full((Bi, len(lo)), small)  # (Bi, T) each
    out_min[:, t0 : t1 + 1], out_max[:, t0 : t1 + 1] = mins, maxs
    return out_min, out_max
