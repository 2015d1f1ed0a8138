"""The fused engine: the tiled plan's pieces run on torch's fused CPU flash kernel, forward and backward.

Shape legend: B, Hq, Hkv, G = Hq // Hkv, Nq, Nk, D, Dv; X = max(D, Dv) the common head size; a piece
covers rows ``r0:r1`` and keys ``k0:k1`` (L = k1 - k0), a band nb blocks of bq rows.

Each :class:`~.plan.Piece` is one call of ``aten._scaled_dot_product_flash_attention_for_cpu``
(:data:`FLASH_FWD`, the kernel behind ``F.scaled_dot_product_attention`` on CPU), which returns the
piece's output and log-sum-exp; a row covered by several pieces is merged exactly by its log-sum-exp
(:class:`~.merge.Merger`).

GQA without repeated K/V: a rect piece over all query rows folds the G query heads of a kv head into the
row dimension (a free view); other rect pieces use the kernel's own grouping; a band runs one call per
group member g over strided views (B*Hkv, nb, ., D) of q, K and V, so nothing is copied.

Attention sinks are merged in last, as one more partial with lse ``sink_h`` and output 0.

Backward (FlashAttention-2): every piece is differentiated on its own with the *final* output and
log-sum-exp, ``P = exp(s - lse)``, ``dS = P * (dP - rowsum(dO * O))``; the pieces' dq, dk, dv add up.
With sinks the final lse includes them, so the same formula holds for the keys, and the sinks get
``-sum exp(sink - lse) * rowsum(dO * O)`` (:func:`multihead.core.numerics.sink_grad`).
Half-precision inputs run the backward in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...core.numerics import acc_dtype, sink_grad
from ...core.problem import Problem
from ..dense import modify_scores
from .merge import Merger
from .plan import Piece

__all__ = [
    "BAND_GRAD_BYTES",
    "FLASH_BWD",
    "FLASH_FWD",
    "backward",
    "forward",
    "keeps_acc_output",
    "piece_mask",
    "run_fused",
    "why_not_fused",
]

#: torch's fused CPU flash kernel (forward: out, lse) and its backward; None where this torch lacks them
FLASH_FWD: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_BWD: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


# A band's backward returns each block's dK/dV separately; cut it so those stay below this many bytes.
BAND_GRAD_BYTES = 64 << 20


def why_not_fused(p: Problem) -> str | None:
    """Why the fused piece engine cannot run ``p`` (the loop engine of :mod:`.loop` then does)."""
    if FLASH_FWD is None or FLASH_BWD is None:
        return "this torch has no CPU flash-attention kernel"
    if p.q.device.type != "cpu":
        return f"the fused piece engine runs on CPU, the tensors are on {p.q.device}"
    if p.dropout_p > 0.0:
        return "the CPU flash kernel has no dropout"
    if p.bias is not None and not p.bias.is_additive:
        return f"{p.bias!r} is not additive"
    if p.bias is not None and p.needs_grad and any(t.requires_grad for t in p.bias.tensors()):
        return "a tensor bias that requires grad gets its gradient from the loop engine"
    return None


def _operands(p: Problem, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v contiguous (optionally cast); zero-padded to one head size when D != Dv (the fused kernel
    needs equal sizes; zero features change neither the scores nor the kept output columns)."""
    q, k, v = (t if dtype is None else t.to(dtype) for t in (p.q, p.k, p.v))
    x = max(p.D, p.Dv)
    if p.D < x:
        q, k = (torch.nn.functional.pad(t, (0, x - p.D)) for t in (q, k))  # (.., x)
    if p.Dv < x:
        v = torch.nn.functional.pad(v, (0, x - p.Dv))  # (B, Hkv, Nk, x)
    return q.contiguous(), k.contiguous(), v.contiguous()


def _pad_last(t: Tensor, x: int) -> Tensor:
    return t if t.shape[-1] == x else torch.nn.functional.pad(t, (0, x - t.shape[-1]))


def piece_mask(p: Problem, pc: Piece, dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None]:
    """The additive mask of one block of a masked piece and its rows that see a key.

    Returns ``(mask (B|1, Hq|1, bq, L), has_key (B|1, Hq|1, bq) or None)``; (None, None) when unmasked.
    """
    if pc.kind != "masked":
        return None, None
    rows, keys = (pc.r0, pc.r0 + pc.bq), (pc.k0, pc.k1)
    zeros = torch.zeros(1, 1, pc.bq, pc.k1 - pc.k0, dtype=dtype, device=p.q.device)  # (1, 1, bq, L)
    allowed = None if p.mask is None else p.mask.block(p.ctx, rows, keys, p.q.device)  # (B|1, Hq|1, bq, L)
    m = modify_scores(zeros, p, rows, keys, allowed=allowed)  # (B|1, Hq|1, bq, L)
    if allowed is None:
        return m, None
    has_key = allowed.any(-1)  # (B|1, Hq|1, bq)
    return m, None if bool(has_key.all()) else has_key


