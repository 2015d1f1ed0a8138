"""Device helpers shared by the forward and backward kernels: score modifiers and the tile's mask.

Shape legend: BM query rows x BN keys per tile. Scores leave :func:`modified_scores` in log2 units
(multiplied by log2(e)), so the softmax runs on ``exp2``.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


if triton.knobs.runtime.interpret:

    @triton.jit
    def mma(a, b, acc, PRECISION: tl.constexpr):
        """``a @ b (+ acc)`` in fp32. The interpreter's dot misreads bfloat16 operands, so they are widened
        first (exact: every bf16 / fp16 value is an fp32 value; the products accumulate in fp32 as on
        the GPU's tensor cores)."""
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")

    @triton.jit
    def narrow(x, dtype: tl.constexpr):
        """``x.to(dtype)`` rounding to nearest even (the interpreter truncates fp32 -> bfloat16, a bias
        that accumulates in P @ V and the gradients; the GPU rounds)."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        return x.to(dtype)

else:

    @triton.jit
    def narrow(x, dtype: tl.constexpr):
        """``x.to(dtype)`` (round to nearest even)."""
        return x.to(dtype)

    @triton.jit
    def mma(a, b, acc, PRECISION: tl.constexpr):
        """``a @ b (+ acc)`` with fp32 accumulation (``PRECISION`` "ieee": no TF32 for fp32 inputs)."""
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def in_tile(rows, offs, n, EVEN: tl.constexpr):
    """The (R, C) load mask of rows ``rows`` (R,) and columns ``offs < n`` (C,); with ``EVEN`` (the head
    dim fills its padded block) only the row mask (R, 1), constant along the contiguous columns, so
    that Triton can emit 16-byte loads."""
    if EVEN:
        return rows[:, None]
    else:
        return rows[:, None] & (offs < n)[None, :]


@triton.jit
def in_tile_t(cols, offs, n, EVEN: tl.constexpr):
    """:func:`in_tile` of a transposed tile: (C, R) with ``offs < n`` down the rows."""
    if EVEN:
        return cols[None, :]
    else:
        return cols[None, :] & (offs < n)[:, None]


@triton.jit
def bias_tile(BASE, b, h, offs_m, offs_n, kvalid, sbb, sbh, sbq, sbk, Nq):
    """Pointers (BM, BN) into a tensor of the bias's shape read through its strides (0 where it
    broadcasts), and the mask of the tile's positions inside the problem."""
    ptrs = (
        BASE + b.to(tl.int64) * sbb + h.to(tl.int64) * sbh + offs_m[:, None] * sbq + offs_n[None, :] * sbk
    )  # (BM, BN)
    return ptrs, (offs_m < Nq)[:, None] & kvalid[None, :]


@triton.jit
def tanh(x):
    """tanh to a few fp32 ulps on every device (the Triton interpreter has no libdevice): a Taylor
    polynomial near 0, where ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` would cancel."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    far = (1.0 - e) / (1.0 + e)
    x2 = a * a
    poly = -1382.0 / 155925.0
    poly = 62.0 / 2835.0 + x2 * poly
    poly = -17.0 / 315.0 + x2 * poly
    poly = 2.0 / 15.0 + x2 * poly
    poly = -1.0 / 3.0 + x2 * poly
    near = a + a * x2 * poly
    r = tl.where(a < 0.25, near, far)
    return tl.where(x < 0, -r, r)


@triton.jit
def modified_scores(
    s,
    b,
    h,
    offs_m,
    offs_n,
    kvalid,
    BIAS,
    sbb,
    sbh,
    sbq,
    sbk,
    SLOPES,
    Nq,
    Nk,
    scale,
    cap,
    HAS_BIAS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BIAS_AFTER_CAP: tl.constexpr,
):
    """Raw dot products (BM, BN) -> scaled, biased, soft-capped scores in log2 units, and the tanh of
    the soft-cap (its derivative ``1 - t^2`` is the backward's; meaningless without a cap)."""
    s = s * scale
    t = s  # the soft-cap's tanh below; unused without a cap
    # one scalar reciprocal, then a multiply per score: a division per score costs a special-function
    # op on the GPU, the unit the softmax's exp2 already keeps busy
    inv_cap = 1.0 / cap
    if SOFTCAP and BIAS_AFTER_CAP:
        t = tanh(s * inv_cap)
        s = cap * t
    if HAS_BIAS:
        ptrs, inside = bias_tile(BIAS, b, h, offs_m, offs_n, kvalid, sbb, sbh, sbq, sbk, Nq)
        s += tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h)
        dist = (offs_m + (Nk - Nq))[:, None] - offs_n[None, :]  # (BM, BN) bottom-right aligned
        s += -slope * tl.abs(dist).to(tl.float32)
    if SOFTCAP and not BIAS_AFTER_CAP:
        t = tanh(s * inv_cap)
        s = cap * t
    return s * LOG2E, t


