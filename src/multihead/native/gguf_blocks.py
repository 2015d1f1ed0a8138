"""GGUF's weight blocks (llama.cpp's Q4_0, Q4_1, Q8_0 and the k-quants Q4_K, Q6_K) in torch: their
layout, their values, the rounding of float weights into them, and the float64 reference of the native
product on them.

A row of I weights is I / 32 blocks (I / 256 super-blocks for the k-quants) back to back, as a .gguf file
stores them:

    Q4_0  18 bytes: fp16 d, 16 bytes qs    w[j] = d * ((qs[j] & 15) - 8), w[j + 16] = d * ((qs[j] >> 4) - 8)
    Q4_1  20 bytes: fp16 d, fp16 m, qs     w[j] = d * (qs[j] & 15) + m,   w[j + 16] = d * (qs[j] >> 4) + m
    Q8_0  34 bytes: fp16 d, 32 int8 q      w[j] = d * q[j]
    Q4_K 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales sc and mins mn, 128 bytes qs;
                    sub-block j of 32: the low (j even) or high (j odd) nibbles q of qs[32 (j // 2):],
                    w = (d sc_j) q - (dmin mn_j)
    Q6_K 210 bytes: 128 bytes ql (low nibbles), 64 bytes qh (2 high bits), 16 int8 scales, fp16 d;
                    w = (d sc_g) (q - 32), one scale per group g of 16

:func:`fields` gives every kind in one form: a scale per group (32 weights; 16 for Q6_K), an offset per
group or None, and the integers. The native product (``gemv_q4.c``, ``gemv_qk.c``) multiplies the blocks
by an activation rounded to int8 per block of 32 (``xs[b] = absmax / 127``, ``xq = round(x / xs[b])``, as
the int8 path rounds it); its float64 reference here is, with q a group's integers and b its activation
block,

    y[o] = sum_g d_g xs[b] sum_{i in g} q_i xq_i  (+ m_g xs[b] sum_{i in g} xq_i  where there are offsets).

This module imports only torch (the native library's self-check uses it).

Shape legend: O rows, I columns (weights a row), Nb = I / 32 blocks a row, Ng groups a row, G weights a
group, R bytes of a row's blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import gguf_kquants

__all__ = [
    "BLOCK", "KINDS", "SUPER", "block_bytes", "block_weights", "check_blocks", "dequantize", "fields",
    "quantize", "reference_product",
]  # fmt: skip

BLOCK = 32  # weights a block (of the activation's rounding, and of Q4_0 / Q4_1 / Q8_0)
SUPER = 256  # weights a k-quant super-block
#: the block formats by their multihead names: (ggml type number, bytes a block, GGUF's name, weights a
#: block)
KINDS: dict[str, tuple[int, int, str, int]] = {
    "q4_0": (2, 18, "Q4_0", BLOCK),
    "q4_1": (3, 20, "Q4_1", BLOCK),
    "q8_0": (8, 34, "Q8_0", BLOCK),
    "q4_k": (12, 144, "Q4_K", SUPER),
    "q6_k": (14, 210, "Q6_K", SUPER),
}


def block_bytes(kind: str) -> int:
    """Bytes of one block of ``kind`` (18, 20, 34, 144 or 210)."""
    return KINDS[kind][1]


def block_weights(kind: str) -> int:
    """Weights in one block of ``kind``: 32, or 256 for the k-quants."""
    return KINDS[kind][3]


def check_blocks(blocks: Tensor, kind: str, cols: int) -> None:
    """Raises ValueError unless ``blocks`` is a uint8 (O, R) tensor of ``kind`` blocks for rows of ``cols``.

    Raises:
        ValueError: an unknown kind, cols not a positive multiple of 32, another dtype or shape.
    """
    if kind not in KINDS:
        raise ValueError(f"the block kind must be one of {list(KINDS)}, got {kind!r}")
    n = block_weights(kind)
    if not (isinstance(cols, int) and cols > 0 and cols % n == 0):
        raise ValueError(f"rows of {kind} blocks hold a positive multiple of {n} weights, got {cols!r}")
    want = cols // n * block_bytes(kind)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != want:
        raise ValueError(
            f"{kind} blocks for rows of {cols} weights are uint8 (O, {want}), got {blocks.dtype} "
            f"{tuple(blocks.shape)}"
        )


def fields(blocks: Tensor, kind: str) -> tuple[Tensor, Tensor | None, Tensor]:
    """The blocks as groups: a scale d (O, Ng) fp32 per group, an offset m (O, Ng) fp32 per group (Q4_1,
    Q4_K; else None) and the integer weights q (O, Ng, G) int32, so that ``w = d q (+ m)`` with each
    product rounded to fp32 as llama.cpp and ``gguf.quants.dequantize`` round it. G is 32, 16 for Q6_K;
    q is nibble - 8 (Q4_0), the nibble (Q4_1, Q4_K), q (Q8_0), q - 32 (Q6_K); Q4_K's d is ``d * sc_j``
    and m ``-(dmin * mn_j)``, Q6_K's d ``d * sc_g``."""
    O = blocks.shape[0]
    b = blocks.view(O, -1, block_bytes(kind))  # (O, Nb, bytes), Nb blocks (super-blocks) a row
    if kind == "q4_k":
        return gguf_kquants.fields_q4k(b)
    if kind == "q6_k":
        return gguf_kquants.fields_q6k(b)
    d = gguf_kquants.half(b[..., 0:2])  # (O, Nb)
    if kind == "q8_0":
        return d, None, b[..., 2:].contiguous().view(torch.int8).int()  # (O, Nb, 32)
    qs = b[..., 4:] if kind == "q4_1" else b[..., 2:]  # (O, Nb, 16)
    q = torch.cat([qs & 15, qs >> 4], dim=-1).int()  # (O, Nb, 32): low nibbles, then high
    if kind == "q4_0":
        return d, None, q - 8
    return d, gguf_kquants.half(b[..., 2:4]), q


