"""``decode``: a few query rows (1-16) against a long KV cache - a memory-bound pass over K and V.

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Nq (<= 16) new tokens, Nk cached keys.

Decoding reads every cached key and value once and does ~2 flops per byte, so its speed is the memory
bandwidth. Two things keep it there:

* grouped GQA: the G query heads that share a kv head are folded into the query rows, so each kv head's
  K and V are streamed once for all G heads (SDPA with ``enable_gqa`` reads them G times)::

      q (B, Hq, Nq, D) -> (B, Hkv, G*Nq, D);   scores = q K^T  (B, Hkv, G*Nq, Nk)

* split over the key length: when B * Hkv is too small to keep every core busy, the cache is cut into
  equal chunks that run as extra "heads" of one kernel call and are merged by their log-sum-exp.

The mask is planned as in ``tiled`` with a single query block: a causal decode is one unmasked pass over
the cache plus an Nq x Nq causal corner, a sliding window reads only the window. Attention sinks are one
more partial of the final merge (lse ``sink_h``, output 0), added once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.masks import Causal
from ..core.numerics import acc_dtype, add_sink, merge_partials
from ..core.problem import AttentionOutput, Problem
from .tiled import backend as tiled
from .tiled import fused
from .tiled.plan import Piece, pieces

MAX_ROWS = 16  # query rows served as a decode
MIN_KEYS = 128  # below this the call is too small for the path to matter
BLOCK_K = 256  # key block of the plan
MIN_CHUNK = 1024  # never split the cache into chunks shorter than this


class DecodeBackend:
    name = "decode"
    summary = "1-16 query rows against a long cache: GQA folded into rows, split over keys, memory-bound"

    def why_not(self, p: Problem) -> str | None:
        if p.return_weights:
            return "the decode path never materialises the weights"
        if p.Nq > MAX_ROWS:
            return f"the decode path serves at most {MAX_ROWS} query rows, this call has Nq={p.Nq}"
        if p.Nk < MIN_KEYS:
            return f"only Nk={p.Nk} keys (< {MIN_KEYS}): nothing memory-bound to speed up"
        return fused.why_not_fused(p)

    def plan(self, p: Problem) -> list[Piece]:
        """One query block of all Nq rows against key blocks of ``BLOCK_K`` (see :mod:`.tiled.plan`)."""
        grid = p.grid(max(p.Nq, 1), BLOCK_K)
        return pieces(grid, p.mask, p.bias, p.ctx, p.Hq)

    def run(self, p: Problem) -> AttentionOutput:
        """Decode ``p``: at most ``MAX_ROWS`` query rows against the keys. Calls the fused engine
        cannot serve (a bias or mask that needs the loop engine) and empty calls run as ``tiled``.

        Raises:
            ValueError: if the weights are requested, or the call has more than ``MAX_ROWS`` query rows
                (a prefill, not a decode step).
        """
        if p.return_weights:
            raise ValueError("backend 'decode' cannot return the attention weights; use backend='matrix'")
        if p.Nq > MAX_ROWS:
            raise ValueError(
                f"backend 'decode' serves decode steps of at most {MAX_ROWS} query rows, this call has "
                f"Nq={p.Nq}; use backend='auto' (it picks decode for decode steps and a prefill kernel "
                "otherwise) or backend='tiled'"
            )
        if p.Nq == 0 or fused.why_not_fused(p) is not None:
            return tiled.BACKEND.run(p)
        if not p.needs_grad and p.D == p.Dv and _sees_every_key(p):
            with torch.no_grad():
                return _all_keys(p)
        plan = self.plan(p)
        if p.needs_grad:
            out, lse = fused.run_fused(p, plan)
        else:
            with torch.no_grad():
                out, lse = _forward_split(p, plan)
        return AttentionOutput(out, None, lse if p.return_lse else None)


def _sees_every_key(p: Problem) -> bool:
    """True when every query row attends to every key: no bias and no mask, or a causal mask with one
    query row (bottom-right aligned, the newest token sees the whole cache) - a plain cached decode step,
    served without planning."""
    if p.bias is not None:
        return False
    return p.mask is None or (type(p.mask) is Causal and p.Nq == 1)


def _all_keys(p: Problem) -> AttentionOutput:
    """Every row against every key: groups folded into rows, the cache cut into chunks when that keeps
    more cores busy, one kernel call."""
    B, Hkv, G, Nq, D = p.B, p.Hkv, p.G, p.Nq, p.D
    n = n_chunks(p, p.Nk)
    if n > 1:
        o, lse = _chunked(p, 0, p.Nk // n, n)  # (B, Hq, Nq, D), (B, Hq, Nq) over the first n*c keys
        if p.Nk % n:
            o, lse = _merge_tail(p, o, lse, (p.Nk // n) * n)
        o, lse = _with_sinks(p, o, lse)
        return AttentionOutput(o.to(p.dtype), None, lse if p.return_lse else None)
    # with sinks the kernel's output is merged once more: half inputs then run in fp32 (one rounding)
    work = acc_dtype(p.dtype) if p.sinks is not None else p.dtype
    q = p.q.to(work).contiguous().view(B, Hkv, G * Nq, D)  # (B, Hkv, G*Nq, D): groups folded into rows
    k, v = _rows(p.k.to(work)), _rows(p.v.to(work))  # a cache's view, read in place
    o, lse = fused.FLASH_FWD(q, k, v, 0.0, False, scale=p.scale)  # (B, Hkv, G*Nq, D), (B, Hkv, G*Nq)
    o = o.reshape(B, p.Hq, Nq, D)  # unfold
    lse = lse.reshape(B, p.Hq, Nq).to(acc_dtype(p.dtype))  # unfold
    if p.sinks is not None:
        o, lse = _with_sinks(p, o.to(lse.dtype), lse)
        o = o.to(p.dtype)
    return AttentionOutput(o, None, lse if p.return_lse else None)


def unmasked_step(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor | None:
    """A decode step with no mask and no bias straight from tensors (no Problem, no backend choice), for
    callers that already know every query row sees every key (``multihead.hf``'s attention function):
    the G query heads of a kv head folded into its rows, as in :func:`_all_keys`, and one torch SDPA call
    (its fused flash kernel on CPU, the kernel :func:`_all_keys` calls). None when the step needs the
    general path: a cache long enough that splitting it over the cores pays off (:func:`n_chunks`), more
    than ``MAX_ROWS`` rows, no keys, or head counts that do not group.

    Args:
        q: (B, Hq, Nq, D) queries.
        k: (B, Hkv, Nk, D) keys, ``Hq % Hkv == 0``.
        v: (B, Hkv, Nk, Dv) values.
        scale: score scale (None: 1/sqrt(D)).

    Returns:
        out (B, Hq, Nq, Dv) in q's dtype, or None.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if not 0 < Nq <= MAX_ROWS or Nk == 0 or Hkv == 0 or Hq % Hkv or k.shape[0] != B or v.shape[0] != B:
        return None
    if Nk >= 2 * MIN_CHUNK and _lanes_split(B * Hkv, Nk) > 1:
        return None
    G = Hq // Hkv
    if G == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)  # (B, Hq, Nq, Dv)
    qg = q.reshape(B, Hkv, G * Nq, D)  # (B, Hkv, G*Nq, D): groups folded into rows
    o = F.scaled_dot_product_attention(qg, k, v, scale=scale)  # (B, Hkv, G*Nq, Dv)
    return o.reshape(B, Hq, Nq, o.shape[-1])  # unfold


