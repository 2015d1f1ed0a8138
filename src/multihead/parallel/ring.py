"""Ring (context-parallel) attention: exact attention over a sequence split across the ranks of a group.

Each of the W ranks holds the queries, keys and values of its shard of the N positions (see
:mod:`multihead.parallel.layout`). The K/V shards travel around the ring, rank r sending to r+1 and
receiving from r-1; while shard ``src`` is being attended to, the next one is already in flight
(``isend``/``irecv`` posted before the compute, waited after). Rank r at step s holds shard
``src = (r - s) mod W`` and computes its queries against it with :func:`multihead.attention` (``auto``
picks ``tiled``, which skips the tiles a mask empties), giving a partial output ``o_s`` and its
log-sum-exp ``lse_s``. The partials merge exactly, in fp32 (float64 for float64 inputs):

    lse = logaddexp(lse, lse_s),    o = o * exp(lse_old - lse) + o_s * exp(lse_s - lse)

Masks and biases are evaluated at **global** positions: the pair (my queries, shard src) sees the user's
mask through a wrapper that maps local indices to global ones and passes the global context
(B, Hq, N, N), so ``causal``, ``sliding_window``, ``document``, ``alibi`` ... mean what they mean on
one process.

Attention sinks (gpt-oss) are one more term of the same merge, added once after the last step:
``lse = logaddexp(lse, sink_h)``, ``o = o * exp(lse_old - lse)``.

Backward (FlashAttention-2 style, no N x N and no other rank's activations kept): the K/V shards make the
same trip again; each rank recomputes ``P = exp(s - lse)`` against the saved global lse and output,
``dS = P * (dP - rowsum(dO * O))``, keeps dQ and adds its dK/dV contribution to an accumulator that
travels one step behind its K/V shard and ends at the shard's owner. The sinks' gradient,
``-sum exp(sink - lse) * rowsum(dO * O)`` over this rank's rows, is computed once from the final lse.

Per rank: O(N/W) memory (own q, k, v, out, two K/V shards in flight), (W-1)/W of the K/V sent per
call (2x that, plus the dK/dV, in the backward). The pieces (global-position masks, messaging, merge,
the per-step backward) live in :mod:`multihead.parallel.ring_parts`.

Shape legend: B batch, Hq query heads, Hkv kv heads, n local positions, N global positions, D, Dv.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.biases import Bias, as_bias
from ..core.functional import attention, backends
from ..core.masks import Mask, MaskContext, as_mask
from ..core.numerics import acc_dtype, add_sink_, merge_partials_, sink_grad
from ..core.problem import AttentionOutput, make_problem
from .comm import DEFAULT_TIMEOUT, all_gather_ints, check_timeout, resolve_group
from .layout import check_layout, ranges_from_lengths
from .ring_parts import Ring, backward_stats, step_backward

__all__ = ["ring_attention"]

_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 11, 12, 13, 14
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _ring_forward(ring: Ring, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """W steps: attend to the shard at hand while the next one arrives; merge. -> out, lse (B, Hq, n)."""
    acc = acc_dtype(q.dtype)
    o_acc = lse_acc = None
    k_s, v_s = k, v
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        posted = None
        if step < ring.world - 1:  # the next shard travels while this one is computed
            nsrc = (src - 1) % ring.world
            k_n, v_n = k.new_empty(ring.shape(k, nsrc)), v.new_empty(ring.shape(v, nsrc))
            posted = ring.post([(k_s, k_n, _TAG_K), (v_s, v_n, _TAG_V)], step, "K/V", nsrc)
        m, b = ring.modifiers(src, q.device)
        res = attention(q, k_s, v_s, mask=m, bias=b, scale=ring.scale, backend=ring.backend, return_lse=True)
        assert isinstance(res, AttentionOutput) and res.lse is not None
        if o_acc is None or lse_acc is None:  # the first partial becomes the accumulator (no copy in fp32)
            o_acc, lse_acc = res.out.to(acc), res.lse.to(acc)  # (B, Hq, n, Dv), (B, Hq, n)
        else:
            merge_partials_(o_acc, lse_acc, res.out, res.lse)
        del res
        if posted is not None:
            ring.finish(posted)
            k_s, v_s = k_n, v_n
    assert o_acc is not None and lse_acc is not None
    if ring.sinks is not None:
        add_sink_(o_acc, lse_acc, ring.sinks)  # the sinks: one more term of the merge, added once
    return o_acc.to(q.dtype), lse_acc


def _ring_backward(ring: Ring, q, k, v, out, lse, dout) -> tuple[Tensor, Tensor, Tensor]:
    """The K/V go round again; dQ stays, each shard's dK/dV travel one step behind it and end at home."""
    acc, W = acc_dtype(q.dtype), ring.world
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, Hq, n, D)
    lse, delta = backward_stats(out, lse, dout)  # (B, Hq, n) each
    k_s, v_s = k, v
    sent = None
    for step in range(W):
        src = (ring.rank - step) % W
        posted = None
        if step < W - 1:
            nsrc = (src - 1) % W
            k_n, v_n = k.new_empty(ring.shape(k, nsrc)), v.new_empty(ring.shape(v, nsrc))
            posted = ring.post([(k_s, k_n, _TAG_K), (v_s, v_n, _TAG_V)], step, "K/V", nsrc)
        if step > 0:  # the dK/dV of shard src, accumulated by the ranks that held it before
            dk_t = torch.empty(ring.shape(k, src), dtype=acc, device=k.device)
            dv_t = torch.empty(ring.shape(v, src), dtype=acc, device=v.device)
            incoming = ring.post([(None, dk_t, _TAG_DK), (None, dv_t, _TAG_DV)], step, "dK/dV", src)
        dk_s, dv_s = step_backward(ring, q, k_s, v_s, dout, lse, delta, src, dq)
        if step > 0:
            ring.finish(incoming)
            dk_t += dk_s
            dv_t += dv_s
        else:
            dk_t, dv_t = dk_s, dv_s
        if sent is not None:
            ring.finish(sent)
        if W > 1:  # pass it on; after the last step it reaches shard src's owner, rank + 1
            sent = ring.post(
                [(dk_t, None, _TAG_DK), (dv_t, None, _TAG_DV)], step, f"dK/dV of rank {src}", src
            )
        if posted is not None:
            ring.finish(posted)
            k_s, v_s = k_n, v_n
    if W > 1:
        dk_t = torch.empty(k.shape, dtype=acc, device=k.device)  # (B, Hkv, n, D): my own shard's, complete
        dv_t = torch.empty(v.shape, dtype=acc, device=v.device)  # (B, Hkv, n, Dv)
        ring.finish(ring.post([(None, dk_t, _TAG_DK), (None, dv_t, _TAG_DV)], W, "dK/dV", ring.rank))
        assert sent is not None
        ring.finish(sent)
    return dq.to(q.dtype), dk_t.to(k.dtype), dv_t.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ring: Ring, q, k, v, sinks):
        out, lse = _ring_forward(ring, q, k, v)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = _ring_backward(ctx.ring, q, k, v, out, lse, dout)
        dsinks = None
        if ctx.ring.sinks is not None and ctx.needs_input_grad[4]:
            acc = acc_dtype(q.dtype)
            delta = (dout.to(acc) * out.to(acc)).sum(dim=-1)  # (B, Hq, n): rowsum(dO * O), this rank's rows
            dsinks = sink_grad(ctx.ring.sinks, lse, delta)  # (Hq,): this rank's share
        return None, dq, dk, dv, dsinks


