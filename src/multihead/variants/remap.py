"""A mask or bias of a whole attention problem, seen from a sub-problem of some heads and some query rows.

Mixture-of-heads attention splits one (B, Hq, N, L) problem into smaller calls: the shared heads
``[0, Hs)`` over every query row, and the routed heads ``[Hs, Hq)`` over only the rows of the tokens that
chose them, packed into m <= N rows per (batch, head). The caller's mask and bias were written for the
whole problem (head indices, bottom-right alignment of N against L, tensors of shape (B, Hq, N, L)), so
these wrappers translate indices instead of materialising anything::

    sub-problem (b, h, r, k)  ->  whole problem (b, offset + h, rows[b, h, r], k)

Predicates stay lazy (the tiled kernel still evaluates them one tile at a time). Without ``rows`` the
wrapper only shifts heads and keeps the fast paths of the mask it wraps (plain causal, tile skipping).

Shape legend: B batch, Hs heads of the sub-problem, m packed rows, N, L query and key lengths of the whole.
"""

from __future__ import annotations

from torch import Tensor

from ..core.biases import Bias, as_bias
from ..core.masks import Mask, MaskContext, as_mask

__all__ = ["SubBias", "SubMask", "sub_bias", "sub_mask"]


class _Rows:
    """Index translation shared by the mask and the bias wrappers."""

    def __init__(self, whole: MaskContext, offset: int, rows: Tensor | None):
        self.whole, self.offset, self.rows = whole, offset, rows

    def translate(self, b: Tensor, h: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
        """Sub-problem head and row indices -> the whole problem's: (1, H, 1, 1) and (B, H, nq, 1)."""
        if self.rows is None:
            return h + self.offset, q
        rows = self.rows.to(q.device)  # (B, Hs, m)
        return h + self.offset, rows[b[..., 0], h[..., 0], q[..., 0]].unsqueeze(-1)  # (B, H, nq, 1)


class SubMask(Mask):
    """``base`` restricted to heads ``offset + h`` and (optionally) packed query rows; see module doc."""

    def __init__(self, base: Mask, idx: _Rows):
        self.base, self.idx = base, idx
        plain = idx.rows is None
        self.is_causal = plain and base.is_causal
        self.shift_invariant = plain and base.shift_invariant

    def validate(self, ctx: MaskContext) -> None:
        self.base.validate(self.idx.whole)

    def evaluate(self, b, h, q, k, ctx):
        hh, qq = self.idx.translate(b, h, q)
        return self.base.evaluate(b, hh, qq, k, self.idx.whole)

    def block_kinds(self, ctx, ql, qh, kl, kh):
        # Tile kinds hold for every head, so a subset of heads with unchanged rows inherits them.
        return self.base.block_kinds(self.idx.whole, ql, qh, kl, kh) if self.idx.rows is None else None

    def __repr__(self):
        rows = "" if self.idx.rows is None else ", packed rows"
        return f"sub({self.base!r}, heads from {self.idx.offset}{rows})"


class SubBias(Bias):
    """``base`` restricted to heads ``offset + h`` and (optionally) packed query rows; see module doc."""

    def __init__(self, base: Bias, idx: _Rows):
        self.base, self.idx = base, idx
        self.is_additive = base.is_additive

    def validate(self, ctx: MaskContext) -> None:
        self.base.validate(self.idx.whole)

    def values(self, b, h, q, k, ctx):
        hh, qq = self.idx.translate(b, h, q)
        return self.base.values(b, hh, qq, k, self.idx.whole)

    def apply(self, s, b, h, q, k, ctx):
        hh, qq = self.idx.translate(b, h, q)
        return self.base.apply(s, b, hh, qq, k, self.idx.whole)

    def tensors(self):
        return self.base.tensors()

    def __repr__(self):
        return f"sub({self.base!r}, heads from {self.idx.offset})"


def sub_mask(
    mask: Mask | Tensor | None, whole: MaskContext, offset: int, rows: Tensor | None = None
) -> Mask | None:
    """Wrap ``mask`` (None stays None)."""
    return None if mask is None else SubMask(as_mask(mask), _Rows(whole, offset, rows))


def sub_bias(
    bias: Bias | Tensor | None, whole: MaskContext, offset: int, rows: Tensor | None = None
) -> Bias | None:
    """Wrap ``bias`` (None stays None)."""
    return None if bias is None else SubBias(as_bias(bias), _Rows(whole, offset, rows))