def _rows(t: Tensor) -> Tensor:
    """t itself when its last dim is contiguous - the kernel takes any other strides, so the view of
    the first L positions of a preallocated KV cache is read in place - else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _with_sinks(p: Problem, o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """(o, lse) of every key with ``p``'s sinks merged in (unchanged without sinks)."""
    return (o, lse) if p.sinks is None else add_sink(o, lse, p.sinks)


def _merge_tail(p: Problem, o: Tensor, lse: Tensor, k0: int) -> tuple[Tensor, Tensor]:
    """Merge keys ``k0:`` (the remainder after equal chunks) into (o, lse) by log-sum-exp."""
    B, Hkv, G, Nq, D = p.B, p.Hkv, p.G, p.Nq, p.D
    q = p.q.contiguous().view(B, Hkv, G * Nq, D)  # (B, Hkv, G*Nq, D)
    k, v = p.k[:, :, k0:].contiguous(), p.v[:, :, k0:].contiguous()  # (B, Hkv, tail, D)
    o2, lse2 = fused.FLASH_FWD(q, k, v, 0.0, False, scale=p.scale)  # (B, Hkv, G*Nq, D), (B, Hkv, G*Nq)
    o2 = o2.reshape(B, p.Hq, Nq, D).to(o.dtype)  # unfold
    lse2 = lse2.reshape(B, p.Hq, Nq).to(lse.dtype)  # unfold
    return merge_partials(o, lse, o2, lse2)  # (B, Hq, Nq, D), (B, Hq, Nq)