def _fold_ok(p: Problem, pc: Piece, m: Tensor | None) -> bool:
    """A rect piece over every query row folds the G heads of a kv head into its rows (no K/V re-read)."""
    return (
        p.G > 1
        and pc.nb == 1
        and pc.r0 == 0
        and pc.r1 == p.Nq
        and pc.kind != "causal"
        and (m is None or m.shape[1] == 1)
    )


def _fold_mask(m: Tensor | None, G: int) -> Tensor | None:
    if m is None:
        return None
    b, _, nq, L = m.shape
    return m.unsqueeze(2).expand(b, 1, G, nq, L).reshape(b, 1, G * nq, L)  # (B|1, 1, G*nq, L)


def _group_mask(m: Tensor | None, p: Problem, g: int) -> Tensor | None:
    """Band mask for group member g: (B*Hkv | 1, 1, bq, L), broadcast over the band's blocks."""
    if m is None:
        return None
    if m.shape[1] > 1:
        m = m[:, g :: p.G]  # (B|1, Hkv, bq, L)
    if m.shape[0] == 1 and m.shape[1] == 1:
        return m
    return m.expand(p.B, p.Hkv, *m.shape[2:]).reshape(p.B * p.Hkv, 1, *m.shape[2:])  # (B*Hkv, 1, bq, L)


def band_view(t: Tensor, p: Problem, pc: Piece, heads_step: int, g: int, n: int, first: int) -> Tensor:
    """Strided (B*Hkv, nb, n, X) view of a contiguous (B, H, N, X) tensor: block j starts at row
    ``first + j * bq`` of head ``hkv * heads_step + g``. No copy."""
    N, X = t.shape[2], t.shape[3]
    strides = (heads_step * N * X, pc.bq * X, X, 1)
    return t.as_strided(
        (p.B * p.Hkv, pc.nb, n, X), strides, t.storage_offset() + (g * N + first) * X
    )  # (B*Hkv, nb, n, X)


def band_lse_view(t: Tensor, p: Problem, pc: Piece, g: int) -> Tensor:
    """Strided (B*Hkv, nb, bq) view of a contiguous (B, Hq, Nq) tensor."""
    N = t.shape[2]
    offset = t.storage_offset() + g * N + pc.r0
    return t.as_strided((p.B * p.Hkv, pc.nb, pc.bq), (p.G * N, pc.bq, 1), offset)  # (B*Hkv, nb, bq)


