"""One attention call, validated once at the public boundary and handed to a backend.

Shape legend: B batch, Hq query heads, Hkv key/value heads, G = Hq // Hkv, Nq queries, Nk keys,
D query/key head dim, Dv value head dim. Query head ``i`` reads kv head ``i // G``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from .biases import Bias, as_bias
from .masks import Mask, MaskContext, as_mask
from .tiles import Grid, classify


class AttentionOutput(NamedTuple):
    """``out`` (B, Hq, Nq, Dv); ``weights`` (B, Hq, Nq, Nk) or None; ``lse`` (B, Hq, Nq) fp32 or None."""

    out: Tensor
    weights: Tensor | None
    lse: Tensor | None


@dataclass
class Problem:
    q: Tensor
    k: Tensor
    v: Tensor
    mask: Mask | None
    bias: Bias | None
    scale: float
    dropout_p: float
    return_weights: bool
    return_lse: bool
    #: (Hq,) learned attention-sink logits (one extra softmax column per query head, value 0) or None
    sinks: Tensor | None = None
    #: tile grids by (bq, bk), classified on first use (:meth:`grid`); None = no analytic form
    grids: dict[tuple[int, int], Grid | None] = field(default_factory=dict, repr=False, compare=False)

    @property
    def B(self) -> int:
        return self.q.shape[0]

    @property
    def Hq(self) -> int:
        return self.q.shape[1]

    @property
    def Hkv(self) -> int:
        return self.k.shape[1]

    @property
    def G(self) -> int:
        return self.Hq // self.Hkv

    @property
    def Nq(self) -> int:
        return self.q.shape[2]

    @property
    def Nk(self) -> int:
        return self.k.shape[2]

    @property
    def D(self) -> int:
        return self.q.shape[3]

    @property
    def Dv(self) -> int:
        return self.v.shape[3]

    @property
    def ctx(self) -> MaskContext:
        return MaskContext(self.B, self.Hq, self.Nq, self.Nk)

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def needs_grad(self) -> bool:
        tensors = [self.q, self.k, self.v] + (self.bias.tensors() if self.bias else [])
        if self.sinks is not None:
            tensors.append(self.sinks)
        return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)

    def grid(self, bq: int, bk: int) -> Grid:
        """The mask's (bq x bk) tile grid, classified once per problem and kept for whoever asks next."""
        grid = self.grids.get((bq, bk))
        if grid is None:
            grid = classify(self.mask, self.ctx, bq, bk)
            assert grid is not None  # evaluate=True always classifies
            self.grids[(bq, bk)] = grid
        return grid

    def analytic_grid(self, bq: int, bk: int) -> Grid | None:
        """Like :meth:`grid` but None, instead of evaluating the mask, when it has no analytic tile kinds
        (a cheap question for ``auto``'s checks)."""
        if (bq, bk) not in self.grids:
            grid = classify(self.mask, self.ctx, bq, bk, evaluate=False)
            if grid is None:
                return None
            self.grids[(bq, bk)] = grid
        return self.grids[(bq, bk)]

    def describe(self) -> str:
        return (
            f"B={self.B} Hq={self.Hq} Hkv={self.Hkv} Nq={self.Nq} Nk={self.Nk} D={self.D} Dv={self.Dv} "
            f"dtype={str(self.dtype).replace('torch.', '')} mask={self.mask!r} bias={self.bias!r}"
            + ("" if self.sinks is None else f" sinks=({self.Hq},)")
        )


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dims (B, H, N, D), got {t.dim()} dims {tuple(t.shape)}; "
                "modules take (B, N, d_model) - split heads with x.view(B, N, H, D).transpose(1, 2)"
            )
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}; cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k has {k.shape[1]} heads but v has {v.shape[1]}; they must be equal (Hkv)")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads Hq ({q.shape[1]}) must be divisible by kv heads Hkv ({k.shape[1]}) "
            "(GQA/MQA: query head i reads kv head i // (Hq // Hkv))"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k has Nk={k.shape[2]} positions but v has {v.shape[2]}; they must be equal")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head dims differ: q has D={q.shape[3]}, k has D={k.shape[3]}; they must be equal")
    if k.shape[2] == 0:
        raise ValueError("k and v have Nk=0 positions: attention needs at least one key")
    if q.shape[3] == 0:
        raise ValueError("head dim D=0: q and k need at least one feature")


def check_sinks(sinks: object, q: Tensor) -> None:
    """Raise ValueError unless ``sinks`` is a floating tensor of shape (Hq,) on q's device.

    Raises:
        ValueError: naming ``sinks``, what it got and the fix.
    """
    Hq = q.shape[1]
    if not isinstance(sinks, Tensor):
        raise ValueError(
            f"sinks must be a float tensor of shape (Hq,) = ({Hq},), one logit per query head, got "
            f"{type(sinks).__name__}; pass e.g. torch.zeros({Hq}) or None for no sinks"
        )
    if not sinks.is_floating_point():
        raise ValueError(
            f"sinks must be a floating tensor (one logit per query head), got dtype {sinks.dtype}; "
            "cast it with sinks.float()"
        )
    if tuple(sinks.shape) != (Hq,):
        raise ValueError(
            f"sinks must have shape (Hq,) = ({Hq},), one logit per query head, got {tuple(sinks.shape)}; "
            "pass one value per query head (it is shared over batch and rows, never broadcast)"
        )
    if sinks.device != q.device:
        raise ValueError(
            f"sinks is on {sinks.device} but q is on {q.device}; move it with sinks.to(q.device)"
        )


def make_problem(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask=None,
    bias=None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    return_lse: bool = False,
    sinks: Tensor | None = None,
) -> Problem:
    """Validate the public arguments of :func:`multihead.attention` and bundle them.

    Raises:
        ValueError: on wrong ranks, dtypes, devices, head counts, masks or biases that do not broadcast
            to (B, Hq, Nq, Nk), a non-finite scale, ``dropout_p`` outside [0, 1), or ``sinks`` that is not
            a floating (Hq,) tensor on q's device.
    """
    _check_qkv(q, k, v)
    if sinks is not None:
        check_sinks(sinks, q)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}; None means 1/sqrt(D)")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    m = None if mask is None else as_mask(mask)
    bb = None if bias is None else as_bias(bias)
    p = Problem(q, k, v, m, bb, float(scale), float(dropout_p), bool(return_weights), bool(return_lse), sinks)
    if m is not None:
        m.validate(p.ctx)
    if bb is not None:
        bb.validate(p.ctx)
    return p
