"""Score modifiers: additive biases (ALiBi, user functions, tensors) and soft-capping.

A bias changes the scaled scores ``s = q k^T * scale`` before masking and softmax. Like masks they are
evaluated late, over index tensors (see :mod:`multihead.core.masks`), so the tiled kernel can build one tile
at a time. Additive biases can also be materialised densely (what SDPA needs as a float ``attn_mask``).

Chain modifiers with ``+``: ``mh.alibi(8) + mh.softcap(30.0)`` applies ALiBi, then the cap, left to right.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .checks import check_int
from .masks import MaskContext, check_broadcast, check_predicate, gather4, index_grid

__all__ = ["Bias", "BiasChain", "alibi", "alibi_slopes", "as_bias", "bias_parts", "custom_bias", "softcap"]

#: The most heads :func:`alibi` builds slopes for (far above any model's query head count).
MAX_HEADS = 1 << 16


class Bias:
    """Base class: a score modifier ``s -> f(s, b, h, q_idx, kv_idx)``.

    Additive subclasses implement :meth:`values`; others override :meth:`apply`.
    """

    #: True when the modifier is ``s + values(...)`` and can be materialised as a float tensor.
    is_additive: bool = True

    def values(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, ctx: MaskContext) -> Tensor:
        raise NotImplementedError

    def apply(self, s: Tensor, b: Tensor, h: Tensor, q: Tensor, k: Tensor, ctx: MaskContext) -> Tensor:
        """Return the modified scores (same dtype as ``s``)."""
        return s + self.values(b, h, q, k, ctx).to(s.dtype)

    def apply_block(self, s: Tensor, ctx: MaskContext, q_range, k_range) -> Tensor:
        """Modify one tile of scores ``s`` broadcastable with (B, H, nq, nk)."""
        b, h, q, k = index_grid(ctx, q_range, k_range, s.device)
        return self.apply(s, b, h, q, k, ctx)

    def natural(self, ctx: MaskContext, device=None, dtype=torch.float32) -> Tensor:
        """An additive bias at its natural broadcast shape, e.g. ``(1, H, Nq, Nk)``."""
        if not self.is_additive:
            raise ValueError(f"{self!r} is not additive and has no dense form")
        b, h, q, k = index_grid(ctx, None, None, device)
        return self.values(b, h, q, k, ctx).to(dtype)

    def validate(self, ctx: MaskContext) -> None:
        """Raise ValueError when the bias cannot apply to a problem of this size."""

    def tensors(self) -> list[Tensor]:
        """Tensors the bias reads that may require grad (the tiled kernel routes gradients to them)."""
        return []

    def __add__(self, other: Bias) -> Bias:
        return BiasChain([self, as_bias(other)])


def as_bias(x: Bias | Tensor | Sequence[Bias]) -> Bias:
    """Accept a Bias, a float tensor broadcastable to (B, H, Nq, Nk), or a sequence of Bias."""
    if isinstance(x, Bias):
        return x
    if isinstance(x, Tensor):
        return TensorBias(x)
    if isinstance(x, (list, tuple)) and all(isinstance(i, Bias) for i in x):
        return BiasChain(list(x))
    raise ValueError(
        f"bias must be a multihead Bias or a float tensor, got {type(x).__name__}; "
        "build one with mh.alibi(n_heads), mh.softcap(c), mh.custom_bias(fn)"
    )


def bias_parts(bias: Bias | None) -> list[Bias]:
    """The summands of ``bias``: its parts for a sum of biases, ``[bias]`` for one, ``[]`` for None."""
    if bias is None:
        return []
    return bias.parts if isinstance(bias, BiasChain) else [bias]


class BiasChain(Bias):
    """A sum of biases (``a + b``), applied in order; nested sums are flattened."""

    parts: list[Bias]

    def __init__(self, parts: list[Bias]):
        flat: list[Bias] = []
        for p in parts:
            flat.extend(bias_parts(p))
        self.parts = flat
        self.is_additive = all(p.is_additive for p in flat)

    def values(self, b, h, q, k, ctx):
        out = self.parts[0].values(b, h, q, k, ctx)
        for p in self.parts[1:]:
            out = out + p.values(b, h, q, k, ctx)
        return out

    def apply(self, s, b, h, q, k, ctx):
        for p in self.parts:
            s = p.apply(s, b, h, q, k, ctx)
        return s

    def validate(self, ctx):
        for p in self.parts:
            p.validate(ctx)

    def tensors(self):
        return [t for p in self.parts for t in p.tensors()]

    def __repr__(self):
        return " + ".join(repr(p) for p in self.parts)


def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi head slopes of Press et al. (2022), float64, shape (n_heads,).

    For a power of two n the slopes are the geometric sequence ``2^(-8/n), 2^(-16/n), ...``; otherwise
    the n' = 2^floor(log2 n) slopes are followed by every other slope of the 2n' sequence.
    """
    # one slope per head is built in Python: a head count far above any model's is a mistake
    check_int("n_heads", n_heads, 1, owner="alibi")
    if n_heads > MAX_HEADS:
        raise ValueError(f"alibi n_heads must be at most {MAX_HEADS}, got {n_heads!r}; pass the query's Hq")

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    p = 2 ** math.floor(math.log2(n_heads))
    slopes = geometric(p)
    if p < n_heads:
        slopes += geometric(2 * p)[0::2][: n_heads - p]
    return torch.tensor(slopes, dtype=torch.float64)


