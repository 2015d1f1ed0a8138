"""What every approximation shares: the backend protocol, its refusals, and the mask split.

An approximation is a backend of the functional core that is also an ``nn.Module``::

    out = mh.attention(q, k, v, mask=mh.causal(), backend=approx.TopK(64))   # (B, Hq, Nq, Dv)
    out = approx.TopK(64)(q, k, v, mask=mh.causal())                        # the same call
    m = mh.MultiHeadAttention(512, 8, backend=approx.Linformer(64, 1024, learned=True))  # trains with m

It has a ``name`` (its constructor call, ``TopK(64)``), a one-line ``summary``, ``why_not(problem)`` (what
it cannot serve: weights or lse, attention sinks, a mask, bias or dropout it has no form for) and
``run(problem)``, which receives the :class:`~multihead.core.problem.Problem` that
:func:`multihead.attention` validated once.
Approximations are not registered by name (they have parameters) and ``auto`` never picks one.

Conventions are the core's: q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv), ``Hq % Hkv == 0``
and query head i reading kv head ``i // G``, masks True = may attend with bottom-right causal alignment,
and a query row with no allowed key giving zeros. Work is done in float32 for half inputs (float64 stays
float64) and the result is cast back to the input dtype.

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Nq queries, Nk keys, D head dim,
Dv value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from ..core.biases import Bias
from ..core.functional import attention
from ..core.masks import AndMask, Mask, MaskContext
from ..core.numerics import acc_dtype
from ..core.problem import AttentionOutput, Problem

__all__ = ["Approximation", "MaskSplit", "split_mask"]


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
    """Base class of the approximations: a backend of :func:`multihead.attention` that is a module.

    Subclasses implement :meth:`attend` on a validated :class:`~multihead.core.problem.Problem` whose
    tensors are already in the working dtype, set the class flags and ``summary`` below, list their
    constructor arguments in :meth:`arguments`, and add their own refusals to :meth:`why_not`.
    """

    #: has a causal form (``mask=mh.causal()``); methods that mix the whole sequence (Linformer,
    #: Nystrom) do not, and the trainer then trains them bidirectionally.
    supports_causal: bool = False
    #: accepts any mask and any bias (it evaluates the scores it keeps exactly).
    supports_any_mask: bool = False
    #: applies ``dropout_p`` to explicit attention weights.
    supports_dropout: bool = False
    #: not exact attention (what :func:`multihead.explain` calls it).
    exact: bool = False
    #: one line for :func:`multihead.explain`.
    summary: str = "an approximation of attention"

    @property
    def name(self) -> str:
        """The constructor call, e.g. ``TopK(64)``: the backend's name in messages and ``explain``."""
        return f"{type(self).__name__}({', '.join(self.arguments())})"

    def arguments(self) -> list[str]:
        """The constructor arguments, as written in a call (keywords only where not the default)."""
        return []

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
        """``mh.attention(q, k, v, ..., backend=self)``: the approximation -> (B, Hq, Nq, Dv) in q's dtype.

        Raises:
            ValueError: what :func:`multihead.attention` raises for bad tensors, masks and biases, plus
                the reason of :meth:`why_not` (a mask, bias or dropout this approximation cannot apply).
        """
        out = attention(q, k, v, mask=mask, bias=bias, scale=scale, dropout_p=dropout_p, backend=self)
        assert isinstance(out, Tensor)
        return out

    def why_not(self, p: Problem) -> str | None:
        """Why this approximation cannot serve ``p`` (a message naming the argument and what to use
        instead), or None. Subclasses add their own limits after these."""
        asked = [n for n, on in (("return_weights", p.return_weights), ("return_lse", p.return_lse)) if on]
        if asked:
            return (
                f"{self.name} approximates the output only and has no attention weights or log-sum-exp to "
                f"return ({', '.join(f'{n}=True' for n in asked)}); drop {' and '.join(asked)}, or use an "
                "exact backend ('matrix' returns weights, 'tiled' the lse)"
            )
        name = type(self).__name__
        if p.sinks is not None:
            return (
                f"{self.name} has no attention-sink term: it approximates softmax(q k^T) v without the extra "
                "per-head column that sinks=... adds to each row's denominator; pass sinks=None, or use an "
                "exact backend ('auto', 'tiled', 'matrix')"
            )
        if p.bias is not None and not self.supports_any_mask:
            return (
                f"{name} cannot add a bias ({p.bias!r}) to scores it never forms; "
                "use TopK, Threshold or LowRank, or exact attention, for biased attention"
            )
        if p.dropout_p > 0 and not self.supports_dropout:
            return (
                f"{name} has no attention weights to drop (dropout_p={p.dropout_p}); pass dropout_p=0.0 "
                "(build the model with dropout=0.0)"
            )
        if p.mask is not None and not self.supports_any_mask:
            parts = self.split(p)
            if parts.causal and not self.supports_causal:
                return (
                    f"{name} mixes every position of the sequence and has no causal form; use "
                    "LinearAttention or Performer (causal by prefix sums), TopK or Threshold, or exact "
                    "attention for causal()"
                )
            if parts.rest:
                allowed = "causal() and key padding" if self.supports_causal else "key padding"
                return (
                    f"{name} cannot apply mask {parts.rest[0]!r}: it supports only {allowed} "
                    "(mh.padding / mh.key_padding); use TopK, Threshold or SparseMask, or exact attention"
                )
        return None

    def run(self, p: Problem) -> AttentionOutput:
        """:meth:`attend` on ``p`` in the working dtype -> ``AttentionOutput(out, None, None)``, out
        (B, Hq, Nq, Dv) in ``p``'s dtype.

        Raises:
            ValueError: the reason :meth:`why_not` gives, when it gives one.
        """
        reason = self.why_not(p)
        if reason is not None:
            raise ValueError(reason)
        acc = acc_dtype(p.dtype)
        work = p if acc == p.dtype else replace(p, q=p.q.to(acc), k=p.k.to(acc), v=p.v.to(acc))
        return AttentionOutput(self.attend(work).to(p.dtype), None, None)

    def attend(self, p: Problem) -> Tensor:
        """The approximation of ``p`` (tensors in the working dtype, :meth:`why_not` passed) ->
        (B, Hq, Nq, Dv)."""
        raise NotImplementedError

    def split(self, p: Problem) -> MaskSplit:
        """:func:`split_mask` of ``p.mask`` (:meth:`why_not` refuses the factors this approximation has
        no form for)."""
        return split_mask(p.mask, p.ctx, p.q.device)