def n_chunks(p: Problem, length: int) -> int:
    """How many chunks to cut a span of ``length`` keys into so every core has a (B, kv head) to work on."""
    return _lanes_split(p.B * p.Hkv, length)


def _lanes_split(lanes: int, length: int) -> int:
    threads = torch.get_num_threads()
    n = 1
    while lanes * n < 2 * threads and length // (2 * n) >= MIN_CHUNK:
        n *= 2
    return n


def _forward_split(p: Problem, plan: list[Piece]) -> tuple[Tensor, Tensor]:
    """The fused forward, with the long unmasked span cut into chunks that run side by side (the sinks
    merged in once: by ``fused.forward`` when it runs, else here)."""
    big = [pc for pc in plan if pc.kind == "full" and pc.nb == 1 and n_chunks(p, pc.k1 - pc.k0) > 1]
    if not big or p.D != p.Dv:
        return fused.forward(p, plan)
    pc = big[0]
    n = n_chunks(p, pc.k1 - pc.k0)
    c = (pc.k1 - pc.k0) // n
    rest = [x for x in plan if x is not pc]
    if pc.k0 + n * c < pc.k1:
        rest.append(Piece(pc.r0, pc.bq, 1, pc.k0 + n * c, pc.k1, "full"))
    o, lse = _chunked(p, pc.k0, c, n)  # (B, Hq, Nq, Dv), (B, Hq, Nq)
    if not rest:
        o, lse = _with_sinks(p, o, lse)
        return o.to(p.dtype), lse
    o2, lse2 = fused.forward(p, rest)  # the sinks come in with this partial
    out, lse = merge_partials(o, lse, o2, lse2)  # (B, Hq, Nq, Dv), (B, Hq, Nq)
    return out.to(p.dtype), lse


def _chunked(p: Problem, k0: int, c: int, n: int) -> tuple[Tensor, Tensor]:
    """Every query row against keys ``k0 : k0 + n*c`` as n chunks of c keys, one kernel call, merged."""
    B, Hkv, G, Nq, D, Nk = p.B, p.Hkv, p.G, p.Nq, p.D, p.Nk
    k, v = p.k.contiguous(), p.v.contiguous()
    shape, strides = (B * Hkv, n, c, D), (Nk * D, c * D, D, 1)
    kc = k.as_strided(shape, strides, k.storage_offset() + k0 * D)  # (B*Hkv, n, c, D): chunks as heads
    vc = v.as_strided(shape, strides, v.storage_offset() + k0 * D)  # (B*Hkv, n, c, D), no copy
    q = p.q.reshape(B * Hkv, 1, G * Nq, D).expand(B * Hkv, n, G * Nq, D).contiguous()  # (B*Hkv, n, G*Nq, D)
    o, lse = fused.FLASH_FWD(q, kc, vc, 0.0, False, scale=p.scale)
    acc = acc_dtype(p.dtype)
    o = o.reshape(B, Hkv, n, G * Nq, D).to(acc)  # (B, Hkv, n, G*Nq, D)
    lse = lse.reshape(B, Hkv, n, G * Nq).to(acc)  # (B, Hkv, n, G*Nq)
    total = torch.logsumexp(lse, dim=2)  # (B, Hkv, G*Nq)
    out = (o * torch.exp(lse - total.unsqueeze(2)).unsqueeze(-1)).sum(2)  # (B, Hkv, G*Nq, D)
    return out.reshape(B, p.Hq, Nq, D), total.reshape(B, p.Hq, Nq)  # unfold


BACKEND = DecodeBackend()