class ALiBi(Bias):
    """Adds ``-slope_h * |i - j|`` with positions aligned bottom-right (as the causal mask)."""

    def __init__(self, n_heads: int):
        self.slopes = alibi_slopes(n_heads)
        self.n_heads = n_heads

    def validate(self, ctx):
        if ctx.H != self.n_heads:
            raise ValueError(
                f"alibi was built for {self.n_heads} heads but the query has Hq={ctx.H}; "
                f"use mh.alibi({ctx.H})"
            )

    def values(self, b, h, q, k, ctx):
        return self._values(h, q, k, ctx, torch.float64)

    def apply(self, s, b, h, q, k, ctx):
        # In the score dtype: the float64 oracle gets exact slopes (2^(-8/n) is not a float32 number for
        # most n), while the fp32 kernels build no float64 tile.
        return s + self._values(h, q, k, ctx, torch.promote_types(s.dtype, torch.float32)).to(s.dtype)

    def natural(self, ctx, device=None, dtype=torch.float32):
        _, h, q, k = index_grid(ctx, None, None, device)
        return self._values(h, q, k, ctx, torch.promote_types(dtype, torch.float32)).to(dtype)

    def _values(self, h, q, k, ctx, dtype):
        slopes = self.slopes.to(device=k.device, dtype=dtype)[h]  # (1, H, 1, 1)
        dist = (q + ctx.offset - k).abs().to(dtype)  # (1, 1, nq, nk)
        return -slopes * dist  # (1, H, nq, nk)

    def __repr__(self):
        return f"alibi({self.n_heads})"


class SoftCap(Bias):
    """Soft-capping of scores, ``s -> cap * tanh(s / cap)`` (Gemma 2, Grok)."""

    is_additive = False

    def __init__(self, cap: float):
        if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not cap > 0 or math.isinf(cap):
            raise ValueError(f"softcap cap must be a finite number > 0, got {cap!r}")
        self.cap = float(cap)

    def apply(self, s, b, h, q, k, ctx):
        return self.cap * torch.tanh(s / self.cap)

    def __repr__(self):
        return f"softcap({self.cap})"


class CustomBias(Bias):
    """User additive bias ``fn(b, h, q_idx, kv_idx) -> float tensor`` on raw indices."""

    def __init__(self, fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]):
        if not callable(fn):
            raise ValueError(f"custom_bias needs a callable fn(b, h, q_idx, kv_idx), got {type(fn).__name__}")
        self.fn = fn

    def values(self, b, h, q, k, ctx):
        out = self.fn(b, h, q, k)
        name = getattr(self.fn, "__name__", self.fn)
        if not isinstance(out, Tensor) or not out.is_floating_point():
            raise ValueError(
                f"custom_bias fn {name!r} must return a float tensor, "
                f"got {getattr(out, 'dtype', type(out).__name__)}"
            )
        target = torch.broadcast_shapes(b.shape, h.shape, q.shape, k.shape)
        check_predicate(out, target, f"fn {name!r}", "custom_bias")
        return out

    def __repr__(self):
        return f"custom_bias({getattr(self.fn, '__name__', 'fn')})"


class TensorBias(Bias):
    """A float tensor broadcastable to (B, Hq, Nq, Nk) added to the scaled scores; gradients flow to it."""

    def __init__(self, t: Tensor):
        if not t.is_floating_point():
            raise ValueError(
                f"a tensor passed as bias must be floating point, got {t.dtype}; "
                "a bool tensor is a mask: pass it as `mask=`"
            )
        self.t = t

    def validate(self, ctx):
        check_broadcast(self.t, ctx, "bias")

    def t4(self, ctx: MaskContext) -> Tensor:
        return check_broadcast(self.t, ctx, "bias")

    def values(self, b, h, q, k, ctx):
        return gather4(self.t4(ctx), b, h, q, k)

    def natural(self, ctx, device=None, dtype=torch.float32):
        return self.t4(ctx).to(device=device, dtype=dtype)

    def tensors(self):
        return [self.t]

    def __repr__(self):
        return f"tensor_bias({tuple(self.t.shape)})"


# -- public constructors --------------------------------------------------------------------------
def alibi(n_heads: int) -> Bias:
    """ALiBi: adds ``-slope_h * |i - j|`` per query head (Press et al., 2022)."""
    return ALiBi(n_heads)


def softcap(cap: float) -> Bias:
    """Soft-cap the scores: ``s -> cap * tanh(s / cap)``."""
    return SoftCap(cap)


def custom_bias(fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> Bias:
    """An additive bias from ``fn(b, h, q_idx, kv_idx) -> float tensor``."""
    return CustomBias(fn)
