"""Sparse attention: keep a few weights per query, or a fixed pattern.

    TopK(k):        each query keeps its k largest scores; softmax over those k
    Threshold(tau): A = softmax(s); drop A_ij < tau; renormalise each row
    SparseMask(m):  exact attention restricted to a pattern m (local windows, global tokens), computed
                    by the core, whose tiled kernel skips the tiles the pattern empties

plus the patterns themselves as masks: :func:`local` (a band |i - j| < w) and :func:`local_global` (the
band, plus g global tokens that see and are seen by every position; Longformer / BigBird).

TopK and Threshold form every score exactly, one block of query rows at a time (memory O(block x Nk)), so
they accept any mask and bias; they save nothing over exact attention on a CPU and are here to measure what
the sparsity itself costs in quality. The pattern masks save real work through the tiled kernel.

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Nq queries, Nk keys, D head dim,
Dv value head dim, nq rows in one query block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backends.dense import modify_scores, safe_softmax
from ..core.checks import check_int
from ..core.functional import attention
from ..core.masks import Mask, MaskContext, as_mask, kinds_from
from ..core.problem import Problem
from .base import Approximation

__all__ = ["SparseMask", "Threshold", "TopK", "local", "local_global"]

#: bytes of fp32 scores one query block may hold (B x Hq x nq x Nk); bounds TopK/Threshold's memory
BLOCK_BYTES = 64 * 2**20


def _blocks(p: Problem):
    """Query-row ranges whose (B, Hq, nq, Nk) score block fits in BLOCK_BYTES (at least one row)."""
    rows = max(1, BLOCK_BYTES // (4 * p.B * p.Hq * p.Nk * 3))
    for q0 in range(0, p.Nq, rows):
        yield q0, min(q0 + rows, p.Nq)


def _scores(p: Problem, q0: int, q1: int) -> Tensor:
    """Masked, biased scores of query rows q0:q1: (B, Hq, nq, Nk), -inf where the mask forbids."""
    nq = q1 - q0
    qb = p.q[:, :, q0:q1].reshape(p.B, p.Hkv, p.G * nq, p.D)  # (B, Hkv, G*nq, D): heads (Hkv, G) adjacent
    s = torch.matmul(qb, p.k.transpose(-1, -2)) * p.scale  # (B, Hkv, G*nq, Nk)
    return modify_scores(s.view(p.B, p.Hq, nq, p.Nk), p, rows=(q0, q1))  # (B, Hq, nq, Nk)


def _weighted_values(p: Problem, w: Tensor) -> Tensor:
    """w (B, Hq, nq, Nk) @ v with the G query heads of a kv head folded into rows -> (B, Hq, nq, Dv)."""
    nq = w.shape[2]
    if p.dropout_p > 0:
        w = F.dropout(w, p.dropout_p)
    o = torch.matmul(w.reshape(p.B, p.Hkv, p.G * nq, p.Nk), p.v)  # (B, Hkv, G*nq, Dv)
    return o.view(p.B, p.Hq, nq, p.Dv)  # (B, Hq, nq, Dv)


class _RowSparse(Approximation):
    """Exact scores per query block, a per-row selection of weights, then weights @ v."""

    supports_causal = True
    supports_any_mask = True
    supports_dropout = True

    def weights(self, s: Tensor) -> Tensor:
        raise NotImplementedError

    def attend(self, p: Problem) -> Tensor:
        # written in place: a list of small per-block outputs kept between the large score blocks
        # fragments the allocator's heap (measured at N=16K: 2 GB peak instead of the 64 MiB budget)
        out = p.q.new_empty(p.B, p.Hq, p.Nq, p.Dv)
        for q0, q1 in _blocks(p):
            out[:, :, q0:q1] = _weighted_values(p, self.weights(_scores(p, q0, q1)))  # (B, Hq, nq, Dv)
        return out


class TopK(_RowSparse):
    """Each query keeps its ``k`` largest (masked, biased) scores; softmax over those only.

    With ``k >= Nk`` every key is kept and the result is exact attention. Ties at the k-th score are
    broken by position (torch.topk). Time O(Nq Nk D) like exact attention; memory O(block x Nk).

    Args:
        k: scores kept per query row, an int >= 1.

    Raises:
        ValueError: ``k`` not an int >= 1.
    """

    summary = "each query keeps its k largest scores, softmax over those (exact scores, O(N^2) time)"

    def __init__(self, k: int):
        super().__init__()
        self.k = check_int("k", k, 1, owner="TopK")

    def weights(self, s: Tensor) -> Tensor:
        if self.k >= s.shape[-1]:
            return safe_softmax(s)[0]
        top, idx = s.topk(self.k, dim=-1)  # (B, Hq, nq, k)
        return torch.zeros_like(s).scatter(-1, idx, safe_softmax(top)[0])  # (B, Hq, nq, Nk)

    def arguments(self) -> list[str]:
        return [str(self.k)]

    def extra_repr(self) -> str:
        return f"k={self.k}"


class Threshold(_RowSparse):
    """Drop the attention weights below ``tau`` and renormalise each row.

    ``A = softmax(s)``; ``A_ij`` is kept when ``A_ij >= tau``; kept weights are divided by their row sum.
    The largest weight of a row is always kept, so no row empties (for ``tau > 1/Nk`` it could).
    ``Threshold(0.0)`` keeps everything and is exact attention.

    Args:
        tau: the weight threshold, in [0, 1).

    Raises:
        ValueError: ``tau`` outside [0, 1).
    """

    summary = "weights below tau dropped, each row renormalised (exact scores, O(N^2) time)"

    def __init__(self, tau: float):
        super().__init__()
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 <= tau < 1.0:
            raise ValueError(
                f"Threshold tau must be a weight in [0, 1), got {tau!r}; tau=0 keeps every weight"
            )
        self.tau = float(tau)

    def weights(self, s: Tensor) -> Tensor:
        a = safe_softmax(s)[0]  # (B, Hq, nq, Nk)
        if self.tau == 0.0:
            return a
        keep = (a >= self.tau) | (a == a.amax(dim=-1, keepdim=True))
        a = a * keep
        total = a.sum(dim=-1, keepdim=True)
        return a / torch.where(total > 0, total, torch.ones_like(total))

    def arguments(self) -> list[str]:
        return [repr(self.tau)]

    def extra_repr(self) -> str:
        return f"tau={self.tau}"


class SparseMask(Approximation):
    """Exact attention restricted to a sparsity pattern: ``attention(..., mask=mask & pattern)``.

    The pattern is any :class:`~multihead.Mask` (typically :func:`local` or :func:`local_global`); the
    core's ``tiled`` kernel skips the key blocks it empties, so time and memory fall with the pattern's
    density. Every mask and bias the core accepts still applies.

    Args:
        pattern: a Mask or bool tensor, True = may attend.
        backend: passed to :func:`multihead.attention` (default "tiled": the backend that skips tiles).

    Raises:
        ValueError: a pattern that is not a Mask or bool tensor.
    """

    supports_causal = True
    supports_any_mask = True
    supports_dropout = True

    summary = "exact attention restricted to a sparse pattern; the tiled kernel skips the empty tiles"

    def __init__(self, pattern: Mask | Tensor, backend: str = "tiled"):
        super().__init__()
        self.pattern = as_mask(pattern)
        self.backend = backend

    def attend(self, p: Problem) -> Tensor:
        mask = self.pattern if p.mask is None else p.mask & self.pattern
        out = attention(
            p.q, p.k, p.v, mask=mask, bias=p.bias, scale=p.scale, dropout_p=p.dropout_p, backend=self.backend
        )
        assert isinstance(out, Tensor)
        return out

    def arguments(self) -> list[str]:
        return [repr(self.pattern)] + ([] if self.backend == "tiled" else [f"backend={self.backend!r}"])

    def extra_repr(self) -> str:
        return f"pattern={self.pattern!r}, backend={self.backend!r}"


class _Local(Mask):
    """Band ``|i - j| < window`` around the absolute query position, plus ``n_global`` global tokens."""

    def __init__(self, window: int, n_global: int):
        self.window, self.n_global = window, n_global

    @property
    def shift_invariant(self):  # type: ignore[override]
        return self.n_global == 0  # the band depends only on q + offset - k; global tokens do not

    def block_kinds(self, ctx: MaskContext, ql: Tensor, qh: Tensor, kl: Tensor, kh: Tensor) -> Tensor:
        """Analytic tile kinds: the band from the range of ``d = q + offset - k`` over the tile, OR the
        global keys / queries (a tile is full when any part is, empty when every part is)."""
        o, w = ctx.offset, self.window
        d_lo, d_hi = ql + o - (kh - 1), qh - 1 + o - kl  # (nqb, nkb) range of q + offset - k
        full = (d_lo > -w) & (d_hi < w)
        empty = (d_lo >= w) | (d_hi <= -w)
        if self.n_global:
            n = self.n_global
            full = full | (kh <= n) | (qh - 1 + o < n)
            empty = empty & (kl >= n) & (ql + o >= n)
        return kinds_from(full, empty)

    def evaluate(self, b, h, q, k, ctx: MaskContext):
        qa = q + ctx.offset  # absolute query position (bottom-right alignment)
        band = (qa - k).abs() < self.window
        if self.n_global == 0:
            return band
        return band | (k < self.n_global) | (qa < self.n_global)

    def __repr__(self):
        if self.n_global:
            return f"local_global({self.window}, {self.n_global})"
        return f"local({self.window})"


def local(window: int) -> Mask:
    """Bidirectional local window: query i sees keys j with ``|i - j| < window`` (and with ``causal()``:
    the ``window`` keys up to itself, the same as ``mh.sliding_window(window)``).

    Raises:
        ValueError: ``window`` not an int >= 1.
    """
    return _Local(check_int("window", window, 1, owner="local"), 0)


def local_global(window: int, n_global: int) -> Mask:
    """:func:`local` plus global tokens: the first ``n_global`` positions see every key and are seen by
    every query (Longformer's global attention, BigBird's ITC pattern without the random blocks).

    Raises:
        ValueError: ``window`` not an int >= 1, ``n_global`` not an int >= 0.
    """
    return _Local(
        check_int("window", window, 1, owner="local_global"),
        check_int("n_global", n_global, 0, owner="local_global"),
    )
