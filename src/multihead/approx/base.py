"""What every approximation shares: the calling convention, validation, and the mask split.

Every approximation is an ``nn.Module`` called like the functional core::

    out = approx(q, k, v, *, mask=None, bias=None, scale=None, dropout_p=0.0)   # (B, Hq, Nq, Dv)

with q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv), ``Hq % Hkv == 0`` and query head i reading kv
head ``i // G``, masks True = may attend with bottom-right causal alignment, and a query row with no
allowed key giving zeros. Arguments are validated by the core's :func:`~multihead.problem.make_problem`;
what an approximation cannot honour (a mask it has no form for, a bias, dropout) raises ValueError
naming the argument and what to use instead. Work is done in float32 for half inputs (float64 stays
float64) and the result is cast back to the input dtype.

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Nq queries, Nk keys, D head dim,
Dv value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..core.biases import Bias
from ..core.masks import AndMask, Mask, MaskContext
from ..core.problem import Problem, make_problem

__all__ = [
    "Approximation",
    "MaskSplit",
    "acc_dtype",
    "check_approx",
    "check_int",
    "safe_softmax",
    "split_mask",
]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The working dtype: float64 stays float64, everything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_int(owner: str, name: str, value: object, low: int) -> int:
    """Return ``value`` after checking it is an int >= low (bool excluded)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{owner} {name} must be an int >= {low}, got {value!r}")
    return value


def safe_softmax(s: Tensor, dim: int = -1) -> Tensor:
    """Softmax along ``dim`` where a row of only -inf gives zeros (not NaN), with zero gradient."""
    m = s.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m).detach()
    e = torch.exp(s - m)
    total = e.sum(dim=dim, keepdim=True)
    return e / torch.where(total > 0, total, torch.ones_like(total))


@dataclass
class MaskSplit:
    """A mask taken apart into what linear and low-rank methods can honour.

    ``causal``: a ``causal()`` factor is present. ``keys``: the and of every query-independent factor
    (key padding), a bool (B|1, 1, 1, Nk) tensor, True = real key, or None. ``rest``: the factors that
    depend on the query position in another way (sliding windows, documents, ...).
    """

    causal: bool
    keys: Tensor | None
    rest: list[Mask]


def _factors(mask: Mask) -> list[Mask]:
    if type(mask) is AndMask:
        return [*_factors(mask.a), *_factors(mask.b)]
    return [mask]


def split_mask(mask: Mask | None, ctx: MaskContext, device: torch.device) -> MaskSplit:
    """Split ``mask`` into causal, key-padding and other factors (see :class:`MaskSplit`).

    A factor is query-independent when evaluating it over two query rows yields a single row: the index
    tensors broadcast, so a predicate that never reads the query index keeps a query dim of 1. With one
    query (decode) every factor is a key mask of that row.
    """
    out = MaskSplit(False, None, [])
    if mask is None:
        return out
    for part in _factors(mask):
        if part.is_causal:
            out.causal = True
            continue
        probe = part.block(ctx, (0, min(2, ctx.Nq)), (0, ctx.Nk), device)
        if probe.shape[-2] != 1:  # with Nq == 1 every factor is a key mask of that one row
            out.rest.append(part)
            continue
        keys = part.natural(ctx, device)  # (B|1, H|1, 1, Nk)
        if keys.shape[1] != 1:
            out.rest.append(part)  # head-dependent key masks: not supported by the fast forms
            continue
        out.keys = keys if out.keys is None else out.keys & keys
    return out


class Approximation(nn.Module):
    """Base class of the approximations: ``forward(q, k, v, *, mask, bias, scale, dropout_p)``.

    Subclasses implement :meth:`attend` on a validated :class:`~multihead.problem.Problem` whose tensors
    are already in the working dtype, and set the class flags below.
    """

    #: has a causal form (``mask=mh.causal()``); methods that mix the whole sequence (Linformer,
    #: Nystrom) do not, and the trainer then trains them bidirectionally.
    supports_causal: bool = False
    #: accepts any mask and any bias (it evaluates the scores it keeps exactly).
    supports_any_mask: bool = False
    #: applies ``dropout_p`` to explicit attention weights.
    supports_dropout: bool = False

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        bias: Bias | Tensor | None = None,
        scale: float | None = None,
        dropout_p: float = 0.0,
    ) -> Tensor:
        """Approximate ``softmax(mask(q k^T * scale + bias)) v`` -> (B, Hq, Nq, Dv) in q's dtype.

        Raises:
            ValueError: what :func:`multihead.attention` raises for bad tensors, masks and biases, plus a
                mask, bias or dropout this approximation cannot apply.
        """
        p = make_problem(q, k, v, mask=mask, bias=bias, scale=scale, dropout_p=dropout_p)
        name = type(self).__name__
        if p.bias is not None and not self.supports_any_mask:
            raise ValueError(
                f"{name} cannot add a bias ({p.bias!r}) to scores it never forms; "
                "use TopK, Threshold or LowRank, or exact attention, for biased attention"
            )
        if p.dropout_p > 0 and not self.supports_dropout:
            raise ValueError(
                f"{name} has no attention weights to drop (dropout_p={p.dropout_p}); pass dropout_p=0.0 "
                "(build the model with dropout=0.0)"
            )
        acc = acc_dtype(p.dtype)
        if acc != p.dtype:
            p.q, p.k, p.v = p.q.to(acc), p.k.to(acc), p.v.to(acc)
        return self.attend(p).to(q.dtype)

    def attend(self, p: Problem) -> Tensor:
        raise NotImplementedError

    def split(self, p: Problem, *, causal_ok: bool) -> MaskSplit:
        """:func:`split_mask` of ``p.mask``, refusing the factors this approximation has no form for."""
        parts = split_mask(p.mask, p.ctx, p.q.device)
        name = type(self).__name__
        if parts.causal and not causal_ok:
            raise ValueError(
                f"{name} mixes every position of the sequence and has no causal form; use LinearAttention "
                "or Performer (causal by prefix sums), TopK or Threshold, or exact attention for causal()"
            )
        if parts.rest:
            allowed = "causal() and key padding" if causal_ok else "key padding"
            raise ValueError(
                f"{name} cannot apply mask {parts.rest[0]!r}: it supports only {allowed} "
                "(mh.padding / mh.key_padding); use TopK, Threshold or SparseMask, or exact attention"
            )
        return parts


def check_approx(approx: object, backend: str = "auto") -> Approximation | None:
    """Return ``approx`` if it is None or a :mod:`multihead.approx` approximation usable with ``backend``.

    Raises:
        ValueError: anything else, or an approximation together with a backend other than "auto".
    """
    if approx is None:
        return None
    if not isinstance(approx, Approximation):
        raise ValueError(
            "approx must be None (exact) or a multihead.approx approximation (TopK(k), Nystrom(m), "
            f"Performer(f), ...), got {type(approx).__name__}"
        )
    if backend != "auto":
        raise ValueError(
            f"approx={approx!r} replaces the attention backend, so backend must stay 'auto', got {backend!r}"
        )
    return approx