def dequantize(blocks: Tensor, kind: str, dtype: torch.dtype = torch.float32) -> Tensor:
    """The weights (O, I) the blocks stand for: fp32 as ``gguf.quants.dequantize`` makes them (``d * q``,
    ``d * q + m`` rounded twice), or exactly in float64 (``dtype=torch.float64``), then cast to ``dtype``."""
    d, m, q = fields(blocks, kind)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    w = d.to(work)[..., None] * q.to(work)  # (O, Ng, G)
    if m is not None:
        w = w + m.to(work)[..., None]
    return w.reshape(blocks.shape[0], -1).to(dtype)  # (O, I)


def reference_product(blocks: Tensor, kind: str, xq: Tensor, xs: Tensor) -> tuple[Tensor, Tensor]:
    """The float64 reference of the native product on rounded activations, and the sum of the
    magnitudes of its products of one weight and one activation, ``|W| |x|`` (the scale of its
    rounding errors, however a kernel splits a block's sum).

    Args:
        blocks: uint8 (O, R) of ``kind``.
        xq: int8 (N, I') with I' >= I (zeros past I allowed), the rounded activations.
        xs: fp32 (N, I' / 32), their block scales.

    Returns:
        float64 (N, O) products and float64 (N, O) magnitudes.
    """
    d, m, q = fields(blocks, kind)
    ng, G = q.shape[1], q.shape[2]
    x = xq[:, : ng * G].double().view(xq.shape[0], ng, G)  # (N, Ng, G)
    s = xs[:, : ng * G // BLOCK].double().repeat_interleave(BLOCK // G, dim=1)  # (N, Ng): each group's block
    isum = torch.einsum("ogi,ngi->nog", q.double(), x)  # (N, O, Ng), exact integers
    asum = torch.einsum("ogi,ngi->nog", q.double().abs(), x.abs())  # (N, O, Ng)
    scale = d.double()[None] * s[:, None]  # (N, O, Ng)
    y, size = (scale * isum).sum(-1), (scale.abs() * asum).sum(-1)  # (N, O)
    if m is not None:
        mx = m.double()[None] * s[:, None]  # (N, O, Ng)
        y = y + (mx * x.sum(-1)[:, None]).sum(-1)  # (N, O)
        size = size + (mx.abs() * x.abs().sum(-1)[:, None]).sum(-1)  # (N, O)
    return y, size


def quantize(w: Tensor, kind: str) -> Tensor:
    """Float weights (O, I) -> blocks (O, R) of ``kind`` by llama.cpp's rules (``quantize_row_*_ref``,
    the ``gguf`` package's ``quantize``), in fp32:

    - Q4_0: the block's value of largest magnitude ``max`` (signed), ``d = max / -8``,
      ``q = min(15, trunc(w / d + 8.5))``;
    - Q4_1: ``d = (max - min) / 15``, ``m = min``, ``q = min(15, trunc((w - min) / d + 0.5))``;
    - Q8_0: ``d = absmax / 127``, ``q = round(w / d)`` half away from zero;

    each with ``1 / d`` computed once in fp32 (0 where d is 0), d and m stored as fp16; Q4_K and Q6_K in
    llama.cpp's super-blocks with the scales of :mod:`.gguf_kquants` (min / max per sub-block, without
    llama.cpp's search over candidate scales).

    Raises:
        ValueError: an unknown kind, a weight that is not 2-D or whose width is not a multiple of the
            kind's block (32; 256 for Q4_K and Q6_K).
    """
    if kind not in KINDS:
        raise ValueError(f"the block kind must be one of {list(KINDS)}, got {kind!r}")
    n = block_weights(kind)
    if w.dim() != 2 or w.shape[1] % n != 0 or w.shape[1] == 0:
        raise ValueError(
            f"{kind} blocks need a weight (O, I) with I a positive multiple of {n}, got "
            f"{tuple(w.shape)}; pad its inputs or keep that layer in another format"
        )
    if kind == "q4_k":
        return gguf_kquants.quantize_q4k(w.detach().float())
    if kind == "q6_k":
        return gguf_kquants.quantize_q6k(w.detach().float())
    O = w.shape[0]
    x = w.detach().float().reshape(O, -1, BLOCK)  # (O, Nb, 32)
    if kind == "q8_0":
        d = x.abs().amax(-1) / 127  # (O, Nb)
        inv = torch.where(d == 0, 0.0, 1.0 / d)  # (O, Nb)
        v = x * inv[..., None]  # (O, Nb, 32)
        q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).to(torch.int8)  # roundf: half away from zero
        return torch.cat([gguf_kquants.half_bytes(d), q.view(torch.uint8)], dim=-1).reshape(O, -1)  # (O, R)
    if kind == "q4_0":
        at = x.abs().argmax(-1, keepdim=True)  # (O, Nb, 1): the first largest, as numpy's argmax
        d = x.gather(-1, at)[..., 0] / -8  # (O, Nb)
        inv = torch.where(d == 0, 0.0, 1.0 / d)  # (O, Nb)
        q = torch.trunc(x * inv[..., None] + 8.5).clamp(0, 15).to(torch.uint8)  # (O, Nb, 32)
        head = gguf_kquants.half_bytes(d)  # (O, Nb, 2)
    else:
        lo, hi = x.amin(-1), x.amax(-1)  # (O, Nb)
        d = (hi - lo) / 15  # (O, Nb)
        inv = torch.where(d == 0, 0.0, 1.0 / d)  # (O, Nb)
        q = torch.trunc((x - lo[..., None]) * inv[..., None] + 0.5).clamp(0, 15).to(torch.uint8)
        head = torch.cat([gguf_kquants.half_bytes(d), gguf_kquants.half_bytes(lo)], dim=-1)  # (O, Nb, 4)
    qs = q[..., :16] | (q[..., 16:] << 4)  # (O, Nb, 16): value j low, value j + 16 high
    return torch.cat([head, qs], dim=-1).reshape(O, -1)  # (O, R)
