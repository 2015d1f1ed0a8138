"""llama.cpp's k-quant super-blocks (Q4_K, Q6_K: 256 weights each) in torch: their fields as groups
(what :func:`.gguf_blocks.fields` returns for them) and the rounding of float weights into them.

    Q4_K 144 bytes: fp16 d, fp16 dmin, 12 bytes of scales, 128 bytes qs; 8 sub-blocks of 32 weights,
                    w = (d sc_j) q - (dmin mn_j), sc_j and mn_j 6-bit, q a nibble
    Q6_K 210 bytes: 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d; 16 groups of 16 weights,
                    w = (d sc_g) (q - 32), q 6-bit (a nibble of ql and 2 bits of qh)

The rounding follows llama.cpp's ``quantize_row_q4_K_ref`` / ``quantize_row_q6_K_ref`` in layout and in
the two levels of scales (a 6-bit or int8 scale per group, an fp16 scale of the scales per super-block),
but picks each group's scale from its min / max (its largest magnitude for Q6_K) instead of llama.cpp's
weighted search over candidate scales: the blocks are valid Q4_K / Q6_K blocks that llama.cpp reads, a
little less accurate than its own.

This module imports only torch.

Shape legend: O rows, Nb super-blocks a row, Ng groups a row.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["fields_q4k", "fields_q6k", "half", "half_bytes", "quantize_q4k", "quantize_q6k", "scale_min"]


def half(b: Tensor) -> Tensor:
    """(..., 2) uint8 little-endian fp16 -> (...,) fp32, exactly."""
    return b.contiguous().view(torch.float16)[..., 0].float()  # (...,)


def half_bytes(v: Tensor) -> Tensor:
    """(...,) fp32 -> (..., 2) uint8 of its fp16, rounded to nearest."""
    return v.to(torch.float16).contiguous()[..., None].view(torch.uint8)  # (..., 2)


def scale_min(s: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K's 12 bytes (..., 12) -> its eight 6-bit scales and mins (..., 8) int32 each (llama.cpp's
    get_scale_min_k4)."""
    s = s.int()
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1)  # (..., 8)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)  # (..., 8)
    return sc, mn