def forward(p: Problem, plan: list[Piece], out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Run every piece and merge (``p``'s sinks last): out (B, Hq, Nq, Dv) in ``out_dtype`` (default the
    input dtype), lse (B, Hq, Nq) fp32/fp64, sinks included."""
    acc = acc_dtype(p.dtype)
    ops, shared = {False: _operands(p)}, _shared_rows(p, plan)
    X = ops[False][0].shape[-1]  # the common head size
    merger = Merger(p, acc, X)
    for pc in plan:
        up = any(shared[pc.r0 : pc.r1])
        if up not in ops:
            ops[up] = _operands(p, acc)  # fp32 copies, made once
        q, k, v = ops[up]
        m, has = piece_mask(p, pc, acc)
        causal = pc.kind == "causal"
        rows = slice(pc.r0, pc.r1)
        if pc.nb > 1:
            for g in range(p.G):
                qg = band_view(q, p, pc, p.G, g, pc.bq, pc.r0)  # (B*Hkv, nb, bq, D)
                kg = band_view(k, p, pc, 1, 0, pc.k1 - pc.k0, pc.k0)  # (B*Hkv, nb, L, D)
                vg = band_view(v, p, pc, 1, 0, pc.k1 - pc.k0, pc.k0)  # (B*Hkv, nb, L, Dv)
                o, lse = FLASH_FWD(qg, kg, vg, 0.0, causal, attn_mask=_group_mask(m, p, g), scale=p.scale)
                # o stays (B*Hkv, nb, bq, Dv): the merger writes it through a view of its rows
                lse = lse.reshape(p.B, p.Hkv, pc.nb * pc.bq)  # (B, Hkv, rows)
                hk = _band_has_key(has, p, pc, g)
                merger.add(rows, slice(g, None, p.G), o, lse, hk, last=g == p.G - 1)
            continue
        ks, vs = k[:, :, pc.k0 : pc.k1], v[:, :, pc.k0 : pc.k1]  # (B, Hkv, L, D|Dv) views
        if _fold_ok(p, pc, m):
            qf = q.view(p.B, p.Hkv, p.G * p.Nq, X)  # (B, Hkv, G*Nq, D): groups folded into rows
            o, lse = FLASH_FWD(qf, ks, vs, 0.0, False, attn_mask=_fold_mask(m, p.G), scale=p.scale)
            o, lse = o.reshape(p.B, p.Hq, p.Nq, X), lse.reshape(p.B, p.Hq, p.Nq)  # unfold
        else:
            o, lse = FLASH_FWD(q[:, :, rows], ks, vs, 0.0, causal, attn_mask=m, scale=p.scale)
        merger.add(rows, slice(None), o, lse, has, last=True)
    return merger.result(out_dtype or p.dtype, p.Dv, p.sinks)


def _shared_rows(p: Problem, plan: list[Piece]) -> bytearray:
    """Rows covered by more than one piece, for half inputs only: those pieces run in fp32, so that no
    half-precision partial output is rounded before the merge (one rounding, like the matrix path).
    With sinks every row is merged with its sink, so every row counts as shared."""
    count = [0] * p.Nq
    if p.dtype not in (torch.float16, torch.bfloat16):
        return bytearray(p.Nq)
    if p.sinks is not None:
        return bytearray(b"\x01" * p.Nq)
    for pc in plan:
        for r in range(pc.r0, pc.r1):
            count[r] += 1
    return bytearray(c > 1 for c in count)


def _band_has_key(has: Tensor | None, p: Problem, pc: Piece, g: int) -> Tensor | None:
    """The shared block's has_key (B|1, Hq|1, bq) repeated over the band: (B|1, Hkv|1, nb*bq)."""
    if has is None:
        return None
    h = has[:, g :: p.G] if has.shape[1] > 1 else has
    return h.repeat(1, 1, pc.nb)  # (B|1, Hkv|1, nb*bq)


def backward(p: Problem, plan: list[Piece], out: Tensor, lse: Tensor, dout: Tensor):
    """Gradients (dq, dk, dv) in the input dtype from the saved output and log-sum-exp."""
    acc = acc_dtype(p.dtype)
    q, k, v = _operands(p, acc)
    X = q.shape[-1]  # the common head size
    o_, do = (_pad_last(t.to(acc), X).contiguous() for t in (out, dout))
    lse_s = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse).to(acc).contiguous()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for pc in plan:
        m, _ = piece_mask(p, pc, acc)
        causal, rows, keys = pc.kind == "causal", slice(pc.r0, pc.r1), slice(pc.k0, pc.k1)
        if pc.nb > 1:
            for sub in _sub_bands(p, pc, X):
                _band_backward(p, sub, (q, k, v, o_, do, lse_s), (dq, dk, dv), m, causal)
            continue
        if _fold_ok(p, pc, m):
            fold = (p.B, p.Hkv, p.G * p.Nq)
            g_q, g_k, g_v = FLASH_BWD(
                do.view(*fold, X), q.view(*fold, X), k[:, :, keys], v[:, :, keys],  # (B, Hkv, G*Nq | L, X)
                o_.view(*fold, X), lse_s.view(*fold), 0.0, False,  # (B, Hkv, G*Nq, X), (B, Hkv, G*Nq)
                attn_mask=_fold_mask(m, p.G), scale=p.scale,
            )  # fmt: skip
            dq += g_q.reshape(p.B, p.Hq, p.Nq, X)  # (B, Hq, Nq, D)
        else:
            g_q, g_k, g_v = FLASH_BWD(
                do[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], o_[:, :, rows],
                lse_s[:, :, rows], 0.0, causal, attn_mask=m, scale=p.scale,
            )  # fmt: skip
            dq[:, :, rows] += g_q
        dk[:, :, keys] += g_k
        dv[:, :, keys] += g_v
    return dq[..., : p.D].to(p.dtype), dk[..., : p.D].to(p.dtype), dv[..., : p.Dv].to(p.dtype)


