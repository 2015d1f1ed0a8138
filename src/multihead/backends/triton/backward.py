"""The backward kernels (FlashAttention-2): dK/dV per key block, dQ per query block; atomics only for a
bias's gradient.

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Nq queries, Nk keys, D / Dv head
dims padded to BD / BDV.

With the forward's log-sum-exp (sinks included) the probabilities are recomputed per tile,
``p = exp(s - lse)``, and with ``delta = rowsum(dO * O) - dlse`` (the second term routes a gradient that
reaches the returned lse):

    dV = p^T dO      dP = dO V^T      dS = p * (dP - delta) * (1 - tanh^2 of the soft-cap)
    dK = scale * dS^T Q                dQ = scale * dS K
    dBias = dS (without the soft-cap's factor for a bias added after the cap), summed over the dims the
            bias broadcasts over: fp32 atomic adds in the dQ kernel, only when the bias requires grad

The dK/dV kernel walks its key block's transposed tile list once per query head of the kv head, so the
G heads' contributions are summed in registers. Rows no key reached carry lse = +inf here (p = 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .launch import UNSPECIALISED, Launch, last_dim_contiguous
from .scores import LOG2E, add_bias_grad, in_tile, masked, mma, modified_scores, narrow

__all__ = ["attention_backward"]


@triton.jit(do_not_specialize=UNSPECIALISED)
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, BIAS, SLOPES, BITS, COL_PTR, COL_ROWS, COL_CODE,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
    sbb, sbh, sbq, sbk, sxb, sxh,
    Hq, G, Nq, Nk, D, Dv, kbase, scale, cap,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, BIAS_AFTER_CAP: tl.constexpr,
    PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    """One program per (key block, batch x kv head); dK/dV in k's layout (B, Hkv, Nk, D)."""
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    Hkv = Hq // G
    b = bhk // Hkv
    hk = bhk % Hkv
    offs_n = kbase + pid_n * BN + tl.arange(0, BN)
    kvalid = (offs_n >= 0) & (offs_n < Nk)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    kmask = in_tile(kvalid, offs_d, D, EVEN_D)
    vmask = in_tile(kvalid, offs_dv, Dv, EVEN_D)
    k_off = b.to(tl.int64) * skb + hk.to(tl.int64) * skh + offs_n[:, None] * skn + offs_d[None, :]  # (BN, BD)
    v_off = (
        b.to(tl.int64) * svb + hk.to(tl.int64) * svh + offs_n[:, None] * svn + offs_dv[None, :]
    )  # (BN, BDV)
    k = tl.load(K + k_off, mask=kmask, other=0.0)
    v = tl.load(V + v_off, mask=vmask, other=0.0)
    dk = tl.zeros([BN, BD], tl.float32)
    dv = tl.zeros([BN, BDV], tl.float32)
    start = tl.load(COL_PTR + pid_n)
    end = tl.load(COL_PTR + pid_n + 1)
    for g in range(G):
        h = hk * G + g
        for t in range(start, end):
            i = tl.load(COL_ROWS + t)
            code = tl.load(COL_CODE + t)
            offs_m = i * BM + tl.arange(0, BM)
            rows = offs_m < Nq
            q_ptrs = (
                Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqn + offs_d[None, :]
            )  # (BM, BD)
            q = tl.load(q_ptrs, mask=in_tile(rows, offs_d, D, EVEN_D), other=0.0)
            do_ptrs = (
                DO + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * son + offs_dv[None, :]
            )  # (BM, BDV)
            do = tl.load(do_ptrs, mask=in_tile(rows, offs_dv, Dv, EVEN_D), other=0.0)
            row_off = (b * Hq + h).to(tl.int64) * Nq + offs_m
            lse = tl.load(LSE + row_off, mask=rows, other=float("inf")) * LOG2E
            delta = tl.load(DELTA + row_off, mask=rows, other=0.0)
            s = mma(q, tl.trans(k), None, PRECISION)  # (BM, BN)
            s, tc = modified_scores(
                s, b, h, offs_m, offs_n, kvalid, BIAS, sbb, sbh, sbq, sbk, SLOPES, Nq, Nk, scale, cap,
                HAS_BIAS, HAS_ALIBI, SOFTCAP, BIAS_AFTER_CAP,
            )  # fmt: skip
            s = masked(s, b, h, code, kvalid, BITS, sxb, sxh, BM, BN)
            p = tl.exp2(s - lse[:, None])  # (BM, BN)
            dv = mma(tl.trans(narrow(p, do.dtype)), do, dv, PRECISION)
            dp = mma(do, tl.trans(v), None, PRECISION)  # (BM, BN)
            ds = p * (dp - delta[:, None])
            if SOFTCAP:
                ds = ds * (1.0 - tc * tc)
            dk = mma(tl.trans(narrow(ds, q.dtype)), q, dk, PRECISION)
    tl.store(DK + k_off, narrow(dk * scale, DK.dtype.element_ty), mask=kmask)
    tl.store(DV + v_off, narrow(dv, DV.dtype.element_ty), mask=vmask)


