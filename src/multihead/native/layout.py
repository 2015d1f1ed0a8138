"""The blocked layout of int8 weight rows that the AVX512-VNNI int8 GEMV (``gemv_q8.c``) reads fastest.

Every whole 512 columns of a row (16 blocks of 32) are stored with their blocks interleaved four bytes at a
time: stored byte ``64 v + 4 l + t`` is column ``32 l + 4 v + t`` (v 0-7, l 0-15, t 0-3). Lane l of each
64-byte vector then belongs to block l, so a dot-product instruction keeps a block's whole sum in one
int32 lane and the block's scale is applied once per 512 columns instead of once per 64. The columns past
the last whole 512 stay in order. Scales stay in column order.

The packed layout (groups of 32 only) keeps each blocked row's scales inside it: every whole 512 columns
(512 bytes) followed by their 16 fp32 scales (a chunk of :data:`PACKED_CHUNK` = 576 bytes), then the
tail (the columns past the last whole 512, in order, padded to 64 bytes) followed by its scales (padded
to 64 bytes). A product then reads one stream a row instead of a stream of weights and one of scales
(:func:`to_packed`, :func:`from_packed`; ``q8_rows.c`` describes the same bytes).

Shape legend: O rows, I columns, Gr = ceil(I / 32) groups, R = :func:`packed_row_bytes` (I), ... leading
dims.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "CHUNK",
    "PACKED_CHUNK",
    "from_blocked",
    "from_packed",
    "packed_row_bytes",
    "to_blocked",
    "to_packed",
]

CHUNK = 512  # columns of one blocked chunk: 16 blocks of 32
PACKED_CHUNK = CHUNK + 16 * 4  # a packed chunk's bytes: its 512 weights, then their 16 fp32 scales
GROUP = 32  # the packed layout's group size


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


def _up64(n: int) -> int:
    return -(-n // 64) * 64


def packed_row_bytes(cols: int) -> int:
    """Bytes of one packed row of ``cols`` weights (``q8_rows.c``'s ``mh_q8_row_bytes``): its whole 512s
    with their scales, then the tail and its scales, each padded to 64 bytes."""
    tail = cols % CHUNK
    return cols // CHUNK * PACKED_CHUNK + (_up64(tail) + _up64(4 * -(-tail // GROUP)) if tail else 0)


def to_packed(w: Tensor, scale: Tensor) -> Tensor:
    """Blocked int8 rows w (O, I) (:func:`to_blocked`) and their fp32 scales per group of 32, scale
    (O, Gr), as packed rows (O, R) int8 (see the module doc; padding zeros). :func:`from_packed` undoes it.

    Raises:
        ValueError: shapes or dtypes other than int8 (O, I) and fp32 (O, ceil(I / 32)).
    """
    O, I = w.shape if w.dim() == 2 else (-1, -1)
    if O < 0 or w.dtype != torch.int8 or scale.dtype != torch.float32 or scale.shape != (O, -(-I // GROUP)):
        raise ValueError(
            f"to_packed needs int8 rows (O, I) and fp32 scales (O, ceil(I / 32)), got {w.dtype} "
            f"{tuple(w.shape)} and {scale.dtype} {tuple(scale.shape)}"
        )
    nj, tail = I // CHUNK, I % CHUNK
    rows = torch.zeros(O, packed_row_bytes(I), dtype=torch.int8, device=w.device)  # (O, R)
    if nj:
        chunks = rows[:, : nj * PACKED_CHUNK].view(O, nj, PACKED_CHUNK)  # (O, nj, 576)
        chunks[:, :, :CHUNK] = w[:, : nj * CHUNK].reshape(O, nj, CHUNK)
        chunks[:, :, CHUNK:] = (
            scale[:, : nj * 16].reshape(O, nj, 16).contiguous().view(torch.int8).view(O, nj, 64)
        )
    if tail:
        at, groups = nj * PACKED_CHUNK, -(-tail // GROUP)
        rows[:, at : at + tail] = w[:, nj * CHUNK :]
        s0 = at + _up64(tail)
        rows[:, s0 : s0 + 4 * groups] = scale[:, nj * 16 :].contiguous().view(torch.int8)  # (O, 4 x groups)
    return rows


def from_packed(rows: Tensor, cols: int) -> tuple[Tensor, Tensor]:
    """Packed rows (O, R) of ``cols`` weights back as the blocked rows (O, I) and their scales (O, Gr)
    (copies).

    Raises:
        ValueError: rows that are not int8 (O, packed_row_bytes(cols)).
    """
    if rows.dim() != 2 or rows.dtype != torch.int8 or rows.shape[1] != packed_row_bytes(cols):
        raise ValueError(
            f"from_packed needs int8 rows (O, {packed_row_bytes(cols)}) for {cols} columns, got {rows.dtype} "
            f"{tuple(rows.shape)}"
        )
    O, nj, tail = rows.shape[0], cols // CHUNK, cols % CHUNK
    chunks = rows[:, : nj * PACKED_CHUNK].reshape(O, nj, PACKED_CHUNK)  # (O, nj, 576)
    parts_w, parts_s = (
        [chunks[:, :, :CHUNK].reshape(O, nj * CHUNK)],
        [chunks[:, :, CHUNK:].contiguous().view(torch.float32).reshape(O, nj * 16)],
    )
    if tail:
        at, groups = nj * PACKED_CHUNK, -(-tail // GROUP)
        s0 = at + _up64(tail)
        parts_w.append(rows[:, at : at + tail])
        parts_s.append(rows[:, s0 : s0 + 4 * groups].contiguous().view(torch.float32))  # (O, groups)
    return torch.cat(parts_w, 1).contiguous(), torch.cat(parts_s, 1).contiguous()  # (O, I), (O, Gr)
