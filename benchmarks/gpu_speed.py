"""The speed table of ``gpu_check.py``: B=1, H=16, D=128, N=16384, bf16 (toy sizes with ``--small``).

Rows: causal, window 1024, 8 causal documents, prefix-LM N/4, causal + soft-cap 30, causal + ALiBi and
causal + sinks, each forward and forward+backward. Columns: multihead ``auto`` (with its pick), each
registered fused backend (``triton``, ``flex``), torch ``flex_attention`` compiled with its own block mask
built once, and torch SDPA (flash where the mask is causal, else with a dense mask or bias; it has no
soft-cap or sinks). Every cell has the first-call time and the warm median; "speed vs X" is X's warm time
over ours (above 1 = faster). Then the new-mask rows: the first call with a new window size, document
layout and length against a warm call and against the same mask's second call, for ``triton`` and
``flex``; for ``triton`` also its tile plan alone (``plan_ms``: the host work and few device ops a new mask
adds before any kernel runs).

Shape legend: B batch, H heads, N tokens, D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import multihead as mh
from multihead.backends.auto import choose
from multihead.bench.gpu_timing import Budget, first_and_warm, once_ms, peer_ratios, warm_ms
from multihead.core.biases import alibi_slopes
from multihead.core.problem import make_problem

FUSED = ("triton", "flex")  # our backends timed by name, where registered
COMPILES_PER_MASK = ("flex", "torch flex")


@dataclass
class Case:
    name: str
    mask: Any
    bias: Any = None
    sinks: torch.Tensor | None = None
    torch_mask: Callable | None = None  # flex mask_mod as a user writes it (None: no mask)
    torch_score: Callable | None = None  # flex score_mod (None: none)
    sdpa: str = "dense"  # "causal" (flash), "dense" (a dense mask / bias), or why it cannot
    extra: dict = field(default_factory=dict)


def sizes(small: bool) -> dict[str, int]:
    return (
        {"B": 1, "H": 2, "N": 256, "D": 16, "W": 64}
        if small
        else {"B": 1, "H": 16, "N": 16384, "D": 128, "W": 1024}
    )


def cases(s: dict[str, int], device: torch.device) -> list[Case]:
    n, w, h = s["N"], s["W"], s["H"]
    ids = (torch.arange(n, device=device) * 8 // n).contiguous()  # (N,) eight equal documents
    slopes = alibi_slopes(h).to(device, torch.float32)  # (H,)
    pre = n // 4

    def causal(b, hh, q, k):
        return q >= k

    def window(b, hh, q, k):
        return (q >= k) & (q - k < w)

    def docs(b, hh, q, k):
        return (ids[q] == ids[k]) & (q >= k)

    def prefix(b, hh, q, k):
        return (k < pre) | (q >= k)

    def softcap(score, b, hh, q, k):
        return 30.0 * torch.tanh(score / 30.0)

    def alibi(score, b, hh, q, k):
        return score - slopes[hh] * (q - k).abs()

    sinks = torch.randn(h, device=device)
    return [
        Case("causal", mh.causal(), torch_mask=causal, sdpa="causal"),
        Case(f"window {w}", mh.sliding_window(w), torch_mask=window),
        Case("8 causal documents", mh.document(ids) & mh.causal(), torch_mask=docs),
        Case("prefix-LM N/4", mh.prefix_lm(pre), torch_mask=prefix),
        Case("causal + soft-cap 30", mh.causal(), mh.softcap(30.0), None, causal, softcap, "no soft-cap"),
        Case("causal + ALiBi", mh.causal(), mh.alibi(h), None, causal, alibi),
        Case("causal + sinks", mh.causal(), sinks=sinks, torch_mask=causal, sdpa="no sinks"),
    ]


_COMPILED: dict[str, Any] = {}


def torch_flex() -> tuple[Any, Any]:
    """torch's compiled flex_attention and its create_block_mask (one of each per process)."""
    if not _COMPILED:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        _COMPILED["attn"] = torch.compile(flex_attention, dynamic=False)
        # The block mask is built once per case, outside the timing, by the eager function: compiling
        # create_block_mask took over 130 s at N=16384 on an H200 (torch 2.11) and spent the part's
        # whole budget before flex_attention itself was timed.
        _COMPILED["mask"] = create_block_mask
    return _COMPILED["attn"], _COMPILED["mask"]


