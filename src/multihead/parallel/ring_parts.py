"""The pieces of one ring attention call (see :mod:`multihead.parallel.ring` for the algorithm).

- :class:`GlobalMask` / :class:`GlobalBias`: the user's mask or bias for one (query shard, key shard)
  pair, evaluated at global positions in the global context (B, Hq, N, N).
- :class:`Ring`: who holds which positions, and the timed point-to-point messages around the ring.
- :func:`step_backward`: one pair's FlashAttention-2 backward against the global lse.

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, n local positions, D, Dv.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor

from ..backends.dense import modify_scores
from ..core.biases import Bias
from ..core.masks import Mask, MaskContext
from ..core.numerics import acc_dtype
from ..core.problem import Problem
from .comm import irecv, isend, wait
from .layout import Ranges, positions

BLOCK = 256  # tile edge of the backward recomputation


class GlobalMask(Mask):
    """The user's mask for one (query shard, key shard) pair, evaluated at global positions."""

    def __init__(self, inner: Mask, qpos: Tensor, kpos: Tensor, gctx: MaskContext):
        self.inner, self.qpos, self.kpos, self.gctx = inner, qpos, kpos, gctx

    def evaluate(self, b, h, q, k, ctx):
        return self.inner.evaluate(b, h, self.qpos[q], self.kpos[k], self.gctx)

    def __repr__(self):
        return f"{self.inner!r} at global positions"


class GlobalBias(Bias):
    """The user's bias for one (query shard, key shard) pair, evaluated at global positions."""

    def __init__(self, inner: Bias, qpos: Tensor, kpos: Tensor, gctx: MaskContext):
        self.inner, self.qpos, self.kpos, self.gctx = inner, qpos, kpos, gctx
        self.is_additive = inner.is_additive

    def values(self, b, h, q, k, ctx):
        return self.inner.values(b, h, self.qpos[q], self.kpos[k], self.gctx)

    def apply(self, s, b, h, q, k, ctx):
        return self.inner.apply(s, b, h, self.qpos[q], self.kpos[k], self.gctx)

    def __repr__(self):
        return f"{self.inner!r} at global positions"


class Ring:
    """One ring_attention call: the group, who holds which positions, and the user's mask and bias."""

    def __init__(self, group, rank, world, ranges: list[Ranges], mask, bias, scale, backend, timeout, gctx):
        self.group, self.rank, self.world, self.ranges = group, rank, world, ranges
        self.mask, self.bias, self.scale, self.backend, self.timeout = mask, bias, scale, backend, timeout
        self.gctx = gctx
        self.sinks: Tensor | None = None  # (Hq,) attention sinks, merged once after the last step
        self._pos: dict[int, Tensor] = {}

    def pos(self, r: int, device) -> Tensor:
        """The global positions rank r holds, in its local order: (n_r,) int64."""
        if r not in self._pos:
            self._pos[r] = positions(self.ranges[r], device)  # (n_r,)
        return self._pos[r]

    def modifiers(self, src: int, device) -> tuple[Mask | None, Bias | None]:
        """The mask and bias for this rank's queries against rank src's keys, at global positions."""
        qpos, kpos = self.pos(self.rank, device), self.pos(src, device)
        m = None if self.mask is None else GlobalMask(self.mask, qpos, kpos, self.gctx)
        b = None if self.bias is None else GlobalBias(self.bias, qpos, kpos, self.gctx)
        return m, b

    def shape(self, t: Tensor, src: int) -> tuple[int, ...]:
        """Shape of rank src's shard of a (B, H, n, X) tensor like ``t``."""
        return (t.shape[0], t.shape[1], len(self.pos(src, t.device)), t.shape[3])

    def post(self, pairs: list[tuple[Tensor | None, Tensor | None, int]], step: int, what: str, src: int):
        """Send each first tensor to rank+1 and receive each second from rank-1 (either may be None)."""
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        works = []
        for send, recv, tag in pairs:
            if send is not None:
                works.append((isend(send, nxt, self.group, tag), send, f"send {what} to rank {nxt}"))
            if recv is not None:
                works.append(
                    (irecv(recv, prv, self.group, tag), recv, f"receive {what} of rank {src} from rank {prv}")
                )
        return step, works

    def finish(self, posted) -> None:
        """Wait for what :meth:`post` started; CommError (naming step, peer and message) on a timeout."""
        step, works = posted
        for work, _, desc in works:  # the tensor rides along so it outlives the transfer
            wait(
                work,
                timeout=self.timeout,
                what=f"ring_attention rank {self.rank}/{self.world} step {step + 1}: {desc}",
            )


