"""The pieces of ``multihead bench``: cases, inputs, the methods (ours and peers), FLOPs, memory, rates.

Shape legend: B=1, Hq, Hkv, Nq, Nk = N, D; q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..backends.auto import choose
from ..backends.dense import modify_scores
from ..core import functional as fn_
from ..core.biases import alibi
from ..core.masks import EMPTY, FULL, Mask, causal, document, prefix_lm, sliding_window
from ..core.problem import make_problem
from . import timing

EAGER_MAX_BYTES = 3 << 30  # skip the eager peer when its N x N fp32 scores would exceed this
SDPA_MAX_BYTES = 6 << 30  # skip the dense-mask SDPA peer above this much mask/bias


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    n: int
    mask: str = "none"  # none | causal | window:W | docs:K | prefix:F (prefix = N // F)
    bias: str = "none"  # none | alibi
    nq: int | None = None  # None: Nq = N (prefill)
    hq: int = 8
    hkv: int | None = None
    d: int = 64
    dtype: torch.dtype = torch.float32
    grad: bool = False
    methods: tuple[str, ...] | None = None  # None: ours and every peer that applies

    @property
    def Nq(self) -> int:
        return self.n if self.nq is None else self.nq


def build_mask(spec: str, n: int) -> Mask | None:
    """The mask of a case spec (see :class:`Case`)."""
    name, _, arg = spec.partition(":")
    if name == "none":
        return None
    if name == "causal":
        return causal()
    if name == "window":
        return sliding_window(int(arg))
    if name == "docs":
        ids = torch.arange(n) * int(arg) // n  # (N,) K equal documents
        return document(ids) & causal()
    if name == "prefix":
        return prefix_lm(n // int(arg))
    raise ValueError(f"unknown mask spec {spec!r}")


def make_inputs(case: Case) -> dict:
    hkv = case.hkv or case.hq
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, case.hq, case.Nq, case.d, generator=g).to(case.dtype)  # (B, Hq, Nq, D)
    k = torch.randn(1, hkv, case.n, case.d, generator=g).to(case.dtype)  # (B, Hkv, Nk, D)
    v = torch.randn(1, hkv, case.n, case.d, generator=g).to(case.dtype)  # (B, Hkv, Nk, D)
    if case.grad:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    mask = build_mask(case.mask, case.n)
    bias = alibi(case.hq) if case.bias == "alibi" else None
    return {"q": q, "k": k, "v": v, "mask": mask, "bias": bias}


def allowed_pairs(case: Case, inputs: dict) -> int:
    """Allowed (query, key) pairs, counted tile by tile (full tiles without evaluating the mask)."""
    p = make_problem(inputs["q"], inputs["k"], inputs["v"], mask=inputs["mask"])
    if p.mask is None:
        return p.Nq * p.Nk
    grid = p.grid(512, 512)
    total = 0
    for i, (q0, q1) in enumerate(zip(grid.q_edges[:-1], grid.q_edges[1:])):
        for j, (k0, k1) in enumerate(zip(grid.k_edges[:-1], grid.k_edges[1:])):
            kind = int(grid.kinds[i, j])
            if kind == FULL:
                total += (q1 - q0) * (k1 - k0)
            elif kind != EMPTY:
                total += int(p.mask.block(p.ctx, (q0, q1), (k0, k1))[0, 0].sum())
    return total


def useful_flops(case: Case, inputs: dict) -> float:
    """FlashAttention's convention: 4 * B * Hq * D per allowed pair forward, x3.5 forward+backward."""
    f = 4.0 * case.hq * case.d * allowed_pairs(case, inputs)
    return f * 3.5 if case.grad else f


def kv_bytes(inputs: dict) -> int:
    return sum(t.numel() * t.element_size() for t in (inputs["k"], inputs["v"]))


