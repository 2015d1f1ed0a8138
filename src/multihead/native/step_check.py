"""The self-check of the native decode layers (``decode_layer.c``), run when a build is first loaded.

Two layers of a small LLaMA-style model (pre-LN RMSNorm, rotary positions half-split in one layer and
interleaved in the other, GQA with three kv heads, which two threads share unevenly, head dim 72, SwiGLU)
take one decode step at position 5 of a filled cache, twice from the same state:

- through ``mh_decode_batch`` as one sequence's chunk of one token (``seq`` = 1): the one-row layer loop,
  its products on their own;
- as a one-row step (``seq`` = 0): with two or more threads, the team step (every layer in one parallel
  region, each product's rows shared out across the threads, the kv heads split between them).

Both must give the same bits (the team's promise: the same kernels in the same order), for fp32, bf16
and fp16 weights (fp16 where the build has it), int8 weights in each row layout the build reads, and a
cache of the storage dtype or of int8. The fp32 step is also compared with the same equations in float64
(docs/equations.md, section 6: the decoder layer), so a kernel that is consistently wrong is caught too.
The first load's separate process runs this with at least two threads, so the team is always checked
there; the loading process checks with the threads it has (it changes no thread count).

Shape legend: d model width, Hq / Hkv query / kv heads, G = Hq // Hkv, D head dim, F feed-forward width,
L cache length, P position of the step.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch
from torch import Tensor

from . import layout

__all__ = ["check_steps"]

D_MODEL, HQ, HKV, HEAD, FF, CACHE, POS = 432, 6, 3, 72, 96, 8, 5  # (Hq + 2 Hkv) D d >= 2^18: a team's step
EPS = 1e-5
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _rotary(pos: int) -> tuple[Tensor, Tensor]:
    """cos, sin (D/2,) fp32 at position ``pos`` (base 10000), as RotaryEmbedding's table rows."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD, 2, dtype=torch.float64) / HEAD))  # (D/2,)
    angle = pos * inv  # (D/2,)
    return angle.cos().float(), angle.sin().float()


def _weights(g: torch.Generator) -> list[Tensor]:
    """One layer's fp32 weights: qkv (Hq D + 2 Hkv D, d), o (d, Hq D), w1, w3 (F, d), w2 (d, F)."""
    shapes = [
        ((HQ + 2 * HKV) * HEAD, D_MODEL),
        (D_MODEL, HQ * HEAD),
        (FF, D_MODEL),
        (FF, D_MODEL),
        (D_MODEL, FF),
    ]
    return [torch.randn(o, i, generator=g) / math.sqrt(i) for o, i in shapes]