def inputs(s: dict[str, int], device: torch.device, grad: bool) -> list[torch.Tensor]:
    g = torch.Generator(device).manual_seed(0)
    shape = (s["B"], s["H"], s["N"], s["D"])
    return [
        torch.randn(shape, device=device, dtype=torch.bfloat16, generator=g).requires_grad_(grad)
        for _ in range(4)
    ]


def methods(
    c: Case, qkvd: list[torch.Tensor], grad: bool, with_torch_flex: bool
) -> dict[str, Callable | str]:
    """{method: callable, or the reason it cannot serve} for one case."""
    q, k, v, do = qkvd

    def run(body: Callable[[], torch.Tensor]) -> Callable[[], object]:
        if not grad:
            return lambda: _no_grad(body)
        return lambda: torch.autograd.grad(body(), (q, k, v), do)  # no .grad accumulation timed

    def ours(backend: str) -> Callable[[], object]:
        return run(lambda: mh.attention(q, k, v, mask=c.mask, bias=c.bias, sinks=c.sinks, backend=backend))

    out: dict[str, Callable | str] = {"auto": ours("auto")}
    for name in FUSED:
        out[name] = ours(name) if name in mh.backends() else f"'{name}' is not registered here"
    if with_torch_flex and c.sinks is None:
        attn, create = torch_flex()
        n = q.shape[2]
        bm = create(c.torch_mask, None, None, n, n, device=q.device) if c.torch_mask else None
        out["torch flex"] = run(lambda: attn(q, k, v, score_mod=c.torch_score, block_mask=bm))
    elif with_torch_flex:
        out["torch flex"] = "flex_attention has no sinks"
    out["sdpa"] = _sdpa(c, q, k, v, run)
    return out


def _sdpa(c: Case, q, k, v, run) -> Callable | str:
    if c.sdpa == "causal":
        return run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    if c.sdpa != "dense":
        return f"cannot: {c.sdpa}"
    p = make_problem(q.detach(), k.detach(), v.detach(), mask=c.mask, bias=c.bias)
    dense = p.mask.natural(p.ctx, q.device)  # (1, 1, N, N) bool, built before timing
    if p.bias is not None:
        dense = p.bias.natural(p.ctx, q.device, q.dtype).masked_fill(~dense, float("-inf"))  # (1, H, N, N)
    return run(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense))