@triton.jit
def add_bias_grad(DBIAS, g, b, h, offs_m, offs_n, kvalid, sbb, sbh, sbq, sbk, Nq):
    """Add a tile's bias gradient ``g`` (BM, BN) into ``DBIAS`` (the bias's shape, read through the
    bias's strides). fp32 atomics: where the bias broadcasts (stride 0 over batch, heads, rows or keys)
    many scores add into one entry, which is the sum over the broadcast dims its gradient is."""
    ptrs, inside = bias_tile(DBIAS, b, h, offs_m, offs_n, kvalid, sbb, sbh, sbq, sbk, Nq)
    tl.atomic_add(ptrs, g, mask=inside, sem="relaxed")


@triton.jit
def masked(s, b, h, code, kvalid, BITS, sxb, sxh, BM: tl.constexpr, BN: tl.constexpr):
    """-inf where the tile's mask hides a key: a full tile (code -1) is left as it is; a partial tile
    (code >= 0) reads its bit mask, one int32 word per 32 keys of a row (see :mod:`.plan`), and a full
    tile at the key edge (code -2) checks only the bounds ``0 <= k < Nk``."""
    if code != -1:
        WB: tl.constexpr = 32 if BN >= 32 else BN  # keys a word
        W: tl.constexpr = BN // WB  # words a row
        offs = tl.arange(0, BM)[:, None] * W + tl.arange(0, W)[None, :]  # (BM, W)
        tile = code.to(tl.int64) * (BM * W)
        base = BITS + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + tl.where(code >= 0, tile, 0)
        n_words = tl.where(code >= 0, BM * W, 0)  # a partial tile's words, none at the edge
        words = tl.load(base + offs, mask=offs < n_words, other=-1)  # (BM, W) int32; edge: all set
        bits = (words[:, :, None] >> tl.arange(0, WB)[None, None, :]) & 1  # (BM, W, WB)
        bits = tl.reshape(bits, (BM, BN))  # (BM, BN): key c = bit c % WB of word c // WB
        s = tl.where((bits != 0) & kvalid[None, :], s, float("-inf"))
    return s


def _inline_in_interpreter(fn):
    """In Triton's interpreter, a device function called from a kernel re-patches ``triton.language`` on
    every call (most of the interpreter's time here); the calling kernel has patched it already, so the
    helpers are called as their rewritten Python functions instead. Compiled kernels are unaffected."""
    rewrite = getattr(fn, "rewrite", None)
    return rewrite() if type(fn).__name__ == "InterpretedFunction" and rewrite is not None else fn


in_tile = _inline_in_interpreter(in_tile)
in_tile_t = _inline_in_interpreter(in_tile_t)
bias_tile = _inline_in_interpreter(bias_tile)
add_bias_grad = _inline_in_interpreter(add_bias_grad)
tanh = _inline_in_interpreter(tanh)
modified_scores = _inline_in_interpreter(modified_scores)
masked = _inline_in_interpreter(masked)
mma = _inline_in_interpreter(mma)
narrow = _inline_in_interpreter(narrow)
row_max = _inline_in_interpreter(tl.max)
row_sum = _inline_in_interpreter(tl.sum)