def _int8(w: Tensor, how: int) -> tuple[Tensor, Tensor]:
    """w (O, I) as int8 rows with fp32 scales per group of 32 (O, ceil(I / 32)) in layout ``how`` (0 in
    column order, 1 blocked, 2 packed): (rows, scales); packed rows hold their scales (both the rows)."""
    O, I = w.shape
    groups = -(-I // 32)
    padded = torch.nn.functional.pad(w, (0, groups * 32 - I)).view(O, groups, 32)  # (O, Gr, 32)
    scale = (padded.abs().amax(-1) / 127.0).clamp_min(1e-8)  # (O, Gr)
    q = torch.round(padded / scale[..., None]).clamp(-127, 127).view(O, -1)[:, :I].to(torch.int8)  # (O, I)
    q = q.contiguous()
    if how == 0:
        return q, scale.contiguous()
    blocked = layout.to_blocked(q).contiguous()  # (O, I)
    if how == 1:
        return blocked, scale.contiguous()
    rows = layout.to_packed(blocked, scale.contiguous())  # (O, R)
    return rows, rows


def _base(g: torch.Generator, interleaved: bool) -> dict[str, Any]:
    """One layer's fp32 weights, norm gains and filled cache, shared by every case."""
    k, v = (torch.randn(1, HKV, CACHE, HEAD, generator=g) for _ in range(2))  # (1, Hkv, L, D) each
    k[:, :, POS:] = v[:, :, POS:] = 0
    gains = [torch.rand(D_MODEL, generator=g) + 0.5 for _ in range(2)]  # (d,) each
    return {"weights": _weights(g), "gains": gains, "cache": (k, v), "interleaved": interleaved}


class _Layer:
    """One layer's tensors for the native call (kept alive here) and its float64 copy."""

    def __init__(self, base: dict[str, Any], dtype: torch.dtype, int8: int | None, int8_cache: bool):
        self.interleaved = base["interleaved"]
        self.f32: list[Tensor] = base["weights"]
        self.g_attn, self.g_ffn = base["gains"]
        if int8 is None:
            self.w = [w.to(dtype).contiguous() for w in self.f32]
            self.s: list[Tensor | None] = [None] * 5
        else:
            pairs = [_int8(w, int8) for w in self.f32]
            self.w, self.s = [p[0] for p in pairs], [p[1] for p in pairs]
        self.layout = 0 if int8 is None else int8
        k, v = self.k_f32, self.v_f32 = base["cache"]  # (1, Hkv, L, D) each, positions < P filled
        if int8_cache:
            self.ks, self.vs = (t.abs().amax(-1) / 127.0 for t in (k, v))  # (1, Hkv, L)
            self.k, self.v = (
                torch.round(t / s.clamp_min(1e-8)[..., None]).to(torch.int8)
                for t, s in ((k, self.ks), (v, self.vs))
            )
        else:
            self.k, self.v = k.to(dtype), v.to(dtype)
            self.ks = self.vs = None
        self.norms = [t.to(dtype) for t in (self.g_attn, self.g_ffn)]

    def cloned(self) -> list[Tensor | None]:
        """Copies of the cache tensors (k, v, k scales, v scales) for one run."""
        return [None if t is None else t.clone() for t in (self.k, self.v, self.ks, self.vs)]


def _args(args_type: Any, kinds: dict, layer: _Layer, cache: list[Tensor | None], dtype: torch.dtype) -> Any:
    """The layer's ``mh_layer_args`` over the cache tensors ``cache``."""
    a = args_type()
    a.g_attn, a.g_ffn = (t.data_ptr() for t in layer.norms)
    a.w[:] = [t.data_ptr() for t in layer.w]
    a.s[:] = [None if s is None else s.data_ptr() for s in layer.s]
    k, v, ks, vs = cache
    assert k is not None and v is not None
    a.k_cache, a.v_cache = k.data_ptr(), v.data_ptr()
    a.k_head_stride, a.v_head_stride = k.stride(1), v.stride(1)
    if ks is not None and vs is not None:
        a.k_scale, a.v_scale, a.s_head_stride = ks.data_ptr(), vs.data_ptr(), ks.stride(1)
    a.group = 32
    a.d, a.Hq, a.Hkv, a.D, a.F = D_MODEL, HQ, HKV, HEAD, FF
    a.eps, a.scale = EPS, 1.0 / math.sqrt(HEAD)
    a.blocked, a.interleaved, a.kind = layer.layout, int(layer.interleaved), kinds[dtype]
    return a


def _step(
    lib: ctypes.CDLL,
    args_type: Any,
    kinds: dict,
    layers: list[_Layer],
    x: Tensor,
    dtype: torch.dtype,
    g_final: Tensor,
    seq: int,
) -> tuple[str | None, list[Tensor]]:
    """One step of ``x`` (d,) through ``layers`` on copies of their caches: (why it failed or None, the
    outputs: the residual stream, the final norm, every cache tensor)."""
    caches = [layer.cloned() for layer in layers]
    n = len(layers)
    args = (args_type * n)(*[_args(args_type, kinds, la, c, dtype) for la, c in zip(layers, caches)])
    cos, sin = _rotary(POS)
    cs, ss = (ctypes.c_void_p * n)(*[cos.data_ptr()] * n), (ctypes.c_void_p * n)(*[sin.data_ptr()] * n)
    xs = x.clone()  # (d,) updated in place
    out = torch.empty_like(xs)  # (d,)
    done = ctypes.c_int64(0)
    status = lib.mh_decode_batch(
        xs.data_ptr(),
        args,
        n,
        POS,
        cs,
        ss,
        g_final.data_ptr(),
        EPS,
        out.data_ptr(),
        ctypes.byref(done),
        1,
        seq,
    )
    if status != 0:
        return f"status {status}", []
    return None, [xs, out, *(t for c in caches for t in c if t is not None)]


def _rms(x: Tensor, g: Tensor) -> Tensor:
    return x / torch.sqrt(x.pow(2).mean() + EPS) * g


def _rope(t: Tensor, interleaved: bool) -> Tensor:
    """Heads t (H, D) float64 rotated at position POS."""
    cos, sin = (c.double() for c in _rotary(POS))  # (D/2,) each
    if interleaved:
        a, b = t[:, 0::2], t[:, 1::2]  # (H, D/2) each
        out = torch.empty_like(t)
        out[:, 0::2], out[:, 1::2] = a * cos - b * sin, b * cos + a * sin
        return out
    a, b = t[:, : HEAD // 2], t[:, HEAD // 2 :]  # (H, D/2) each
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)  # (H, D)


def _reference(layers: list[_Layer], x: Tensor, g_final: Tensor) -> Tensor:
    """The final norm of the step in float64 on the fp32 weights and caches (d,)."""
    h = x.double()
    for la in layers:
        wqkv, wo, w1, w3, w2 = (w.double() for w in la.f32)
        qkv = wqkv @ _rms(h, la.g_attn.double())  # (Hq D + 2 Hkv D,)
        q = _rope(qkv[: HQ * HEAD].view(HQ, HEAD), la.interleaved)  # (Hq, D)
        k_new = _rope(qkv[HQ * HEAD : (HQ + HKV) * HEAD].view(HKV, HEAD), la.interleaved)  # (Hkv, D)
        v_new = qkv[(HQ + HKV) * HEAD :].view(HKV, HEAD)  # (Hkv, D)
        k, v = (
            la.k_f32[0, :, : POS + 1].double().clone(),
            la.v_f32[0, :, : POS + 1].double().clone(),
        )  # (Hkv, P+1, D)
        k[:, POS], v[:, POS] = k_new, v_new
        kq = k.repeat_interleave(HQ // HKV, 0)  # (Hq, P+1, D)
        vq = v.repeat_interleave(HQ // HKV, 0)  # (Hq, P+1, D)
        p = torch.softmax((kq @ q[:, :, None])[..., 0] / math.sqrt(HEAD), -1)  # (Hq, P+1)
        att = (p[:, None, :] @ vq)[:, 0].reshape(-1)  # (Hq D,)
        h = h + wo @ att
        f = _rms(h, la.g_ffn.double())  # (d,)
        h = h + w2 @ (torch.nn.functional.silu(w1 @ f) * (w3 @ f))
    return _rms(h, g_final.double())


def check_steps(
    lib: ctypes.CDLL, args_type: Any, kinds: dict, has_f16: bool, layouts: tuple[int, ...]
) -> str | None:
    """Run the checks of the module doc; the first disagreement found, or None.

    Args:
        lib: the loaded library (its ``mh_decode_batch`` declared).
        args_type: the ctypes mirror of ``mh_layer_args``.
        kinds: torch dtype -> the library's storage kind.
        has_f16: whether the build has fp16 kernels.
        layouts: the int8 row layouts the build reads (0 column order, 1 blocked, 2 packed).
    """
    cases: list[tuple[torch.dtype, int | None, bool]] = [
        (dt, None, False) for dt in _FLOATS if dt != torch.float16 or has_f16
    ]
    cases += [(torch.float32, how, cache) for how in layouts for cache in (False, True)]
    g = torch.Generator().manual_seed(0)
    bases = [_base(g, interleaved) for interleaved in (False, True)]
    x = torch.randn(D_MODEL, generator=g)  # (d,)
    g_final = torch.rand(D_MODEL, generator=g) + 0.5  # (d,)
    for dtype, int8, int8_cache in cases:
        layers = [_Layer(base, dtype, int8, int8_cache) for base in bases]
        what = (
            f"{dtype}"
            if int8 is None
            else f"int8 weights ({('column-order', 'blocked', 'packed')[int8]} rows)"
        )
        what += ", an int8 cache" if int8_cache else ""
        why, one = _step(lib, args_type, kinds, layers, x.to(dtype), dtype, g_final.to(dtype), seq=1)
        why_team, team = _step(lib, args_type, kinds, layers, x.to(dtype), dtype, g_final.to(dtype), seq=0)
        if why or why_team:
            return f"the built decode layers failed ({what}: {why or why_team})"
        if not all(torch.equal(a, b) for a, b in zip(one, team)):
            return f"the built decode step on a team of threads disagrees with its one-row loop ({what})"
        if dtype == torch.float32 and int8 is None:
            ref = _reference(layers, x, g_final)  # (d,)
            err = float(((one[1].double() - ref).abs() / (ref.abs() + 1)).max())
            if not err <= 1e-4:
                return f"the built decode step disagrees with float64 torch (fp32: error {err:.2e})"
    return None
