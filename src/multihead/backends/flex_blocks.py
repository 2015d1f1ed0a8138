"""Block masks for ``flex_attention``, built once per mask and shape and kept in a small cache.

flex_attention skips the (128 x 128) tiles a ``BlockMask`` lists as empty and does not evaluate the mask
inside tiles it lists as full. Building that block mask with torch's ``create_block_mask`` evaluates the
predicate on every (b, h, q, k) element - tens of milliseconds per call at N = 16K on a GPU. Here:

1. **Cached.** :data:`CACHE` keeps the last :data:`CACHE_SIZE` (32) block masks, keyed by
   :func:`multihead.core.mask_keys.mask_key`: the mask's structure (``causal``, ``sliding_window(w)``, ...)
   or, for masks holding tensors, the tensor (contents when small and on the CPU, else identity and
   version counter, so an in-place edit of document ids builds a new block mask), with ``Nq``, ``Nk`` and
   the device. An entry is a few int32 tensors of ``ceil(Nq/128) x ceil(Nk/128)`` per batch row / head it
   holds, plus the mask (and its tensors) that its ``mask_mod`` reads; a mask whose tensors pass
   :data:`MAX_HELD_BYTES` is not cached, so the cache never pins large dense masks.
2. **Broadcast.** The batch and head dims are built only when the mask reads them
   (:func:`~multihead.core.mask_keys.mask_dims`); otherwise one block mask serves every row and head.
3. **Analytic.** Masks with analytic tile kinds (:meth:`~multihead.core.masks.Mask.block_kinds`: causal,
   windows, prefix LM, documents, padding and their combinations) are classified per tile from their
   parameters, never element by element, and per batch row where they depend on it. Other masks go
   through ``create_block_mask``, compiled on CUDA (torch's recommended ``torch.compile(create_block_mask)``).

Shape legend: B batch, H query heads, Nq queries, Nk keys, nqb / nkb blocks of :data:`BLOCK`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from ..core.mask_keys import KeyedCache, mask_dims
from ..core.masks import (
    FULL,
    PARTIAL,
    AndMask,
    Causal,
    Document,
    KeyPadding,
    Mask,
    MaskContext,
    NotMask,
    OrMask,
    Padding,
    PrefixLM,
    SlidingWindow,
)
from ..core.placement import on_device

__all__ = ["BLOCK", "CACHE", "CACHE_SIZE", "MAX_HELD_BYTES", "block_mask_for", "build", "tile_kinds"]

BLOCK = 128  # flex_attention's default sparse block size
CACHE_SIZE = 32
MAX_HELD_BYTES = 64 * 2**20
CACHE: KeyedCache[Any] = KeyedCache(CACHE_SIZE)


def block_mask_for(mask: Mask, ctx: MaskContext, device: torch.device) -> Any:
    """The ``BlockMask`` of ``mask`` on problem ``ctx`` and ``device``: from :data:`CACHE`, or built."""
    if _held_bytes(mask) > MAX_HELD_BYTES:
        return build(mask, ctx, device)
    return CACHE.get(mask, ctx, device, lambda: build(mask, ctx, device))


def build(mask: Mask, ctx: MaskContext, device: torch.device) -> Any:
    """Build the ``BlockMask`` (see the module docstring for the three ways)."""
    moved = on_device(mask, device)  # compiled flex code cannot move the ids, lengths, ...

    def mask_mod(b, h, q_idx, kv_idx):
        return moved.evaluate(b, h, q_idx, kv_idx, ctx)

    kinds = tile_kinds(moved, ctx, device)
    if kinds is not None:
        return _from_kinds(kinds.to(device), mask_mod, ctx)
    by_batch, by_head = mask_dims(moved, ctx, device)  # a custom predicate is evaluated where it runs
    B, H = (ctx.B if by_batch else None), (ctx.H if by_head else None)
    create = _compiled_create() if device.type == "cuda" else _create()
    return create(mask_mod, B, H, ctx.Nq, ctx.Nk, device=device, BLOCK_SIZE=BLOCK)


def tile_kinds(mask: Mask, ctx: MaskContext, device: torch.device | None = None) -> Tensor | None:
    """Analytic kinds of the (BLOCK x BLOCK) tiles, int8 of shape (B or 1, 1, nqb, nkb), or None.

    Batch-dependent masks are classified one batch row at a time (a tile that one row needs stays
    non-empty only for that row). A tile cut by the end of the queries or keys is never FULL: like
    ``create_block_mask``, flex evaluates the mask there. ``device``: where the mask's tensors live.
    """
    by_batch, by_head = mask_dims(mask, ctx, device)
    if by_head:
        return None
    rows = [_row(mask, b) for b in range(ctx.B)] if by_batch else [mask]
    if any(r is None for r in rows):
        return None
    qe = torch.arange(0, ctx.Nq, BLOCK)  # (nqb,) first row of each query tile
    ke = torch.arange(0, ctx.Nk, BLOCK)  # (nkb,) first key of each key tile
    ql, qh = qe[:, None], (qe + BLOCK).clamp(max=ctx.Nq)[:, None]  # (nqb, 1)
    kl, kh = ke[None, :], (ke + BLOCK).clamp(max=ctx.Nk)[None, :]  # (1, nkb)
    one = MaskContext(1, ctx.H, ctx.Nq, ctx.Nk) if by_batch else ctx
    found = [r.block_kinds(one, ql, qh, kl, kh) for r in rows if r is not None]
    if any(k is None for k in found):
        return None
    kinds = torch.stack([k.expand(len(qe), len(ke)) for k in found if k is not None])  # (B', nqb, nkb)
    ragged = ((qh - ql) < BLOCK) | ((kh - kl) < BLOCK)  # (nqb, nkb) tiles cut by Nq or Nk
    kinds = torch.where(ragged & (kinds == FULL), PARTIAL, kinds).to(torch.int8)
    return kinds[:, None]  # (B', 1, nqb, nkb)


def _row(mask: Mask, b: int) -> Mask | None:
    """``mask`` restricted to batch row ``b`` (as a batch of one), or None for a kind we cannot slice."""
    kind = type(mask)
    if kind in (Causal, SlidingWindow, PrefixLM):
        return mask
    if kind is Padding:
        return Padding(mask.lengths[b : b + 1])  # type: ignore[attr-defined]
    if kind is KeyPadding:
        return KeyPadding(mask.mask[b : b + 1])  # type: ignore[attr-defined]
    if kind is Document:
        ids = mask.ids  # type: ignore[attr-defined]
        return Document(ids[b : b + 1] if ids.shape[0] > 1 else ids)
    if kind is NotMask:
        inner = _row(mask.a, b)  # type: ignore[attr-defined]
        return None if inner is None else NotMask(inner)
    if kind in (AndMask, OrMask):
        a, c = _row(mask.a, b), _row(mask.b, b)  # type: ignore[attr-defined]
        return None if a is None or c is None else kind(a, c)
    return None


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Per query tile: how many key tiles are set, and their indices first (ascending), int32."""
    dense = blocks.to(torch.int32)  # (B', H', nqb, nkb)
    order = torch.argsort(dense, dim=-1, descending=True, stable=True)  # set tiles first
    return dense.sum(-1).to(torch.int32).contiguous(), order.to(torch.int32).contiguous()


def _from_kinds(kinds: Tensor, mask_mod, ctx: MaskContext) -> Any:
    from torch.nn.attention.flex_attention import BlockMask

    partial_n, partial_i = _ordered(kinds == PARTIAL)  # tiles where flex evaluates mask_mod
    full_n, full_i = _ordered(kinds == FULL)  # tiles flex computes without the mask
    return BlockMask.from_kv_blocks(
        partial_n, partial_i, full_n, full_i, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
        seq_lengths=(ctx.Nq, ctx.Nk),
    )  # fmt: skip


def _held_bytes(mask: Mask) -> int:
    """Bytes of the tensors ``mask`` holds (parts of combinations included)."""
    if isinstance(mask, AndMask):  # OrMask too
        return _held_bytes(mask.a) + _held_bytes(mask.b)
    if isinstance(mask, NotMask):
        return _held_bytes(mask.a)
    return sum(v.numel() * v.element_size() for v in vars(mask).values() if isinstance(v, Tensor))


def _create() -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask


@functools.cache
def _compiled_create() -> Any:
    return torch.compile(_create())
