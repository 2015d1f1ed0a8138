"""The blocked layout of int8 weight rows that the AVX512-VNNI int8 GEMV (``gemv_q8.c``) reads fastest.

Every whole 512 columns of a row (16 blocks of 32) are stored with their blocks interleaved four bytes at a
time: stored byte ``64 v + 4 l + t`` is column ``32 l + 4 v + t`` (v 0-7, l 0-15, t 0-3). Lane l of each
64-byte vector then belongs to block l, so a dot-product instruction keeps a block's whole sum in one
int32 lane and the block's scale is applied once per 512 columns instead of once per 64. The columns past
the last whole 512 stay in order. Scales stay in column order.

Shape legend: I columns, ... leading dims.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["CHUNK", "from_blocked", "to_blocked"]

CHUNK = 512  # columns of one blocked chunk: 16 blocks of 32


def _swap_within_chunks(w: Tensor, outer: int, inner: int) -> Tensor:
    """Each whole 512 columns of the rows (..., I) viewed as (outer, inner, 4) and stored as (inner, outer,
    4); the columns past the last whole 512 as they are."""
    full = w.shape[-1] // CHUNK * CHUNK
    if full == 0:
        return w.contiguous()
    lead = w.shape[:-1]
    head = w[..., :full].reshape(*lead, full // CHUNK, outer, inner, 4)  # (..., chunks, outer, inner, 4)
    head = head.transpose(-2, -3).reshape(*lead, full)  # (..., chunks x (inner, outer, 4))
    return torch.cat([head, w[..., full:]], -1).contiguous()  # (..., I)


def to_blocked(w: Tensor) -> Tensor:
    """int8 rows (..., I) in the blocked layout that the AVX512-VNNI kernel reads fastest: every whole 512
    columns (16 blocks of 32) with their blocks interleaved four bytes at a time (stored byte
    ``64 v + 4 l + t`` is column ``32 l + 4 v + t``: lane l of each 64-byte vector then belongs to block
    l, and a block's sum stays in one int32 lane), the columns past the last whole 512 as they are. A
    permutation of each row's columns: :func:`from_blocked` undoes it."""
    return _swap_within_chunks(w, 16, 8)  # (block l, quad v) -> (quad v, block l)


def from_blocked(w: Tensor) -> Tensor:
    """The rows (..., I) of :func:`to_blocked` back in column order."""
    return _swap_within_chunks(w, 8, 16)  # (quad v, block l) -> (block l, quad v)