def _make_ring(q, k, v, mask, bias, scale, group, layout, backend, timeout, sinks=None) -> Ring:
    """Validate the call (locally, then the shapes every rank reports) and bundle it as a :class:`Ring`."""
    check_layout(layout)
    timeout = check_timeout(timeout)
    if backend == "sdpa" or (backend != "auto" and backend not in backends()):
        raise ValueError(
            f"ring_attention backend must be 'auto' or a backend that returns the log-sum-exp (tiled, "
            f"matrix, reference), got {backend!r}: the partial outputs merge through their lse"
        )
    p = make_problem(q, k, v, scale=scale, sinks=sinks)  # local shapes, dtypes, heads, scale, sinks
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"ring_attention is self-attention over one sharded sequence: q and k must hold the same "
            f"positions, got n={q.shape[2]} queries and {k.shape[2]} keys on this rank"
        )
    pg, rank, world = resolve_group(group)
    mine = [q.shape[2], p.B, p.Hq, p.Hkv, p.D, p.Dv, _DTYPES.index(q.dtype)]
    meta = all_gather_ints(mine, pg, timeout=timeout, what=f"ring_attention rank {rank}/{world}: shapes")
    if any(m[1:] != meta[0][1:] for m in meta):
        shapes = {
            r: f"B={m[1]} Hq={m[2]} Hkv={m[3]} D={m[4]} Dv={m[5]} {_DTYPES[m[6]]}" for r, m in enumerate(meta)
        }
        raise ValueError(
            f"ring_attention needs the same batch, heads, head dims and dtype on every rank, got {shapes}"
        )
    ranges = ranges_from_lengths([m[0] for m in meta], layout)
    N = sum(m[0] for m in meta)
    gctx = MaskContext(p.B, p.Hq, N, N)
    m = None if mask is None else as_mask(mask)
    b = None if bias is None else as_bias(bias)
    if m is not None:
        m.validate(gctx)
    if b is not None:
        b.validate(gctx)
        if any(t.requires_grad for t in b.tensors()):
            raise ValueError(
                "ring_attention routes gradients to q, k and v only, but the bias tensor requires grad; "
                "pass bias.detach(), or use a Bias such as mh.alibi(Hq)"
            )
    ring = Ring(pg, rank, world, ranges, m, b, p.scale, backend, timeout, gctx)
    ring.sinks = sinks
    return ring


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    bias: Bias | Tensor | None = None,
    scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    return_lse: bool = False,
    sinks: Tensor | None = None,
) -> Tensor | AttentionOutput:
    """Exact self-attention over a sequence sharded across the ranks of ``group``; forward and backward.

    Every rank calls it with its own shard (a collective, the backward too): the result on each rank is
    exactly the rows of ``mh.attention(Q, K, V, mask=..., bias=...)`` over the whole sequence that its
    queries hold.

    Args:
        q: (B, Hq, n, D) this rank's queries: its positions of the sequence, in ``layout`` order.
        k: (B, Hkv, n, D) this rank's keys (the same positions as q); ``Hq % Hkv == 0`` (GQA).
        v: (B, Hkv, n, Dv) this rank's values.
        mask: a :class:`Mask` or bool tensor over the **global** problem (B, Hq, N, N); True = may attend.
            Evaluated at global positions on every rank.
        bias: a :class:`Bias` or float tensor over (B, Hq, N, N) (ALiBi, soft-cap, ...), global positions.
            Gradients flow to q, k and v only: a tensor bias that requires grad is refused.
        scale: score scale, default ``1/sqrt(D)``.
        group: the process group (default: the whole world).
        layout: "contiguous" (rank r holds block r; shards may differ in length) or "zigzag" (rank r holds
            chunks r and 2W-1-r of 2W equal chunks: balanced causal work). Split a global tensor with
            :func:`multihead.parallel.shard`.
        backend: the per-step backend, "auto" (picks "tiled": it returns the lse and skips empty tiles),
            "tiled", "matrix" or "reference". The backward recomputes tile by tile (FlashAttention-2).
        timeout: seconds to wait for any one message before raising :class:`CommError`.
        return_lse: also return the (B, Hq, n) fp32 log-sum-exp of the global rows (sinks included).
        sinks: None or the (Hq,) attention-sink logits (as :func:`multihead.attention`), the same on
            every rank. Its gradient on each rank is the share of that rank's query rows: sum it over the
            group (``all_reduce``), as for any parameter every rank holds.

    Returns:
        out (B, Hq, n, Dv), or ``AttentionOutput(out, None, lse)`` with ``return_lse``.

    Raises:
        ValueError: bad local shapes or dtypes (as :func:`multihead.attention`), q and k holding different
            positions, shapes or dtypes that differ between ranks, shard lengths the layout cannot hold,
            masks/biases that do not fit (B, Hq, N, N), a grad-requiring tensor bias, an unknown layout or
            backend, a non-positive timeout, ``sinks`` that is not a floating (Hq,) tensor on q's device.
        CommError: a peer rank died or stalled (nothing is returned then).
        RuntimeError: torch.distributed is not initialised.
    """
    ring = _make_ring(q, k, v, mask, bias, scale, group, layout, backend, timeout, sinks)
    wrt = (q, k, v) if sinks is None else (q, k, v, sinks)
    if torch.is_grad_enabled() and any(t.requires_grad for t in wrt):
        out, lse = _RingAttention.apply(ring, q.contiguous(), k.contiguous(), v.contiguous(), sinks)
    else:
        with torch.no_grad():
            out, lse = _ring_forward(ring, q.contiguous(), k.contiguous(), v.contiguous())
    return AttentionOutput(out, None, lse) if return_lse else out