# -- methods ------------------------------------------------------------------------------------------
def _call(case: Case, inputs: dict, body: Callable[[], Any]) -> Callable[[], object]:
    """Forward only (under no_grad), or forward + backward for training cases."""
    if not case.grad:

        def fwd():
            with torch.no_grad():
                return body()

        return fwd
    dout = torch.randn(1, case.hq, case.Nq, case.d, generator=torch.Generator().manual_seed(1))

    def fwd_bwd():
        for t in (inputs["q"], inputs["k"], inputs["v"]):
            t.grad = None
        body().backward(dout.to(case.dtype))

    return fwd_bwd


def _dense(case: Case, inputs: dict) -> torch.Tensor | None:
    """The mask/bias as SDPA's dense attn_mask: bool (True = attend), or float with -inf where masked."""
    p = make_problem(inputs["q"], inputs["k"], inputs["v"], mask=inputs["mask"], bias=inputs["bias"])
    allowed = None if p.mask is None else p.mask.natural(p.ctx)  # (1, 1, Nq, Nk)
    if p.bias is None:
        return allowed
    dense = p.bias.natural(p.ctx, dtype=case.dtype)  # (1, Hq, Nq, Nk)
    return dense if allowed is None else dense.masked_fill_(~allowed, float("-inf"))


def _dense_bytes(case: Case) -> int:
    return case.Nq * case.n * (4 * case.hq if case.bias != "none" else 1)


def methods(case: Case, inputs: dict, *, flex: bool = False) -> tuple[dict, dict, str]:
    """``({name: callable}, {name: why skipped}, auto's choice)`` for the case: ours first, then peers."""
    q, k, v, mask, bias = (inputs[x] for x in ("q", "k", "v", "mask", "bias"))
    gqa = q.shape[1] != k.shape[1]
    run: dict[str, Callable[[], object]] = {}
    skipped: dict[str, str] = {}
    with torch.no_grad():
        chosen, _ = choose(make_problem(q, k, v, mask=mask, bias=bias))
    run["auto"] = _call(case, inputs, lambda: fn_.attention(q, k, v, mask=mask, bias=bias))
    for name in ("tiled", "decode") if case.family == "decode" else ("tiled",):
        run[name] = _call(case, inputs, _ours(q, k, v, mask, bias, name))
    sdpa = F.scaled_dot_product_attention
    plain = bias is None and (mask is None or (mask.is_causal and case.Nq == case.n))
    if plain:
        run["sdpa"] = _call(case, inputs, lambda: sdpa(q, k, v, is_causal=mask is not None, enable_gqa=gqa))
    elif case.family == "decode" and bias is None:  # one row sees every key: no mask needed
        run["sdpa"] = _call(case, inputs, lambda: sdpa(q, k, v, enable_gqa=gqa))
    elif _dense_bytes(case) > SDPA_MAX_BYTES:
        skipped["sdpa"] = f"the dense mask/bias would take {_dense_bytes(case) / 2**30:.1f} GiB"
    else:
        dense_mask = _dense(case, inputs)
        run["sdpa"] = _call(case, inputs, lambda: sdpa(q, k, v, attn_mask=dense_mask, enable_gqa=gqa))
    if mask is not None and not plain and case.family != "decode":
        blocks = _block_masks(case, inputs)
        run["sdpa/block"] = _call(case, inputs, lambda: _sdpa_per_block(q, k, v, blocks, gqa))
    if case.hq * case.Nq * case.n * 4 > EAGER_MAX_BYTES:
        skipped["eager"] = f"its N x N scores would take {case.hq * case.Nq * case.n * 4 / 2**30:.0f} GiB"
    else:
        dense_e = _dense(case, inputs)
        run["eager"] = _call(case, inputs, lambda: _eager(q, k, v, dense_e))
    if flex:
        from ..backends import flex as flex_mod

        why = flex_mod.BACKEND.unusable()
        if why is None:
            run["flex"] = _call(
                case, inputs, lambda: flex_mod.BACKEND.run(make_problem(q, k, v, mask=mask, bias=bias)).out
            )
        else:
            skipped["flex"] = why
    if case.methods is not None:
        run = {n: f for n, f in run.items() if n in case.methods}
        skipped = {n: w for n, w in skipped.items() if n in case.methods}
    return run, skipped, chosen