def backward_stats(out: Tensor, lse: Tensor, dout: Tensor) -> tuple[Tensor, Tensor]:
    """What every step's backward needs from the merged forward: (lse, rowsum(dO * O)), both (B, Hq, n).

    Rows that no key reached get lse = +inf, so their P = exp(s - lse) is 0 and their gradients are zero.
    """
    acc = acc_dtype(out.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(dim=-1)  # (B, Hq, n)
    return torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse), delta


def step_backward(ring: Ring, q, k_s, v_s, dout, lse, delta, src: int, dq: Tensor) -> tuple[Tensor, Tensor]:
    """Add this rank's dQ against shard src to ``dq``; return its share of shard src's dK, dV.

    Recomputed tile by tile from the global lse (FlashAttention-2): P = exp(s - lse), dV = P^T dO,
    dP = dO V^T, dS = P * (dP - delta), dQ = dS K * scale, dK = dS^T Q * scale, with ``lse`` and
    ``delta`` from :func:`backward_stats`. Tiles the mask empties are skipped; a non-additive bias
    (soft-cap) is differentiated through autograd one tile at a time.
    """
    m, b = ring.modifiers(src, q.device)
    pair = Problem(q, k_s, v_s, m, b, ring.scale, 0.0, False, False)  # this rank's queries vs shard src
    B, Hq, n, D = q.shape
    Hkv, nk, Dv = k_s.shape[1], k_s.shape[2], v_s.shape[3]
    G, acc, bs = Hq // Hkv, acc_dtype(q.dtype), BLOCK
    ctx = pair.ctx  # (B, Hq, n, nk)
    dk = torch.zeros(B, Hkv, nk, D, dtype=acc, device=q.device)
    dv = torch.zeros(B, Hkv, nk, Dv, dtype=acc, device=q.device)
    autograd = b is not None and not b.is_additive
    for q0 in range(0, n, bs):
        q1 = min(q0 + bs, n)
        nq = q1 - q0
        qb = q[:, :, q0:q1].to(acc).reshape(B, Hkv, G * nq, D)  # (B, Hkv, G*nq, D): groups in rows
        dob = dout[:, :, q0:q1].to(acc).reshape(B, Hkv, G * nq, Dv)  # (B, Hkv, G*nq, Dv)
        lse_b = lse[:, :, q0:q1].reshape(B, Hkv, G * nq, 1)  # (B, Hkv, G*nq, 1)
        delta_b = delta[:, :, q0:q1].reshape(B, Hkv, G * nq, 1)  # (B, Hkv, G*nq, 1)
        for k0 in range(0, nk, bs):
            k1 = min(k0 + bs, nk)
            allowed = (
                None if m is None else m.block(ctx, (q0, q1), (k0, k1), q.device)
            )  # (B|1, Hq|1, nq, nkk)
            if allowed is not None and not bool(allowed.any()):
                continue
            kb, vb = k_s[:, :, k0:k1].to(acc), v_s[:, :, k0:k1].to(acc)  # (B, Hkv, nkk, D | Dv)
            s = (
                torch.matmul(qb, kb.transpose(-1, -2)).mul_(ring.scale).view(B, Hq, nq, k1 - k0)
            )  # (B, Hq, nq, nkk)
            with torch.enable_grad() if autograd else nullcontext():
                s_in = s.requires_grad_(autograd)
                s_mod = modify_scores(s_in, pair, (q0, q1), (k0, k1), allowed=allowed)  # (B, Hq, nq, nkk)
            pt = torch.exp(s_mod.detach().reshape(B, Hkv, G * nq, k1 - k0) - lse_b)  # (B, Hkv, G*nq, nkk)
            dv[:, :, k0:k1] += torch.matmul(pt.transpose(-1, -2), dob)  # (B, Hkv, nkk, Dv)
            ds = pt * (torch.matmul(dob, vb.transpose(-1, -2)) - delta_b)  # (B, Hkv, G*nq, nkk)
            if autograd:
                (g,) = torch.autograd.grad(s_mod, s_in, ds.view(s_mod.shape))  # ds as (B, Hq, nq, nkk)
                ds = g.reshape(ds.shape)  # (B, Hkv, G*nq, nkk)
            ds = ds * ring.scale
            dq[:, :, q0:q1] += torch.matmul(ds, kb).view(B, Hq, nq, D)  # (B, Hq, nq, D)
            dk[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), qb)  # (B, Hkv, nkk, D)
    return dk, dv
