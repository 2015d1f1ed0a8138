"""``OverlappingHeads``: multi-overlapped-head self-attention (MOHSA; Zhang et al., arXiv 2410.14874).

Plain multi-head attention cuts q, k and v into disjoint slices of D features. MOHSA lets each head also
see ``o`` features of each neighbouring head, so heads exchange information before the softmax::

    q (B, N, Hq*D) --zero-pad o features at both ends--> (B, N, Hq*D + 2o)
    head i reads features [i*D - o, (i+1)*D + o) of the padded vector   -> (B, Hq, N, D + 2o)

    head 0:  [ 0 0 | h0 h0 h0 h0 | h1 ]         (D = 4, o = 1)
    head 1:  [ h0  | h1 h1 h1 h1 | h2 ]
    head 2:  [ h1  | h2 h2 h2 h2 | 0  ]         last head: zero padding on the right

The same widening is applied to k and v (within the Hkv kv heads for GQA), the score scale becomes
``1/sqrt(D + 2o)``, and W^O reads the Hq * (D + 2o) widened head outputs. ``o = floor(overlap * D)``
features are taken from each side, so ``overlap`` in [0, 1) never reaches past a direct neighbour;
``overlap = 0`` is multi-head attention with the same parameters.

Rotary is applied per head before widening, and with rotary the q/k features are widened in whole
rotary pairs: ``o`` is rounded down to an even count, and half-split heads (pairs ``(i, i + D/2)``) are
first reordered to interleaved pairs, a permutation of each head's features that leaves its own scores
unchanged. Every slice of a widened q and k then holds complete pairs rotated by their own position, so
scores still depend on positions only through their difference (a contiguous slice of a half-split head
would cut pairs apart and lose that).

What it changes of :class:`~multihead.MultiHeadAttention`: the ``attend`` step widens q, k and v before
the template's attention, and ``o_proj`` reads the widened heads. Projections, rotary, the cache (it
holds the un-widened k and v) and cross-attention are the template's.

Shape legend: B batch, N query tokens, L keys, d = d_model, Hq / Hkv heads, D head dim, o overlap
features per side, W = D + 2o widened head dim.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..backends import registry
from ..core.biases import Bias
from ..core.checks import check_number
from ..core.masks import Mask
from .base import AttentionVariant

__all__ = ["OverlappingHeads", "widen_heads"]


def widen_heads(t: Tensor, o: int) -> Tensor:
    """t (B, H, T, D) -> (B, H, T, D + 2o): each head joined by o features of each neighbour, zero-padded."""
    B, H, T, D = t.shape
    flat = t.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
    padded = F.pad(flat, (o, o))  # (B, T, H*D + 2o)
    windows = padded.unfold(-1, D + 2 * o, D)  # (B, T, H, D + 2o): head i starts at feature i*D
    return windows.transpose(1, 2)  # (B, H, T, D + 2o)


def _interleave_pairs(t: Tensor) -> Tensor:
    """Reorder half-split features (i, i + D/2) of t (..., D) to adjacent pairs (2i, 2i + 1)."""
    return t.unflatten(-1, (2, t.shape[-1] // 2)).transpose(-1, -2).flatten(-2)  # (..., D)


class OverlappingHeads(AttentionVariant):
    """Multi-head attention whose heads overlap their neighbours by ``overlap * head_dim`` features.

    Args:
        d_model, n_heads, n_kv_heads, bias, dropout, rotary, backend: as
            :class:`~multihead.MultiHeadAttention`.
        overlap: fraction of a head's width taken from each neighbour, in [0, 1); o = floor(overlap * D)
            features per side (with rotary rounded down to even), which must be >= 1 when overlap > 0.

    Parameters: ``qkv_proj`` as MultiHeadAttention; ``o_proj`` reads Hq * (D + 2o) features.

    Raises:
        ValueError: what :class:`~multihead.variants.base.AttentionVariant` raises, overlap outside
            [0, 1), an overlap > 0 that rounds to zero features.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        overlap: float = 0.25,
        bias: bool = True,
        dropout: float = 0.0,
        rotary: nn.Module | None = None,
        backend: str | registry.Backend = "auto",
    ):
        super().__init__(
            d_model, n_heads, n_kv_heads, bias=bias, dropout=dropout, rotary=rotary, backend=backend
        )
        H, D = self.n_heads, self.head_dim
        try:
            self.overlap = check_number(
                "overlap", overlap, 0.0, 1.0, open_high=True, owner="OverlappingHeads"
            )
        except ValueError as e:
            raise ValueError(f"{e}; it is the fraction of a neighbour's features each head adds") from None
        step = 1 if rotary is None else 2  # with rotary, whole pairs only
        self.overlap_dim = int(self.overlap * D) // step * step
        if self.overlap > 0 and self.overlap_dim == 0:
            raise ValueError(
                f"OverlappingHeads overlap={overlap!r} of head_dim={D} rounds to 0 features per side"
                f"{' (an even count with rotary)' if step == 2 else ''}; use overlap >= {step / D:.4g} "
                "or 0 for plain multi-head attention"
            )
        self.pair_order = rotary is not None and not getattr(rotary, "interleaved", False)
        self.o_proj = nn.Linear(H * (D + 2 * self.overlap_dim), d_model, bias=bias)  # W^O on widened heads

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        bias: Bias | Tensor | None = None,
        x: Tensor | None = None,
        context: Tensor | None = None,
    ) -> Tensor:
        """The template's attention on widened heads: q (B, Hq, N, D), k and v (B, Hkv, L, D) ->
        (B, Hq, N, W); arguments as :meth:`multihead.MultiHeadAttention.attend`."""
        if self.pair_order:
            q, k = _interleave_pairs(q), _interleave_pairs(k)  # (B, H|Hkv, N|L, D): pairs adjacent
        o = self.overlap_dim
        q, k, v = widen_heads(q, o), widen_heads(k, o), widen_heads(v, o)  # (B, H|Hkv, N|L, W)
        return super().attend(q, k, v, mask=mask, bias=bias, x=x, context=context)  # (B, Hq, N, W)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", overlap={self.overlap} ({self.overlap_dim} features per side)"