def _ours(q, k, v, mask, bias, backend: str) -> Callable[[], Any]:
    return lambda: fn_.attention(q, k, v, mask=mask, bias=bias, backend=backend)


def _block_masks(case: Case, inputs: dict, block: int = 256) -> list:
    """Per 256-row query block: (q0, q1, k0, k1, mask tile) over the keys the block needs."""
    p = make_problem(inputs["q"], inputs["k"], inputs["v"], mask=inputs["mask"], bias=inputs["bias"])
    out: list = []
    assert p.mask is not None  # only masked cases have a per-block peer
    for q0 in range(0, p.Nq, block):
        q1 = min(q0 + block, p.Nq)
        allowed = p.mask.block(p.ctx, (q0, q1), (0, p.Nk))  # (1, 1, nq, Nk)
        cols = allowed.reshape(-1, p.Nk).any(0).nonzero()
        if cols.numel() == 0:
            continue
        k0, k1 = int(cols.min()), int(cols.max()) + 1
        tile = allowed[..., k0:k1]
        if p.bias is not None:
            zeros = torch.zeros(1, 1, q1 - q0, k1 - k0)  # (1, 1, nq, nk)
            tile = modify_scores(zeros, p, (q0, q1), (k0, k1), allowed=tile).to(case.dtype)  # (.., nq, nk)
        out.append((q0, q1, k0, k1, tile))
    return out


def _sdpa_per_block(q, k, v, blocks, gqa: bool) -> torch.Tensor:
    outs = []
    for q0, q1, k0, k1, tile in blocks:
        o = F.scaled_dot_product_attention(
            q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], attn_mask=tile, enable_gqa=gqa
        )
        outs.append(o)
    return torch.cat(outs, dim=2)  # (B, Hq, Nq, D)


def _eager(q, k, v, dense: torch.Tensor | None) -> torch.Tensor:
    """Hugging Face's eager_attention_forward: repeat_kv, matmul, mask, fp32 softmax, matmul."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, Hq, Nk, D) repeat_kv
    w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])  # (B, Hq, Nq, Nk)
    if dense is not None:
        w = w.masked_fill(~dense, float("-inf")) if dense.dtype == torch.bool else w + dense
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v)  # (B, Hq, Nq, D)


# -- the machine --------------------------------------------------------------------------------------
def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return 0


def _trim_heap() -> None:
    """Return free heap pages to the OS (glibc ``malloc_trim``), so that RSS is live memory only."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_extra_bytes(fn: Callable[[], object]) -> float:
    """Growth of the process's peak resident memory during one call (Linux; 0 elsewhere)."""
    if not os.path.exists("/proc/self/clear_refs"):
        fn()
        return 0.0
    _trim_heap()  # freed memory the allocator kept would otherwise absorb this call's allocations
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current resident size
    except OSError:
        pass
    base = _status_kib("VmRSS:")
    fn()
    return max(0, _status_kib("VmHWM:") - base) * 1024.0


def add_bandwidth_ratio(results: list, bandwidth: float) -> None:
    """Each result's GB/s as a fraction of ``bandwidth``; above 100% none, and a note that the probe or
    the byte count is wrong (:func:`multihead.bench.timing.fraction_of_limit`)."""
    for r in results:
        if r.gbps is not None and r.bw_frac is None and "above the bandwidth" not in r.note:
            try:
                r.bw_frac = timing.fraction_of_limit(r.gbps, bandwidth)
            except ValueError:
                r.note = "; ".join(x for x in (r.note, "above the bandwidth: probe or byte count wrong") if x)
