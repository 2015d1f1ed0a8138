"""The exact merge of the fused engine's pieces: each piece's partial softmax folded in by its log-sum-exp.

Shape legend: B batch, Hq query heads, Nq query rows, Dv value width (the common head size, padded);
h heads and n rows of one piece; a band delivers its output as (B*h, nb, bq, Dv) with nb * bq == n.

A row covered by several pieces is merged exactly (FlashAttention's split-K rule, done by
:func:`multihead.core.numerics.merge_partials_` in place)::

    lse = logaddexp(lse_a, lse_b),   out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

The first piece that covers everything becomes the accumulator without a copy; a row's first piece is
copied in; only rows that several pieces share are merged. Attention sinks are one more term of the same
merge, added once at the end (:func:`multihead.core.numerics.add_sink_`: a partial with lse ``sink_h``
and output 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...core.numerics import add_sink_, merge_partials_
from ...core.problem import Problem

__all__ = ["Merger"]


class Merger:
    """Output and log-sum-exp accumulators; each piece is merged in by its log-sum-exp."""

    def __init__(self, p: Problem, acc: torch.dtype, dv: int):
        self.shape, self.acc, self.device = (p.B, p.Hq, p.Nq, dv), acc, p.q.device
        self._out: Tensor | None = None  # allocated on the first piece that does not cover everything
        self._lse: Tensor | None = None
        self.touched = bytearray(p.Nq)
        self.some_row_may_see_nothing = False  # set by a piece with rows that see no key

    @property
    def out(self) -> Tensor:
        """The output accumulator (B, Hq, Nq, Dv) in the accumulation dtype."""
        if self._out is None:
            # rows no piece touches keep lse = -inf and are zeroed in result(), so no zero fill here
            self._out = torch.empty(self.shape, dtype=self.acc, device=self.device)
        return self._out

    @property
    def lse(self) -> Tensor:
        """The log-sum-exp accumulator (B, Hq, Nq); -inf until a piece reaches the row."""
        if self._lse is None:
            self._lse = torch.full(self.shape[:3], float("-inf"), dtype=self.acc, device=self.device)
        return self._lse

    def add(self, rows: slice, heads: slice, o: Tensor, lse: Tensor, has_key: Tensor | None, last: bool):
        """Merge ``o`` (B, h, n, Dv) and ``lse`` (B, h, n) into rows ``rows`` of heads ``heads``.

        ``o`` may also come in a band's shape (B*h, nb, bq, Dv) with nb*bq == n: it is then written
        into place through a view, with no intermediate reshaped copy. ``has_key`` (B|1, h|1, n) marks
        the rows that see a key (None: all do); ``last`` says the piece's rows are complete in every head.
        """
        if has_key is not None:
            lse = lse.masked_fill(~has_key, float("-inf"))  # the kernel reports 0 for rows with no key
            self.some_row_may_see_nothing = True
        if self._out is None and tuple(o.shape) == self.shape and o.dtype == lse.dtype == self.acc:
            # the first piece covers every row and head (one causal call, one band ...): keep its result
            self._out, self._lse = o, lse
            self.touched[:] = b"\x01" * len(self.touched)
            return
        acc_o, acc_l = self.out[:, heads, rows], self.lse[:, heads, rows]  # views
        if not any(self.touched[rows]):
            acc_o.view(o.shape).copy_(o)  # (B*h, nb, bq, Dv) band view, or the same shape
            acc_l.copy_(lse)
        else:
            merge_partials_(acc_o, acc_l, o.reshape(acc_o.shape), lse)  # (B, h, n, Dv), merged in place
        if last:
            self.touched[rows] = b"\x01" * (rows.stop - rows.start)

    def result(self, dtype: torch.dtype, dv: int, sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The merged (out (B, Hq, Nq, dv) in ``dtype``, lse (B, Hq, Nq)); rows no key reached are zero.

        ``sinks`` (Hq,), when given, are merged in last (in the accumulation dtype, before the cast): the
        lse then includes them, and rows no key reached get lse = sink_h.
        """
        out, lse = self.out, self.lse
        if self.some_row_may_see_nothing or self.touched.count(0):
            out.masked_fill_(torch.isinf(lse).unsqueeze(-1), 0.0)  # rows with no key -> 0
        if sinks is not None:
            add_sink_(out, lse, sinks)
        return out[..., :dv].to(dtype), lse