@triton.jit(do_not_specialize=UNSPECIALISED)
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DBIAS, BIAS, SLOPES, BITS, ROW_PTR, ROW_COLS, ROW_CODE,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
    sbb, sbh, sbq, sbk, sxb, sxh,
    Hq, G, Nq, Nk, D, Dv, kbase, scale, cap,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, BIAS_AFTER_CAP: tl.constexpr,
    PRECISION: tl.constexpr, EVEN_D: tl.constexpr, BIAS_GRAD: tl.constexpr,
):  # fmt: skip
    """One program per (query block, batch x query head); dQ in q's layout (B, Hq, Nq, D), and with
    ``BIAS_GRAD`` the bias's gradient added into ``DBIAS`` (every non-empty tile of a (batch, head) is
    visited here once)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    rows = offs_m < Nq
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    q_off = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqn + offs_d[None, :]  # (BM, BD)
    qmask = in_tile(rows, offs_d, D, EVEN_D)
    q = tl.load(Q + q_off, mask=qmask, other=0.0)
    do_ptrs = (
        DO + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * son + offs_dv[None, :]
    )  # (BM, BDV)
    do = tl.load(do_ptrs, mask=in_tile(rows, offs_dv, Dv, EVEN_D), other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * Nq + offs_m, mask=rows, other=float("inf")) * LOG2E
    delta = tl.load(DELTA + bh.to(tl.int64) * Nq + offs_m, mask=rows, other=0.0)
    k_base = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    dq = tl.zeros([BM, BD], tl.float32)
    start = tl.load(ROW_PTR + pid_m)
    end = tl.load(ROW_PTR + pid_m + 1)
    for t in range(start, end):
        j = tl.load(ROW_COLS + t)
        code = tl.load(ROW_CODE + t)
        offs_n = kbase + j * BN + tl.arange(0, BN)
        kvalid = (offs_n >= 0) & (offs_n < Nk)
        k = tl.load(
            k_base + offs_n[:, None] * skn + offs_d[None, :],
            mask=in_tile(kvalid, offs_d, D, EVEN_D),
            other=0.0,
        )
        v = tl.load(
            v_base + offs_n[:, None] * svn + offs_dv[None, :],
            mask=in_tile(kvalid, offs_dv, Dv, EVEN_D),
            other=0.0,
        )
        s = mma(q, tl.trans(k), None, PRECISION)  # (BM, BN)
        s, tc = modified_scores(
            s, b, h, offs_m, offs_n, kvalid, BIAS, sbb, sbh, sbq, sbk, SLOPES, Nq, Nk, scale, cap,
            HAS_BIAS, HAS_ALIBI, SOFTCAP, BIAS_AFTER_CAP,
        )  # fmt: skip
        s = masked(s, b, h, code, kvalid, BITS, sxb, sxh, BM, BN)
        p = tl.exp2(s - lse[:, None])  # (BM, BN)
        dp = mma(do, tl.trans(v), None, PRECISION)  # (BM, BN)
        ds = p * (dp - delta[:, None])
        if BIAS_GRAD and BIAS_AFTER_CAP:  # s = cap * tanh(.) + bias: the bias sees ds as it is
            add_bias_grad(DBIAS, ds, b, h, offs_m, offs_n, kvalid, sbb, sbh, sbq, sbk, Nq)
        if SOFTCAP:
            ds = ds * (1.0 - tc * tc)
        if BIAS_GRAD and not BIAS_AFTER_CAP:  # the bias inside the cap (or no cap): after its derivative
            add_bias_grad(DBIAS, ds, b, h, offs_m, offs_n, kvalid, sbb, sbh, sbq, sbk, Nq)
        dq = mma(narrow(ds, k.dtype), k, dq, PRECISION)
    tl.store(DQ + q_off, narrow(dq * scale, DQ.dtype.element_ty), mask=qmask)


def attention_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None, run: Launch
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients of the forward kernel's (out, lse).

    Args:
        q, k, v, out: the forward's inputs and output; lse (B, Hq, Nq) fp32 its log-sum-exp.
        dout: (B, Hq, Nq, Dv) gradient of out; dlse: (B, Hq, Nq) gradient of lse or None.
        run: the forward's launch (same plan data, modifiers and settings).

    Returns:
        dq (B, Hq, Nq, D), dk (B, Hkv, Nk, D), dv (B, Hkv, Nk, Dv) in the inputs' dtypes, delta
        (B, Hq, Nq) fp32 (``rowsum(dO * O) - dlse``, for the sinks' gradient), and the gradient of
        ``run.bias_tensor`` (its shape, fp32) when ``run.bias_grad``, else None.
    """
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    dout = last_dim_contiguous(dout)
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    delta = (dout.float() * out.float()).sum(-1)  # (B, Hq, Nq)
    if dlse is not None:
        delta = delta - dlse.float()
    lse_b = torch.where(
        lse == float("-inf"), torch.full_like(lse, float("inf")), lse
    ).contiguous()  # (B, Hq, Nq)
    delta = delta.contiguous()
    # Gradients in the inputs' own strides: the kernels write them through q's and k's strides.
    dq, dk, dv = (torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in (q, k, v))
    common = dict(
        BD=run.bd, BDV=run.bdv, HAS_BIAS=run.has_bias, HAS_ALIBI=run.has_alibi, SOFTCAP=run.softcap,
        BIAS_AFTER_CAP=run.bias_after_cap, PRECISION=run.precision, EVEN_D=run.even_d,
        num_warps=run.bwd_warps, num_stages=run.bwd_stages,
    )  # fmt: skip
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *run.bias_strides)
    sizes = (Hq, Hq // Hkv, Nq, Nk, D, Dv)
    plan = run.plan(run.dkdv_blocks)
    _dkdv_kernel[(plan.nkb, B * Hkv)](
        q, k, v, dout, lse_b, delta, dk, dv, run.bias_tensor, run.slope_tensor, plan.bits,
        plan.col_ptr, plan.col_rows, plan.col_code, *strides, *plan.bit_strides(),
        *sizes, plan.kbase, run.scale, run.cap, BM=plan.bm, BN=plan.bn, **common,
    )  # fmt: skip
    # the bias's gradient in its (contiguous) shape, fp32: the dQ kernel adds into it with atomics
    dbias = torch.zeros_like(run.bias_tensor) if run.bias_grad else None  # (B|1, Hq|1, Nq|1, Nk|1)
    plan = run.plan(run.dq_blocks)
    _dq_kernel[(plan.nqb, B * Hq)](
        q, k, v, dout, lse_b, delta, dq, run.bias_tensor if dbias is None else dbias, run.bias_tensor,
        run.slope_tensor, plan.bits, plan.row_ptr, plan.row_cols, plan.row_code, *strides,
        *plan.bit_strides(), *sizes, plan.kbase, run.scale, run.cap, BM=plan.bm, BN=plan.bn,
        BIAS_GRAD=dbias is not None, **common,
    )  # fmt: skip
    return dq, dk, dv, delta, dbias
