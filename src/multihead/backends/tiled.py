"""``tiled``: the project's own kernel - online softmax over key blocks, O(N) extra memory.

For each block of query rows we stream over blocks of keys, keeping the running row maximum ``m``,
the running denominator ``l`` and the unnormalised output ``o`` (Milakov & Gimelshein 2018; Dao et al.
FlashAttention 2022). Per key block j:

    s_j     = mod(q k_j^T * scale), masked to -inf       (bias / soft-cap / mask, one tile at a time)
    m'      = max(m, rowmax(s_j))
    l       = l * exp(m - m') + rowsum(exp(s_j - m'))
    o       = o * exp(m - m') + exp(s_j - m') v_j
    out     = o / l,  lse = m + log(l)

Tiles the mask empties are skipped; tiles it fills skip the per-element mask. GQA: the G query heads of a
kv head are folded into the row dimension, so every tile is one matmul against the un-repeated K/V.
The backward recomputes each tile from the saved log-sum-exp (FlashAttention-2):

    P = exp(s - lse), dV += P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ += dS K, dK += dS^T Q

Extra memory is O(B * H * (Nq + Nk) * D) plus one tile. Scores, softmax statistics and P @ V are kept in
fp32 for half inputs (float64 stays float64). This is the first, correct version; its speed is the job of
the kernels issue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..biases import Bias, CustomBias, TensorBias, _Chain
from ..masks import index_grid
from ..problem import AttentionOutput, Problem

BLOCK_Q = 256
BLOCK_K = 256


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class _Plan:
    """Everything a tile needs besides q, k, v (shared by the forward and backward)."""

    p: Problem
    block_q: int
    block_k: int
    seed: int

    def tiles_k(self):
        for k0 in range(0, self.p.Nk, self.block_k):
            yield k0, min(k0 + self.block_k, self.p.Nk)

    def tile_mask(self, q0: int, q1: int, k0: int, k1: int) -> Tensor | bool | None:
        """None: tile full (no per-element mask); False: tile empty (skip); else bool (B|1, H|1, nq, nk)."""
        if self.p.mask is None:
            return None
        allowed = self.p.mask.block(self.p.ctx, (q0, q1), (k0, k1), self.p.q.device)
        if not bool(allowed.any()):
            return False
        if bool(allowed.all()):
            return None
        return allowed

    def keep(self, shape, tile_id: int, device) -> Tensor:
        """Dropout keep-mask of one tile, reproducible in the backward from (seed, tile_id)."""
        g = torch.Generator(device=device)
        g.manual_seed(self.seed + tile_id)
        return torch.rand(shape, generator=g, device=device) >= self.p.dropout_p


def _bias_parts(bias: Bias | None) -> list[Bias]:
    if bias is None:
        return []
    return bias.parts if isinstance(bias, _Chain) else [bias]


def _modify(s4: Tensor, plan: _Plan, q0, q1, k0, k1, leaves: list[Tensor] | None) -> Tensor:
    """Apply the bias chain to one tile of scores (B, Hq, nq, nk).

    With ``leaves`` given, each grad-requiring tensor bias enters as a fresh leaf holding just this tile,
    so the backward can take its gradient without touching the full (.., Nq, Nk) tensor.
    """
    ctx = plan.p.ctx
    b, h, q, k = index_grid(ctx, (q0, q1), (k0, k1), s4.device)
    for part in _bias_parts(plan.p.bias):
        if leaves is not None and isinstance(part, TensorBias) and part.t.requires_grad:
            val = part.values(b, h, q, k, ctx).detach().to(s4.dtype).requires_grad_(True)
            leaves.append(val)
            s4 = s4 + val
        else:
            s4 = part.apply(s4, b, h, q, k, ctx)
    return s4


def _scores(plan: _Plan, qb: Tensor, kb: Tensor, q0, q1, k0, k1, allowed, leaves=None):
    """Masked, modified scores of one tile: qb (B, Hkv, G*nq, D), kb (B, Hkv, nk, D)."""
    p = plan.p
    nq, nk = q1 - q0, k1 - k0
    s = torch.matmul(qb, kb.transpose(-1, -2)) * p.scale  # (B, Hkv, G*nq, nk)
    s4 = s.view(p.B, p.Hq, nq, nk)  # (B, Hq, nq, nk): heads (Hkv, G) are adjacent
    if leaves is not None:
        s4 = s4.detach().requires_grad_(True)
    s_in = s4
    if p.bias is not None:
        s4 = _modify(s4, plan, q0, q1, k0, k1, leaves)
    s_mod = s4
    if allowed is not None:
        s4 = s4.masked_fill(~allowed, float("-inf"))
    return s_in, s_mod, s4.reshape(p.B, p.Hkv, p.G * nq, nk)  # (B, Hkv, G*nq, nk)


def _q_block(p: Problem, t: Tensor, q0: int, q1: int, acc) -> Tensor:
    """Rows q0:q1 of a (B, Hq, Nq, X) tensor, groups folded: (B, Hkv, G*nq, X)."""
    x = t.shape[-1]
    return t[:, :, q0:q1].to(acc).reshape(p.B, p.Hkv, p.G * (q1 - q0), x)  # (B, Hkv, G*nq, X)


def _forward(plan: _Plan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    p = plan.p
    acc = _acc(p.dtype)
    out = torch.empty(p.B, p.Hq, p.Nq, p.Dv, dtype=p.dtype, device=q.device)
    lse = torch.empty(p.B, p.Hq, p.Nq, dtype=acc, device=q.device)
    n_kb = -(-p.Nk // plan.block_k)
    for qi, q0 in enumerate(range(0, p.Nq, plan.block_q)):
        q1 = min(q0 + plan.block_q, p.Nq)
        nq = q1 - q0
        qb = _q_block(p, q, q0, q1, acc)  # (B, Hkv, G*nq, D)
        m = torch.full((p.B, p.Hkv, p.G * nq, 1), float("-inf"), dtype=acc, device=q.device)
        l = torch.zeros_like(m)
        o = torch.zeros(p.B, p.Hkv, p.G * nq, p.Dv, dtype=acc, device=q.device)
        for ki, (k0, k1) in enumerate(plan.tiles_k()):
            allowed = plan.tile_mask(q0, q1, k0, k1)
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
        out[:, :, q0:q1] = o.view(p.B, p.Hq, nq, p.Dv).to(p.dtype)  # (B, Hq, nq, Dv)
        lse[:, :, q0:q1] = (m + torch.log(l)).view(p.B, p.Hq, nq)  # -inf on empty rows
    return out, lse


def _backward(plan: _Plan, q, k, v, out, lse, dout, bias_tensors):
    p = plan.p
    acc = _acc(p.dtype)
    dq = torch.zeros(p.B, p.Hq, p.Nq, p.D, dtype=acc, device=q.device)
    dk = torch.zeros(p.B, p.Hkv, p.Nk, p.D, dtype=acc, device=q.device)
    dv = torch.zeros(p.B, p.Hkv, p.Nk, p.Dv, dtype=acc, device=q.device)
    tensor_biases = [part for part in _bias_parts(p.bias) if isinstance(part, TensorBias)]
    dbias = [
        tb.t4(p.ctx).new_zeros(tb.t4(p.ctx).shape, dtype=acc) if tb.t.requires_grad else None
        for tb in tensor_biases
    ]
    local_grad = p.bias is not None and (not p.bias.is_additive or any(d is not None for d in dbias))
    delta = (dout.to(acc) * out.to(acc)).sum(dim=-1)  # (B, Hq, Nq)
    lse_safe = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    n_kb = -(-p.Nk // plan.block_k)
    for qi, q0 in enumerate(range(0, p.Nq, plan.block_q)):
        q1 = min(q0 + plan.block_q, p.Nq)
        nq = q1 - q0
        qb = _q_block(p, q, q0, q1, acc)  # (B, Hkv, G*nq, D)
        dob = _q_block(p, dout, q0, q1, acc)  # (B, Hkv, G*nq, Dv)
        lse_b = lse_safe[:, :, q0:q1].reshape(p.B, p.Hkv, p.G * nq, 1)  # (B, Hkv, G*nq, 1)
        delta_b = delta[:, :, q0:q1].reshape(p.B, p.Hkv, p.G * nq, 1)  # (B, Hkv, G*nq, 1)
        dqb = torch.zeros_like(qb)
        for ki, (k0, k1) in enumerate(plan.tiles_k()):
            allowed = plan.tile_mask(q0, q1, k0, k1)
            if allowed is False:
                continue
            kb, vb = k[:, :, k0:k1].to(acc), v[:, :, k0:k1].to(acc)
            leaves: list[Tensor] | None = [] if local_grad else None
            with torch.enable_grad() if local_grad else torch.no_grad():
                s_in, s_mod, s = _scores(plan, qb, kb, q0, q1, k0, k1, allowed, leaves)
            pt = torch.exp(s.detach() - lse_b)  # (B, Hkv, G*nq, nk)
            if p.dropout_p > 0.0:
                keep = plan.keep(pt.shape, qi * n_kb + ki, q.device) / (1.0 - p.dropout_p)
                dv[:, :, k0:k1] += torch.matmul((pt * keep).transpose(-1, -2), dob)
                dp = torch.matmul(dob, vb.transpose(-1, -2)) * keep  # (B, Hkv, G*nq, nk)
            else:
                dv[:, :, k0:k1] += torch.matmul(pt.transpose(-1, -2), dob)  # (B, Hkv, nk, Dv)
                dp = torch.matmul(dob, vb.transpose(-1, -2))  # (B, Hkv, G*nq, nk)
            ds = pt * (dp - delta_b)  # (B, Hkv, G*nq, nk)
            if local_grad:
                assert leaves is not None
                grads = torch.autograd.grad(s_mod, [s_in, *leaves], ds.view(s_mod.shape), allow_unused=True)
                ds = grads[0].reshape(ds.shape) if grads[0] is not None else torch.zeros_like(ds)
                _accumulate_bias(dbias, grads[1:], q0, q1, k0, k1)
            ds = ds * p.scale
            dqb += torch.matmul(ds, kb)  # (B, Hkv, G*nq, D)
            dk[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), qb)  # (B, Hkv, nk, D)
        dq[:, :, q0:q1] = dqb.view(p.B, p.Hq, nq, p.D)  # (B, Hq, nq, D)
    dbias_out = [None if g is None else g.reshape(t.shape).to(t.dtype) for g, t in zip(dbias, bias_tensors)]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias_out


def _accumulate_bias(dbias, grads, q0, q1, k0, k1) -> None:
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
    @staticmethod
    def forward(ctx, plan: _Plan, q, k, v, *bias_tensors):
        out, lse = _forward(plan, q, k, v)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse, *bias_tensors)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *bias_tensors = ctx.saved_tensors
        dq, dk, dv, dbias = _backward(ctx.plan, q, k, v, out, lse, dout, bias_tensors)
        return (None, dq, dk, dv, *dbias)


class TiledBackend:
    name = "tiled"
    summary = "own online-softmax kernel over (query block x key block) tiles; O(N) memory, skips empty tiles"

    def __init__(self, block_q: int = BLOCK_Q, block_k: int = BLOCK_K):
        self.block_q, self.block_k = block_q, block_k

    def why_not(self, p: Problem) -> str | None:
        if p.return_weights:
            return "the tiled kernel never materialises the weights"
        if torch.is_grad_enabled() and any(isinstance(b, CustomBias) for b in _bias_parts(p.bias)):
            return (
                "gradients into tensors a custom_bias fn captures cannot be routed through the tiled "
                "backward (only tensor biases are); run under torch.no_grad() or pass the tensor as bias="
            )
        return None

    def run(self, p: Problem) -> AttentionOutput:
        if p.return_weights:
            raise ValueError("backend 'tiled' cannot return the attention weights; use backend='matrix'")
        seed = int(torch.randint(0, 2**62, (1,)).item()) if p.dropout_p > 0 else 0
        plan = _Plan(p, self.block_q, self.block_k, seed)
        bias_tensors = [part.t for part in _bias_parts(p.bias) if isinstance(part, TensorBias)]
        if p.needs_grad:
            out, lse = _TiledAttention.apply(plan, p.q, p.k, p.v, *bias_tensors)
        else:
            with torch.no_grad():
                out, lse = _forward(plan, p.q, p.k, p.v)
        return AttentionOutput(out, None, lse if p.return_lse else None)


BACKEND = TiledBackend()
