"""Exact attention on keys and values rounded to int8 per token: :class:`KVInt8`, what
``mh.quant.quantize(model, kv="int8")`` puts into every attention (docs/equations.md, section 7)."""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from ..approx.base import Approximation
from ..backends import registry
from ..backends.auto import first_fit
from ..core.numerics import acc_dtype
from ..core.problem import AttentionOutput, Problem
from ..nn.kv_cache import dequantize_int8, int8_rounded, quantize_int8

__all__ = ["KVInt8"]


class KVInt8(Approximation):
    """Exact attention on keys and values rounded to int8 per token (the core's int8 KV-cache format).

    ``k, v -> int8 (per (batch, head, position), scale = absmax / 127) -> dequantized``; the scores,
    softmax and weights are computed by :func:`multihead.attention` in the input precision (fp32
    accumulation for half inputs). Any mask, bias and dropout apply. Keys and values that come straight
    from an ``"int8"`` KV cache (:func:`multihead.nn.kv_cache.int8_rounded`) are already rounded and are
    not rounded again.
    """

    supports_causal = True
    supports_any_mask = True
    supports_dropout = True
    summary = "exact attention on keys and values rounded to int8 per token"

    def run(self, p: Problem) -> AttentionOutput:
        """As :meth:`Approximation.run`; keys and values straight from an int8 cache skip the rounding
        (a decode step then rounds only its new token, in the cache).

        Raises:
            ValueError: the reason :meth:`why_not` gives, when it gives one.
        """
        if not (int8_rounded(p.k) and int8_rounded(p.v)):
            return super().run(p)
        reason = self.why_not(p)
        if reason is not None:
            raise ValueError(reason)
        acc = acc_dtype(p.dtype)  # the working dtype of the rounding path, so both paths agree
        out = self._exact(replace(p, q=p.q.to(acc), k=p.k.to(acc), v=p.v.to(acc)))  # (B, Hq, Nq, Dv)
        return AttentionOutput(out.to(p.dtype), None, None)

    def attend(self, p: Problem) -> Tensor:
        k = dequantize_int8(*quantize_int8(p.k, p.k.dtype), p.k.dtype)  # (B, Hkv, Nk, D)
        v = dequantize_int8(*quantize_int8(p.v, p.v.dtype), p.v.dtype)  # (B, Hkv, Nk, Dv)
        return self._exact(replace(p, k=k, v=v))

    @staticmethod
    def _exact(p: Problem) -> Tensor:
        """Exact attention of ``p`` -> (B, Hq, Nq, Dv), its mask, bias, scale and dropout, on the backend
        ``auto`` picks (``p`` is already a checked call: no second validation on a decode step)."""
        return registry.get(first_fit(p)).run(p).out
