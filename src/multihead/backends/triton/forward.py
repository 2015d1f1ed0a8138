"""The forward kernel: FlashAttention-2's online softmax over each query block's list of key tiles.

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Nq queries, Nk keys, D / Dv head
dims padded to BD / BDV (powers of two, loads masked); one program per (query block, batch x head).

Per key tile of the block's list (:mod:`.plan`): ``s = q k^T`` (fp32 accumulation), the score modifiers
(:func:`.scores.modified_scores`), the mask of a partial or edge tile (:func:`.scores.masked`), then the
running max / denominator / output update in fp32. Query head ``h`` reads kv head ``h // G`` (GQA without
repeating K/V). Attention sinks join the denominator after the last tile; a row that no key reaches and
no sink ends with output 0 and log-sum-exp -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .launch import UNSPECIALISED, Launch, dummy, last_dim_contiguous
from .scores import LOG2E, in_tile, in_tile_t, masked, mma, modified_scores, narrow, row_max, row_sum

__all__ = ["attention_forward"]


@triton.jit(do_not_specialize=UNSPECIALISED)
def _forward_kernel(
    Q, K, V, O, LSE, BIAS, SLOPES, SINKS, BITS, ROW_PTR, ROW_COLS, ROW_CODE,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
    sbb, sbh, sbq, sbk, sxb, sxh,
    Hq, G, Nq, Nk, D, Dv, kbase, scale, cap,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, BIAS_AFTER_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    q_ptrs = (
        Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqn + offs_d[None, :]
    )  # (BM, BD)
    q = tl.load(q_ptrs, mask=in_tile(offs_m < Nq, offs_d, D, EVEN_D), other=0.0)
    k_base = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    start = tl.load(ROW_PTR + pid_m)
    end = tl.load(ROW_PTR + pid_m + 1)
    for t in range(start, end):
        j = tl.load(ROW_COLS + t)
        code = tl.load(ROW_CODE + t)
        offs_n = kbase + j * BN + tl.arange(0, BN)
        kvalid = (offs_n >= 0) & (offs_n < Nk)
        kt_ptrs = k_base + offs_n[None, :] * skn + offs_d[:, None]  # (BD, BN): K^T
        kt = tl.load(kt_ptrs, mask=in_tile_t(kvalid, offs_d, D, EVEN_D), other=0.0)
        s = mma(q, kt, None, PRECISION)  # (BM, BN) fp32
        s, _ = modified_scores(
            s, b, h, offs_m, offs_n, kvalid, BIAS, sbb, sbh, sbq, sbk, SLOPES, Nq, Nk, scale, cap,
            HAS_BIAS, HAS_ALIBI, SOFTCAP, BIAS_AFTER_CAP,
        )  # fmt: skip
        s = masked(s, b, h, code, kvalid, BITS, sxb, sxh, BM, BN)
        m_new = tl.maximum(m_i, row_max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet: exp2(-inf) = 0
        p = tl.exp2(s - m_safe[:, None])  # (BM, BN)
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + row_sum(p, 1)
        v_ptrs = v_base + offs_n[:, None] * svn + offs_dv[None, :]  # (BN, BDV)
        v = tl.load(v_ptrs, mask=in_tile(kvalid, offs_dv, Dv, EVEN_D), other=0.0)
        acc = mma(narrow(p, v.dtype), v, acc * alpha[:, None], PRECISION)
        m_i = m_new
    if HAS_SINKS:
        sink = tl.load(SINKS + h) * LOG2E
        m_new = tl.maximum(m_i, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a -inf sink on a row no key reached
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.exp2(sink - m_safe)
        acc = acc * alpha[:, None]
        m_i = m_new
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / LOG2E, float("-inf"))
    o_ptrs = (
        O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * son + offs_dv[None, :]
    )  # (BM, BDV)
    tl.store(o_ptrs, narrow(out, O.dtype.element_ty), mask=in_tile(offs_m < Nq, offs_dv, Dv, EVEN_D))
    tl.store(LSE + bh.to(tl.int64) * Nq + offs_m, lse, mask=offs_m < Nq)


#: whether Triton decorated the kernels for its interpreter (TRITON_INTERPRET=1 at import) or to compile
INTERPRETED = type(_forward_kernel).__name__ == "InterpretedFunction"


def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, run: Launch
) -> tuple[Tensor, Tensor]:
    """Run the forward kernel.

    Args:
        q: (B, Hq, Nq, D); k: (B, Hkv, Nk, D); v: (B, Hkv, Nk, Dv); one dtype (fp16 / bf16 / fp32).
        sinks: (Hq,) fp32 sink logits or None.
        run: the call's plan, modifiers and launch settings (:class:`.launch.Launch`).

    Returns:
        out (B, Hq, Nq, Dv) in q's dtype and lse (B, Hq, Nq) fp32 (-inf on rows nothing reaches).
    """
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    out = q.new_empty(B, Hq, Nq, Dv)  # (B, Hq, Nq, Dv)
    lse = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)  # (B, Hq, Nq)
    plan = run.plan(run.fwd_blocks)
    sxb, sxh = plan.bit_strides()
    grid = (plan.nqb, B * Hq)
    _forward_kernel[grid](
        q, k, v, out, lse, run.bias_tensor, run.slope_tensor, dummy(q) if sinks is None else sinks,
        plan.bits, plan.row_ptr, plan.row_cols, plan.row_code,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        *run.bias_strides, sxb, sxh,
        Hq, Hq // Hkv, Nq, Nk, D, Dv, plan.kbase, run.scale, run.cap,
        BM=plan.bm, BN=plan.bn, BD=run.bd, BDV=run.bdv,
        HAS_BIAS=run.has_bias, HAS_ALIBI=run.has_alibi, SOFTCAP=run.softcap,
        BIAS_AFTER_CAP=run.bias_after_cap,
        HAS_SINKS=sinks is not None, PRECISION=run.precision, EVEN_D=run.even_d,
        num_warps=run.fwd_warps, num_stages=run.fwd_stages,
    )  # fmt: skip
    return out, lse
