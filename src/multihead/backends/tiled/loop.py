"""The portable loop engine of ``tiled``: online softmax over tiles in torch ops, O(N) extra memory.

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Nq, Nk, D, Dv; a tile covers rows
q0:q1 and keys k0:k1 (nq, nk); the G query heads of a kv head are folded into the rows: (B, Hkv, G*nq, .).

For each block of query rows we stream over blocks of keys, keeping the running row maximum ``m``,
the running denominator ``l`` and the unnormalised output ``o`` (Milakov & Gimelshein 2018; Dao et al.
FlashAttention 2022). Per key block j:

    s_j     = mod(q k_j^T * scale), masked to -inf       (bias / soft-cap / mask, one tile at a time)
    m'      = max(m, rowmax(s_j))
    l       = l * exp(m - m') + rowsum(exp(s_j - m'))
    o       = o * exp(m - m') + exp(s_j - m') v_j
    out     = o / l,  lse = m + log(l)

Attention sinks are merged into each finished row block as one more partial (lse ``sink_h``, output
0; :func:`multihead.core.numerics.add_sink`), in the accumulation dtype.

The tiles come classified from the problem's grid: EMPTY tiles are skipped, FULL tiles need no
per-element mask. This engine serves what the fused engine (:mod:`.fused`) cannot: dropout,
soft-capping, gradients into a tensor bias, non-CPU devices (:mod:`.backend` chooses).

GQA: no repeated K/V. The backward recomputes each tile from the saved log-sum-exp (FlashAttention-2):

    P = exp(s - lse), dV += P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ += dS K, dK += dS^T Q

with the same tile skipping; with sinks ``lse`` includes them and the sinks get
``-sum exp(sink - lse) * rowsum(dO * O)``. Extra memory is O(B * H * (Nq + Nk) * D) plus one tile.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from ...core.biases import TensorBias, bias_parts
from ...core.masks import EMPTY, FULL
from ...core.numerics import acc_dtype, add_sink, sink_grad
from ...core.problem import Problem
from ...core.tiles import Grid
from ..dense import modify_scores
from .fused import keeps_acc_output

__all__ = ["run_loop"]


@dataclass
class _Plan:
    """Everything a tile of the loop engine needs besides q, k, v (shared by the forward and backward)."""

    p: Problem
    grid: Grid
    seed: int

    def tiles_q(self):
        """(index, (q0, q1)) of every query block."""
        e = self.grid.q_edges
        yield from enumerate(itertools.pairwise(e))

    def tiles_k(self):
        """(index, (k0, k1)) of every key block."""
        e = self.grid.k_edges
        yield from enumerate(itertools.pairwise(e))

    def tile_mask(self, i: int, j: int) -> Tensor | bool | None:
        """None: tile full (no per-element mask); False: tile empty (skip); else bool (B|1, H|1, nq, nk)."""
        kind = int(self.grid.kinds[i, j])
        if self.p.mask is None or kind == FULL:
            return None
        if kind == EMPTY:
            return False
        (q0, q1), (k0, k1) = self.grid.q_edges[i : i + 2], self.grid.k_edges[j : j + 2]
        return self.p.mask.block(self.p.ctx, (q0, q1), (k0, k1), self.p.q.device)

    def keep(self, shape, tile_id: int, device) -> Tensor:
        """Dropout keep-mask of one tile, reproducible in the backward from (seed, tile_id)."""
        g = torch.Generator(device=device)
        g.manual_seed(self.seed + tile_id)
        return torch.rand(shape, generator=g, device=device) >= self.p.dropout_p


def _scores(plan: _Plan, qb: Tensor, kb: Tensor, q0, q1, k0, k1, allowed, leaves=None):
    """Scores of one tile from qb (B, Hkv, G*nq, D), kb (B, Hkv, nk, D): (raw, modified, modified folded).

    raw (B, Hq, nq, nk) is a fresh leaf when ``leaves`` is given; modified = bias, then mask (-inf), as
    (B, Hq, nq, nk) and folded (B, Hkv, G*nq, nk). The backward differentiates modified w.r.t. raw and
    the leaves; masked entries have P = 0 and so dS = 0, so the mask adds nothing to those gradients.
    """
    p = plan.p
    nq, nk = q1 - q0, k1 - k0
    s = torch.matmul(qb, kb.transpose(-1, -2)) * p.scale  # (B, Hkv, G*nq, nk)
    s4 = s.view(p.B, p.Hq, nq, nk)  # (B, Hq, nq, nk): heads (Hkv, G) are adjacent
    if leaves is not None:
        s4 = s4.detach().requires_grad_(True)
    s_mod = modify_scores(s4, p, (q0, q1), (k0, k1), allowed=allowed, leaves=leaves)  # (B, Hq, nq, nk)
    return s4, s_mod, s_mod.reshape(p.B, p.Hkv, p.G * nq, nk)  # (B, Hkv, G*nq, nk)


def _q_block(p: Problem, t: Tensor, q0: int, q1: int, acc) -> Tensor:
    """Rows q0:q1 of a (B, Hq, Nq, X) tensor, groups folded: (B, Hkv, G*nq, X)."""
    x = t.shape[-1]
    return t[:, :, q0:q1].to(acc).reshape(p.B, p.Hkv, p.G * (q1 - q0), x)  # (B, Hkv, G*nq, X)


def _forward(
    plan: _Plan, q: Tensor, k: Tensor, v: Tensor, out_dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """The online softmax over the plan's non-empty tiles: out (B, Hq, Nq, Dv) in ``out_dtype`` (default
    the input dtype), lse (B, Hq, Nq)."""
    p = plan.p
    acc = acc_dtype(p.dtype)
    out = torch.empty(p.B, p.Hq, p.Nq, p.Dv, dtype=out_dtype or p.dtype, device=q.device)
    lse = torch.empty(p.B, p.Hq, p.Nq, dtype=acc, device=q.device)
    n_kb = len(plan.grid.k_edges) - 1
    for qi, (q0, q1) in plan.tiles_q():
        nq = q1 - q0
        qb = _q_block(p, q, q0, q1, acc)  # (B, Hkv, G*nq, D)
        m = torch.full((p.B, p.Hkv, p.G * nq, 1), float("-inf"), dtype=acc, device=q.device)
        l = torch.zeros_like(m)
        o = torch.zeros(p.B, p.Hkv, p.G * nq, p.Dv, dtype=acc, device=q.device)
        for ki, (k0, k1) in plan.tiles_k():
            allowed = plan.tile_mask(qi, ki)
            if allowed is False:
                continue
            _, _, s = _scores(plan, qb, k[:, :, k0:k1].to(acc), q0, q1, k0, k1, allowed)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # (B, Hkv, G*nq, 1)
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            pt = torch.exp(s - m_safe)  # (B, Hkv, G*nq, nk)
            alpha = torch.exp(m - m_safe)
            l = l * alpha + pt.sum(dim=-1, keepdim=True)
            if p.dropout_p > 0.0:
                pt = pt * plan.keep(pt.shape, qi * n_kb + ki, q.device) / (1.0 - p.dropout_p)
            o = o * alpha + torch.matmul(pt, v[:, :, k0:k1].to(acc))  # (B, Hkv, G*nq, Dv)
            m = m_new
        has = l > 0
        o = torch.where(has, o / torch.where(has, l, torch.ones_like(l)), torch.zeros_like(o))
        o4 = o.view(p.B, p.Hq, nq, p.Dv)  # (B, Hq, nq, Dv)
        l4 = (m + torch.log(l)).view(p.B, p.Hq, nq)  # (B, Hq, nq): -inf on empty rows
        if p.sinks is not None:
            o4, l4 = add_sink(o4, l4, p.sinks)  # empty rows: output 0, lse = sink
        out[:, :, q0:q1] = o4.to(out.dtype)
        lse[:, :, q0:q1] = l4
    return out, lse


def _backward(plan: _Plan, q, k, v, out, lse, dout, bias_tensors):
    """Gradients (dq, dk, dv, d sinks or None, [d bias tensor or None]) recomputed tile by tile from the
    saved lse (sinks included)."""
    p = plan.p
    acc = acc_dtype(p.dtype)
    dq = torch.zeros(p.B, p.Hq, p.Nq, p.D, dtype=acc, device=q.device)
    dk = torch.zeros(p.B, p.Hkv, p.Nk, p.D, dtype=acc, device=q.device)
    dv = torch.zeros(p.B, p.Hkv, p.Nk, p.Dv, dtype=acc, device=q.device)
    tensor_biases = [part for part in bias_parts(p.bias) if isinstance(part, TensorBias)]
    dbias = [
        tb.t4(p.ctx).new_zeros(tb.t4(p.ctx).shape, dtype=acc) if tb.t.requires_grad else None
        for tb in tensor_biases
    ]
    local_grad = p.bias is not None and (not p.bias.is_additive or any(d is not None for d in dbias))
    delta = (dout.to(acc) * out.to(acc)).sum(dim=-1)  # (B, Hq, Nq)
    lse_safe = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    n_kb = len(plan.grid.k_edges) - 1
    for qi, (q0, q1) in plan.tiles_q():
        nq = q1 - q0
        qb = _q_block(p, q, q0, q1, acc)  # (B, Hkv, G*nq, D)
        dob = _q_block(p, dout, q0, q1, acc)  # (B, Hkv, G*nq, Dv)
        lse_b = lse_safe[:, :, q0:q1].reshape(p.B, p.Hkv, p.G * nq, 1)  # (B, Hkv, G*nq, 1)
        delta_b = delta[:, :, q0:q1].reshape(p.B, p.Hkv, p.G * nq, 1)  # (B, Hkv, G*nq, 1)
        dqb = torch.zeros_like(qb)
        for ki, (k0, k1) in plan.tiles_k():
            allowed = plan.tile_mask(qi, ki)
            if allowed is False:
                continue
            kb, vb = k[:, :, k0:k1].to(acc), v[:, :, k0:k1].to(acc)
            leaves: list[Tensor] | None = [] if local_grad else None
            with torch.enable_grad() if local_grad else torch.no_grad():
                s_in, s_mod, s = _scores(plan, qb, kb, q0, q1, k0, k1, allowed, leaves)
            pt = torch.exp(s.detach() - lse_b)  # (B, Hkv, G*nq, nk)
            if p.dropout_p > 0.0:
                keep = plan.keep(pt.shape, qi * n_kb + ki, q.device) / (1.0 - p.dropout_p)
                dv[:, :, k0:k1] += torch.matmul((pt * keep).transpose(-1, -2), dob)  # (B, Hkv, nk, Dv)
                dp = torch.matmul(dob, vb.transpose(-1, -2)) * keep  # (B, Hkv, G*nq, nk)
            else:
                dv[:, :, k0:k1] += torch.matmul(pt.transpose(-1, -2), dob)  # (B, Hkv, nk, Dv)
                dp = torch.matmul(dob, vb.transpose(-1, -2))  # (B, Hkv, G*nq, nk)
            ds = pt * (dp - delta_b)  # (B, Hkv, G*nq, nk)
            if local_grad:
                assert leaves is not None
                ds4 = ds.view(s_mod.shape)  # (B, Hq, nq, nk)
                grads = torch.autograd.grad(s_mod, [s_in, *leaves], ds4, allow_unused=True)
                g0 = grads[0]
                ds = g0.reshape(ds.shape) if g0 is not None else torch.zeros_like(ds)  # (B, Hkv, G*nq, nk)
                _accumulate_bias(dbias, grads[1:], q0, q1, k0, k1)
            ds = ds * p.scale
            dqb += torch.matmul(ds, kb)  # (B, Hkv, G*nq, D)
            dk[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), qb)  # (B, Hkv, nk, D)
        dq[:, :, q0:q1] = dqb.view(p.B, p.Hq, nq, p.D)  # (B, Hq, nq, D)
    dbias_out = [
        None if g is None else g.reshape(t.shape).to(t.dtype)  # each bias tensor's own shape
        for g, t in zip(dbias, bias_tensors)
    ]
    dsinks = None if p.sinks is None else sink_grad(p.sinks, lse, delta)  # (Hq,)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, dbias_out


def _accumulate_bias(dbias, grads, q0, q1, k0, k1) -> None:
    """Add one tile's bias-leaf gradients into the full-size accumulators (broadcast dims stay 1)."""
    it = iter(grads)
    for d in dbias:
        if d is None:
            continue
        g = next(it)
        if g is None:
            continue
        qs = slice(q0, q1) if d.shape[2] > 1 else slice(0, 1)
        ks = slice(k0, k1) if d.shape[3] > 1 else slice(0, 1)
        d[:, :, qs, ks] += g.to(d.dtype)  # g has the tile's natural shape