def _no_grad(body: Callable[[], torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return body()


def speed(
    device: torch.device,
    small: bool,
    repeats: int,
    budget: Budget,
    with_torch_flex: bool,
    only: list[str] | None = None,
) -> list[dict]:
    """One row per (case, direction), printed as each method is timed; ``only`` picks cases by name."""
    s = sizes(small)
    rows: list[dict] = []
    for grad in (False, True):
        qkvd = inputs(s, device, grad)
        for c in cases(s, device):
            if only is not None and c.name not in only:
                continue
            label = f"{c.name}, {'fwd+bwd' if grad else 'fwd'}"
            with torch.no_grad():
                p = make_problem(*qkvd[:3], mask=c.mask, bias=c.bias, sinks=c.sinks)
            picked = choose(p)[0] if not grad else _training_pick(qkvd[:3], c)
            row: dict[str, Any] = {"case": label, "auto_picks": picked, "N": s["N"], "cells": {}}
            for name, fn in methods(c, qkvd, grad, with_torch_flex).items():
                row["cells"][name] = _cell(name, fn, device, repeats, budget)
                print(f"  {label}: {name} {_show(row['cells'][name])}", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            row["speed"] = ratios(row["cells"])
            print(f"  {label}: auto picks {picked}; {row['speed']}", flush=True)
            rows.append(row)
    return rows


def _training_pick(qkv: list[torch.Tensor], c: Case) -> str:
    return choose(make_problem(*qkv, mask=c.mask, bias=c.bias, sinks=c.sinks))[0]


def _cell(name: str, fn: Callable | str, device: torch.device, repeats: int, budget: Budget) -> dict:
    if isinstance(fn, str):
        return {"skipped": fn}
    # Compiling flex costs seconds per case: once the budget is spent only the methods that do not
    # compile per mask keep running, up to half the budget again, so the table stays complete for them.
    if not budget.allows(compiles=name in COMPILES_PER_MASK):
        return {"skipped": f"speed budget of {budget.seconds:.0f} s spent"}
    try:
        return first_and_warm(fn, device, repeats)
    except Exception as e:  # refusals, out of memory, compile failures: recorded, not fatal
        return {"skipped": f"{type(e).__name__}: {str(e)[:160]}"}


def _show(cell: dict) -> str:
    if "ms" not in cell:
        return cell["skipped"][:90]
    return f"{cell['ms']:.3f} ms warm, first call {_ms(cell['first_ms'], '.1f')} ms"


def _ms(x: float | None, spec: str) -> str:
    return "too short to measure" if x is None else format(x, spec)


def ratios(cells: dict[str, dict]) -> dict[str, float | str]:
    """``"ours vs peer"``: the peer's warm time over ours (above 1 = ours faster), or "same within
    noise" where the spreads overlap."""
    return peer_ratios(cells, ("auto", *FUSED), ("sdpa", "torch flex"))


def new_masks(device: torch.device, small: bool, repeats: int, budget: Budget) -> list[dict]:
    """The first call with a new mask (window size, document layout, length) against a warm call."""
    s = sizes(small)
    rows = []
    for backend in FUSED:
        if backend not in mh.backends():
            rows.append({"backend": backend, "skipped": "not registered here"})
            continue
        for grad in (False, True):
            try:
                rows.extend(_new_mask_rows(backend, grad, s, device, repeats, budget))
            except Exception as e:
                rows.append(
                    {"backend": backend, "grad": grad, "skipped": f"{type(e).__name__}: {str(e)[:160]}"}
                )
    return rows


def _plan_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> object:
    """The triton backend's tile plan of a call, built afresh (no cache): what a new mask costs before
    any kernel runs."""
    from multihead.backends.triton import launch, plan

    run = launch.make_launch(make_problem(q, k, v, mask=mask), interpret=False)
    return plan.build_plan(run.problem, *run.fwd_blocks)


def _new_mask_rows(backend, grad, s, device, repeats, budget: Budget) -> list[dict]:
    """Warm ``backend`` on a window and on documents (one compilation per feature set), then time the
    first call of each new mask against the warm call; rows are printed as they finish."""

    def call(q, k, v, mask):
        if not grad:
            with torch.no_grad():
                return mh.attention(q, k, v, mask=mask, backend=backend)
        out = mh.attention(q, k, v, mask=mask, backend=backend)
        return torch.autograd.grad(out.sum(), (q, k, v))

    n, w = s["N"], s["W"]
    if budget.over():
        return [{"backend": backend, "grad": grad, "skipped": "budget spent"}]
    q, k, v, _ = inputs(s, device, grad)
    ids8 = torch.arange(n, device=device) * 8 // n  # (N,)
    for base in (mh.sliding_window(w), mh.document(ids8) & mh.causal()):
        call(q, k, v, base)
    warm = warm_ms(lambda: call(q, k, v, mh.sliding_window(w)), device, min(repeats, 3))  # None: too short
    m = n - 128 - 5  # a new length that is not a multiple of any block size
    q2, k2, v2 = (t.detach()[:, :, :m].clone().requires_grad_(grad) for t in (q, k, v))
    ids7 = torch.sort(torch.randint(0, 7, (n,), device=device)).values  # (N,) seven uneven documents
    # Each mask object made once: a document mask's plan is cached by the object (its ids' identity and
    # version), so the second call below reuses it, as the layers of one forward pass do.
    docs7 = mh.document(ids7) & mh.causal()
    new = [
        ("new window size", (q, k, v), mh.sliding_window(w - 24)),
        ("new document layout", (q, k, v), docs7),
        ("new length", (q2, k2, v2), mh.sliding_window(w)),
    ]
    out = []
    for what, qkv, mask in new:
        fn = functools.partial(call, *qkv, mask)
        row = {"backend": backend, "grad": grad, "what": what, "warm_ms": warm}
        if budget.over():
            row["skipped"] = "budget spent"
        else:
            if backend == "triton":  # the plan alone (host work and its few device ops), never cached
                row["plan_ms"] = once_ms(lambda qkv=qkv, mask=mask: _plan_only(*qkv, mask), device)
            row["first_ms"] = first = once_ms(fn, device)
            row["first_over_warm"] = None if first is None or warm is None else round(first / warm, 2)
            # The same mask's second call, timed the same way as the first (host clock, synchronised):
            # the warm median above comes from back-to-back calls whose host work overlaps the GPU's,
            # so first / second is the new mask's own cost.
            row["second_ms"] = second = once_ms(fn, device)
            row["first_over_second"] = None if first is None or not second else round(first / second, 2)
        print(f"  new mask: {row}", flush=True)
        out.append(row)
    return out
