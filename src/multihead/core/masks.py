"""Attention masks as small composable predicates (True = may attend), materialised late.

A mask is a predicate ``allowed(b, h, q_idx, kv_idx)`` over index tensors, the idea of PyTorch's
flex_attention ``mask_mod``. It is evaluated only when a backend needs it: densely for the matrix and
SDPA paths, one tile at a time for the tiled kernel (which also skips tiles the mask empties).

Shape legend: B batch, H query heads, Nq queries, Nk keys.

Causal alignment is **bottom-right**: with ``Nq != Nk`` query row ``i`` sits at absolute position
``i + (Nk - Nq)``, so the last query row sees every key. Prefill, chunked prefill and one-token decode
against a KV cache all use the same ``causal()``::

    Nq = 2, Nk = 5 (decode of 2 tokens after 3 cached)      Nq = 5, Nk = 5
        k: 0 1 2 3 4                                          # . . . .
    q0     # # # # .                                          # # . . .
    q1     # # # # #                                          # # # . .
                                                              # # # # .
                                                              # # # # #

The protocol every mask follows (:class:`Mask`, the combinations ``& | ~``, a bool tensor read as a mask,
the tile kinds) is :mod:`multihead.core.mask_base`; this module holds the named masks and their
constructors, and re-exports the protocol so that ``from multihead.core.masks import ...`` reaches both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .checks import as_int_tensor, check_size
from .mask_base import (
    EMPTY,
    FULL,
    PARTIAL,
    AndMask,
    Mask,
    MaskContext,
    NotMask,
    OrMask,
    TensorMask,
    as_mask,
    check_broadcast,
    check_predicate,
    gather4,
    index_grid,
    kinds_from,
)
from .ranges import range_min_max

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "AndMask",
    "Causal",
    "Custom",
    "Document",
    "KeyPadding",
    "Mask",
    "MaskContext",
    "NotMask",
    "OrMask",
    "Padding",
    "PrefixLM",
    "SlidingWindow",
    "TensorMask",
    "as_mask",
    "causal",
    "check_broadcast",
    "check_predicate",
    "custom",
    "document",
    "gather4",
    "index_grid",
    "key_padding",
    "kinds_from",
    "padding",
    "prefix_lm",
    "sliding_window",
]


class Causal(Mask):
    """Key j is visible from query i iff ``j <= i + (Nk - Nq)`` (bottom-right aligned)."""

    is_causal = True
    shift_invariant = True

    def evaluate(self, b, h, q, k, ctx):
        return k <= q + ctx.offset

    def seen_keys(self, ctx, device=None):
        return True  # the last query row sees every key

    def block_kinds(self, ctx, ql, qh, kl, kh):
        o = ctx.offset
        return kinds_from(kh - 1 <= ql + o, kl > qh - 1 + o)

    def __repr__(self):
        return "causal()"


class SlidingWindow(Mask):
    """Causal, and query i sees itself and the ``size - 1`` keys before it (Mistral)."""

    def __init__(self, size: int):
        fix = "size=1 lets each query see only itself, a size of at least Nk is causal()"
        self.size = check_size("size", size, 1, owner="sliding_window", fix=fix)

    shift_invariant = True

    def evaluate(self, b, h, q, k, ctx):
        qa = q + ctx.offset
        return (k <= qa) & (qa - k < self.size)

    def seen_keys(self, ctx, device=None):
        # key k is seen by the query at its own position (or the first query, if k lies before it)
        first = ctx.offset - self.size + 1  # the oldest key the first query row still sees
        return True if first <= 0 else torch.arange(ctx.Nk).view(1, 1, -1) >= first  # (1, 1, Nk)

    def block_kinds(self, ctx, ql, qh, kl, kh):
        lo, hi = ql + ctx.offset, qh - 1 + ctx.offset  # absolute positions of the tile's first/last row
        full = (kh - 1 <= lo) & (hi - kl < self.size)
        return kinds_from(full, (kl > hi) | (lo - (kh - 1) >= self.size))

    def __repr__(self):
        return f"sliding_window({self.size})"


class Padding(Mask):
    """Right padding: key j of batch row b is real iff ``j < lengths[b]``."""

    def __init__(self, lengths: Tensor | list[int]):
        t = as_int_tensor("lengths", lengths, owner="padding")
        if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(
                f"padding lengths must be a 1-D integer tensor of shape (B,), got dtype {t.dtype} and "
                f"shape {tuple(t.shape)}"
            )
        if t.numel() and int(t.min()) < 0:
            raise ValueError(f"padding lengths must be >= 0, got {t.tolist()}")
        self.lengths = t.long()

    def validate(self, ctx):
        if self.lengths.numel() != ctx.B:
            raise ValueError(
                f"padding lengths has {self.lengths.numel()} entries but the batch size is {ctx.B}; "
                "give one length per batch row"
            )
        if self.lengths.numel() and int(self.lengths.max()) > ctx.Nk:
            raise ValueError(f"padding lengths {self.lengths.tolist()} exceed the key length Nk={ctx.Nk}")

    reads_queries = False

    def evaluate(self, b, h, q, k, ctx):
        return k < self.lengths.to(k.device)[b]

    def block_kinds(self, ctx, ql, qh, kl, kh):
        lo, hi = int(self.lengths.min()), int(self.lengths.max())  # every batch row / some batch row
        return kinds_from((kh <= lo) & (ql >= 0), (kl >= hi) & (ql >= 0))

    def default_size(self):
        n = int(self.lengths.max()) + 1 if self.lengths.numel() else 1
        return (self.lengths.numel(), 1, n, n)

    def __repr__(self):
        return f"padding({self.lengths.tolist()})"


class KeyPadding(Mask):
    """A (B, Nk) bool tensor, True = real token; padded keys are hidden from every query."""

    def __init__(self, mask: Tensor):
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
            shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            dtype = mask.dtype if isinstance(mask, Tensor) else None
            raise ValueError(
                f"key_padding expects a bool tensor of shape (B, Nk) with True = real token, got {shape} "
                f"of dtype {dtype}; convert with `mask.bool()`"
            )
        self.mask = mask

    def validate(self, ctx):
        if tuple(self.mask.shape) != (ctx.B, ctx.Nk):
            raise ValueError(
                f"key_padding mask has shape {tuple(self.mask.shape)} but (B, Nk) = ({ctx.B}, {ctx.Nk})"
            )

    reads_queries = False

    def evaluate(self, b, h, q, k, ctx):
        return self.mask.to(k.device)[b, k]

    def block_kinds(self, ctx, ql, qh, kl, kh):
        zero = torch.zeros(1, dtype=torch.long)
        n_all = torch.cat([zero, self.mask.cpu().all(0).long().cumsum(0)])  # (Nk + 1,) keys real in every row
        n_any = torch.cat([zero, self.mask.cpu().any(0).long().cumsum(0)])  # (Nk + 1,) keys real in some row
        full = (n_all[kh] - n_all[kl] == kh - kl) & (ql >= 0)
        return kinds_from(full, (n_any[kh] - n_any[kl] == 0) & (ql >= 0))

    def default_size(self):
        B, N = self.mask.shape
        return (B, 1, N, N)

    def __repr__(self):
        return f"key_padding({tuple(self.mask.shape)})"


class Document(Mask):
    """Packed sequences: query i and key j interact only when they carry the same document id.

    ``ids`` has shape (Nk,) or (B, Nk); queries take the ids of the last Nq positions (bottom-right).
    Combine with ``causal()`` for packed decoder training.
    """

    def __init__(self, ids: Tensor | list[int]):
        t = as_int_tensor("ids", ids, owner="document")
        if t.dim() not in (1, 2) or t.is_floating_point() or t.is_complex():
            raise ValueError(
                f"document ids must be an integer tensor of shape (N,) or (B, N), got dtype {t.dtype} "
                f"and shape {tuple(t.shape)}"
            )
        self.ids = t.long() if t.dim() == 2 else t.long().unsqueeze(0)  # (B or 1, N)

    def validate(self, ctx):
        Bi, N = self.ids.shape
        if N != ctx.Nk or Bi not in (1, ctx.B):
            raise ValueError(
                f"document ids have shape {tuple(self.ids.shape)} but need (Nk,) or (B, Nk) with "
                f"B={ctx.B}, Nk={ctx.Nk}"
            )

    def evaluate(self, b, h, q, k, ctx):
        ids = self.ids.to(k.device)
        bi = b if ids.shape[0] > 1 else torch.zeros_like(b)
        qa = q + ctx.offset  # rows above the key range (Nq > Nk) have no document: they see nothing
        return (ids[bi, qa.clamp(min=0)] == ids[bi, k]) & (qa >= 0)

    def block_kinds(self, ctx, ql, qh, kl, kh):
        ids = self.ids.cpu()
        lo, hi = (ql + ctx.offset).clamp(min=0), (qh + ctx.offset).clamp(min=0)  # query tiles in key space
        qmin, qmax = range_min_max(ids, lo.view(-1).tolist(), hi.view(-1).tolist())  # (Bi, nqb) each
        kmin, kmax = range_min_max(ids, kl.view(-1).tolist(), kh.view(-1).tolist())  # (Bi, nkb) each
        qmin, qmax, kmin, kmax = qmin[:, :, None], qmax[:, :, None], kmin[:, None], kmax[:, None]
        one_doc = ((qmin == qmax) & (kmin == kmax) & (qmin == kmin)).all(0)  # (nqb, nkb)
        disjoint = ((qmax < kmin) | (kmax < qmin)).all(0)  # (nqb, nkb): id ranges never meet
        no_rows = hi <= lo  # tiles of rows above the key range (Nq > Nk) see nothing
        return kinds_from(one_doc & (ql + ctx.offset >= 0), disjoint | no_rows)

    def default_size(self):
        B, N = self.ids.shape
        return (B, 1, N, N)

    def __repr__(self):
        return f"document(shape={tuple(self.ids.shape)})"


class PrefixLM(Mask):
    """Bidirectional over the first ``n`` keys, causal after (T5 / UniLM prefix LM)."""

    def __init__(self, n: int):
        self.n = check_size("length", n, 0, owner="prefix_lm", fix="0 is causal()")

    def evaluate(self, b, h, q, k, ctx):
        return (k < self.n) | (k <= q + ctx.offset)

    def seen_keys(self, ctx, device=None):
        return True  # the last query row sees every key

    def block_kinds(self, ctx, ql, qh, kl, kh):
        o = ctx.offset
        return kinds_from((kh <= self.n) | (kh - 1 <= ql + o), (kl >= self.n) & (kl > qh - 1 + o))

    def __repr__(self):
        return f"prefix_lm({self.n})"


class Custom(Mask):
    """User predicate ``fn(b, h, q_idx, kv_idx) -> bool tensor`` on raw (un-aligned) indices."""

    def __init__(self, fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]):
        if not callable(fn):
            raise ValueError(f"custom mask needs a callable fn(b, h, q_idx, kv_idx), got {type(fn).__name__}")
        self.fn = fn

    def evaluate(self, b, h, q, k, ctx):
        out = self.fn(b, h, q, k)
        name = getattr(self.fn, "__name__", self.fn)
        if not isinstance(out, Tensor) or out.dtype != torch.bool:
            raise ValueError(
                f"custom mask fn {name!r} must return a bool tensor, "
                f"got {getattr(out, 'dtype', type(out).__name__)}"
            )
        check_predicate(
            out, torch.broadcast_shapes(b.shape, h.shape, q.shape, k.shape), f"fn {name!r}", "custom mask"
        )
        return out

    def __repr__(self):
        return f"custom({getattr(self.fn, '__name__', 'fn')})"


# -- public constructors --------------------------------------------------------------------------
def causal() -> Mask:
    """Causal mask, bottom-right aligned: query i sees keys ``j <= i + Nk - Nq``."""
    return Causal()


def sliding_window(size: int) -> Mask:
    """Causal window: query i sees itself and the ``size - 1`` keys before it.

    Raises:
        ValueError: if ``size < 1``.
    """
    return SlidingWindow(size)


def padding(lengths: Tensor | list[int]) -> Mask:
    """Right padding: key j of batch row b is real iff ``j < lengths[b]``; lengths shape (B,)."""
    return Padding(lengths)


def key_padding(mask: Tensor) -> Mask:
    """Key padding from a (B, Nk) bool tensor with True = real token."""
    return KeyPadding(mask)


def document(ids: Tensor | list[int]) -> Mask:
    """Packed-sequence mask from document ids of shape (N,) or (B, N)."""
    return Document(ids)


def prefix_lm(prefix_len: int) -> Mask:
    """Bidirectional over the first ``prefix_len`` keys, causal after."""
    return PrefixLM(prefix_len)


def custom(fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> Mask:
    """A mask from a predicate ``fn(b, h, q_idx, kv_idx) -> bool tensor`` (True = may attend)."""
    return Custom(fn)