class _TiledAttention(torch.autograd.Function):
    """The loop engine under autograd (tensor-bias gradients enter as extra inputs)."""

    @staticmethod
    def forward(ctx, plan: _Plan, q, k, v, sinks, *bias_tensors):
        keep = keeps_acc_output(plan.p)
        out, lse = _forward(plan, q, k, v, acc_dtype(q.dtype) if keep else None)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse, *bias_tensors)  # out unrounded with sinks on half inputs
        ctx.mark_non_differentiable(lse)
        return (out.to(q.dtype) if keep else out), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *bias_tensors = ctx.saved_tensors
        dq, dk, dv, dsinks, dbias = _backward(ctx.plan, q, k, v, out, lse, dout, bias_tensors)
        return (None, dq, dk, dv, dsinks, *dbias)


def run_loop(p: Problem, grid: Grid) -> tuple[Tensor, Tensor]:
    """Run ``p`` tile by tile over ``grid``, under autograd when ``p`` needs gradients (tensor biases and
    sinks that require grad get theirs): out (B, Hq, Nq, Dv) in the input dtype, lse (B, Hq, Nq) fp32/fp64."""
    seed = int(torch.randint(0, 2**62, (1,)).item()) if p.dropout_p > 0 else 0
    plan = _Plan(p, grid, seed)
    if p.needs_grad:
        bias_tensors = [part.t for part in bias_parts(p.bias) if isinstance(part, TensorBias)]
        return _TiledAttention.apply(plan, p.q, p.k, p.v, p.sinks, *bias_tensors)
    with torch.no_grad():
        return _forward(plan, p.q, p.k, p.v)