def _sub_bands(p: Problem, pc: Piece, X: int) -> list[Piece]:
    """Cut a band into bands whose per-block K/V gradients (which overlap, so the kernel returns them
    unsummed) stay within BAND_GRAD_BYTES."""
    per_block = p.B * p.Hkv * (pc.k1 - pc.k0) * X * 4 * 2  # dK and dV of one block
    n = max(1, BAND_GRAD_BYTES // per_block)
    return [
        Piece(pc.r0 + j * pc.bq, pc.bq, min(n, pc.nb - j), pc.k0 + j * pc.bq, pc.k1 + j * pc.bq, pc.kind)
        for j in range(0, pc.nb, n)
    ]


def _band_backward(p: Problem, pc: Piece, t, grads, m: Tensor | None, causal: bool) -> None:
    q, k, v, o_, do, lse_s = t
    X = q.shape[-1]
    dq, dk, dv = grads
    L = pc.k1 - pc.k0
    idx = (pc.k0 + pc.bq * torch.arange(pc.nb)[:, None] + torch.arange(L)[None, :]).view(-1)  # (nb*L,)
    dk_f, dv_f = dk.view(p.B * p.Hkv, p.Nk, X), dv.view(p.B * p.Hkv, p.Nk, X)  # views
    for g in range(p.G):
        g_q, g_k, g_v = FLASH_BWD(
            band_view(do, p, pc, p.G, g, pc.bq, pc.r0), band_view(q, p, pc, p.G, g, pc.bq, pc.r0),
            band_view(k, p, pc, 1, 0, L, pc.k0), band_view(v, p, pc, 1, 0, L, pc.k0),
            band_view(o_, p, pc, p.G, g, pc.bq, pc.r0), band_lse_view(lse_s, p, pc, g), 0.0, causal,
            attn_mask=_group_mask(m, p, g), scale=p.scale,
        )  # fmt: skip
        band_view(dq, p, pc, p.G, g, pc.bq, pc.r0).add_(g_q)  # blocks do not overlap in rows
        dk_f.index_add_(1, idx.to(dk.device), g_k.reshape(p.B * p.Hkv, pc.nb * L, X))  # (B*Hkv, nb*L, X)
        dv_f.index_add_(1, idx.to(dv.device), g_v.reshape(p.B * p.Hkv, pc.nb * L, X))  # (B*Hkv, nb*L, X)


class _FusedAttention(torch.autograd.Function):
    """The fused piece engine under autograd; the problem's q, k, v (and sinks) are the differentiable
    inputs."""

    @staticmethod
    def forward(ctx, p: Problem, plan: list[Piece], q, k, v, sinks):
        keep = keeps_acc_output(p)
        out, lse = forward(p, plan, acc_dtype(p.dtype) if keep else None)
        ctx.p, ctx.plan = p, plan
        ctx.save_for_backward(out, lse)  # the unrounded output with sinks on half inputs
        ctx.mark_non_differentiable(lse)
        return (out.to(p.dtype) if keep else out), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        out, lse = ctx.saved_tensors
        p = ctx.p
        dq = dk = dv = dsinks = None
        if any(ctx.needs_input_grad[2:5]):
            dq, dk, dv = backward(p, ctx.plan, out, lse, dout)
        if p.sinks is not None and ctx.needs_input_grad[5]:
            acc = acc_dtype(p.dtype)
            delta = (dout.to(acc) * out.to(acc)).sum(dim=-1)  # (B, Hq, Nq): rowsum(dO * O)
            dsinks = sink_grad(p.sinks, lse, delta)  # (Hq,)
        return None, None, dq, dk, dv, dsinks


def keeps_acc_output(p: Problem) -> bool:
    """Whether a backward with sinks keeps the fp32 output of half inputs: the sinks' gradient sums
    ``rowsum(dO * O)`` over every row of the batch, and a half-rounded O adds its rounding to every term.
    Measured on bf16, causal, 2 x 4 heads, 67 x 113: the sinks' gradient error against float64 is ~1e-7
    with the fp32 O and 0.5x to 3.8x the matrix path's (up to 1.6e-3) with the rounded one."""
    return p.sinks is not None and p.dtype in (torch.float16, torch.bfloat16)


def run_fused(p: Problem, plan: list[Piece]) -> tuple[Tensor, Tensor]:
    """Run a fused plan, under autograd when ``p`` needs gradients: out (B, Hq, Nq, Dv), lse (B, Hq, Nq)."""
    if p.needs_grad:
        return _FusedAttention.apply(p, plan, p.q, p.k, p.v, p.sinks)
    with torch.no_grad():
        return forward(p, plan)