def fields_q4k(b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    O, nsb = b.shape[0], b.shape[1]
    d, dmin = half(b[..., 0:2]), half(b[..., 2:4])  # (O, Nb)
    sc, mn = scale_min(b[..., 4:16])  # (O, Nb, 8)
    qs = b[..., 16:].reshape(O, nsb, 4, 1, 32)  # (O, Nb, pair, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=3).int().reshape(O, nsb * 8, 32)  # (O, Ng, 32): sub-block order
    dg = (d[..., None] * sc.float()).reshape(O, -1)  # (O, Ng), rounded to fp32 as llama.cpp's d * sc
    mg = -(dmin[..., None] * mn.float()).reshape(O, -1)  # (O, Ng)
    return dg, mg, q


def fields_q6k(b: Tensor) -> tuple[Tensor, None, Tensor]:
    O, nsb = b.shape[0], b.shape[1]
    ql = b[..., :128].reshape(O, nsb, 2, 2, 32).int()  # (O, Nb, half n, s & 1, 32)
    qh = b[..., 128:192].reshape(O, nsb, 2, 1, 32).int()  # (O, Nb, half n, 1, 32)
    lo = torch.cat([ql & 15, ql >> 4], dim=3)  # (O, Nb, n, s, 32): s = 0 1 low nibbles, 2 3 high
    hi = torch.cat([(qh >> (2 * s)) & 3 for s in range(4)], dim=3)  # (O, Nb, n, s, 32)
    q = ((lo | (hi << 4)) - 32).reshape(O, nsb * 16, 16)  # (O, Ng, 16)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()  # (O, Nb, 16)
    d = half(b[..., 208:210])  # (O, Nb)
    return (d[..., None] * sc).reshape(O, -1), None, q  # (O, Ng) scales


def quantize_q4k(w: Tensor) -> Tensor:
    """fp32 weights (O, I), I a multiple of 256 -> Q4_K blocks (O, I / 256 * 144): per sub-block of 32 its
    min clamped to at most 0 (``mn = -min``) and ``scale = (max - min) / 15``; per super-block ``d = max
    scale / 63`` and ``dmin = max mn / 63`` (fp16), the 6-bit ``sc = round(scale / d)`` and ``round(mn /
    dmin)``, then ``q = clamp(round((w + dmin mn) / (d sc)), 0, 15)`` on the stored values."""
    O = w.shape[0]
    x = w.reshape(O, -1, 8, 32)  # (O, Nb, 8, 32)
    lo = x.amin(-1).clamp(max=0.0)  # (O, Nb, 8)
    scale, mins = (x.amax(-1) - lo) / 15, -lo  # (O, Nb, 8)
    d, dmin = scale.amax(-1) / 63, mins.amax(-1) / 63  # (O, Nb)
    d16, dmin16 = d.half().float(), dmin.half().float()  # (O, Nb): as stored
    sc = torch.where(d16[..., None] > 0, scale / d16[..., None], 0.0).round().clamp(0, 63)  # (O, Nb, 8)
    mn = torch.where(dmin16[..., None] > 0, mins / dmin16[..., None], 0.0).round().clamp(0, 63)
    dj, mj = d16[..., None] * sc, dmin16[..., None] * mn  # (O, Nb, 8): as the readers compute them
    q = torch.where(dj[..., None] > 0, (x + mj[..., None]) / dj[..., None], 0.0)  # (O, Nb, 8, 32)
    q = q.round().clamp(0, 15).to(torch.uint8)
    qs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(O, -1, 128)  # (O, Nb, 128): pairs of sub-blocks
    sc8, mn8 = sc.to(torch.uint8), mn.to(torch.uint8)  # (O, Nb, 8)
    scales = torch.cat(
        [
            sc8[..., :4] | ((sc8[..., 4:] >> 4) << 6),  # bytes 0-3: sc 0-3 and the top bits of sc 4-7
            mn8[..., :4] | ((mn8[..., 4:] >> 4) << 6),  # bytes 4-7: mn 0-3 and the top bits of mn 4-7
            (sc8[..., 4:] & 15) | ((mn8[..., 4:] & 15) << 4),  # bytes 8-11: the low nibbles of 4-7
        ],
        dim=-1,
    )  # (O, Nb, 12)
    return torch.cat([half_bytes(d), half_bytes(dmin), scales, qs], dim=-1).reshape(O, -1)


def quantize_q6k(w: Tensor) -> Tensor:
    """fp32 weights (O, I), I a multiple of 256 -> Q6_K blocks (O, I / 256 * 210): per group of 16 the
    value of largest magnitude ``m`` (signed) and ``scale = m / -32``; per super-block the scale of
    largest magnitude ``s``, ``d = s / -128`` (fp16), the int8 ``sc = min(127, round(scale / d))``, then
    ``q = clamp(round(w / (d sc)), -32, 31) + 32`` on the stored values."""
    O = w.shape[0]
    x = w.reshape(O, -1, 16, 16)  # (O, Nb, 16 groups, 16)
    at = x.abs().argmax(-1, keepdim=True)  # (O, Nb, 16, 1)
    scale = x.gather(-1, at)[..., 0] / -32  # (O, Nb, 16)
    big = scale.gather(-1, scale.abs().argmax(-1, keepdim=True))[..., 0]  # (O, Nb)
    d16 = (big / -128).half().float()  # (O, Nb): as stored
    sc = torch.where(d16[..., None] != 0, scale / d16[..., None], 0.0).round().clamp(-128, 127)  # (O, Nb, 16)
    dg = d16[..., None] * sc  # (O, Nb, 16)
    q = torch.where(dg[..., None] != 0, x / dg[..., None], 0.0).round().clamp(-32, 31) + 32  # (O, Nb, 16, 16)
    q = q.to(torch.uint8).reshape(O, -1, 2, 4, 32)  # (O, Nb, half n, s, 32): weight 128 n + 32 s + i
    low = q & 15  # (O, Nb, 2, 4, 32)
    # (O, Nb, 2, 64): byte 32 (s & 1) + i holds sub-block s's low bits, in the low nibble for s < 2
    ql = torch.cat(
        [low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)], dim=-1
    )
    top = q >> 4  # (O, Nb, 2, 4, 32): the 2 high bits
    qh = (
        top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4) | (top[:, :, :, 3] << 6)
    )  # (O, Nb, 2, 32)
    sc8 = sc.to(torch.int8).view(torch.uint8)  # (O, Nb, 16)
    parts = [ql.reshape(O, -1, 128), qh.reshape(O, -1, 64), sc8, half_bytes(d16)]
    return torch.cat(parts, dim=-1).reshape(O, -1)  # (O, R)
