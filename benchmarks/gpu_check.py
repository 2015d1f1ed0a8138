"""Every exact backend on a CUDA device: correctness against the float64 oracle, then speed against SDPA.

    python benchmarks/gpu_check.py                      # on the first CUDA device, results as JSON in ./gpu
    python benchmarks/gpu_check.py --device cpu --small  # the same checks at toy sizes (a smoke test)

Part 1, correctness: for each exact backend (``matrix``, ``sdpa``, ``tiled``, ``decode``, and ``flex``
where it is registered), masks (none, causal, sliding window, causal documents, padding, prefix-LM),
biases (ALiBi, soft-cap), attention sinks, GQA, prefill and decode shapes, in fp32 and bf16: the output
and the gradients of q, k, v against ``backend="reference"`` computed in float64 on the CPU. The error is
``max |ours - ref| / max |ref|``; a backend that refuses a call (a ``ValueError`` that says why) is
recorded as refused, not as a failure.

Part 2, speed (bf16, batch 1): each backend that serves the case, ``auto`` (with the backend it picks),
torch SDPA (plain where the mask is causal or absent, else with the dense mask or bias built before
timing) and compiled FlexAttention; CUDA-event timing, median of ``--repeats`` after warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import multihead as mh
from multihead.backends import registry
from multihead.backends.auto import choose
from multihead.bench.methods import build_mask
from multihead.core.problem import make_problem

EXACT = [n for n in registry.names() if n != "reference"]


def masks(n: int) -> dict[str, Any]:
    ids = torch.arange(n) * 3 // n  # (N,) three documents
    return {
        "none": None,
        "causal": mh.causal(),
        "window 64": mh.sliding_window(64),
        "documents": mh.document(ids) & mh.causal(),
        "padding": mh.padding([n, (2 * n) // 3]),
        "prefix-LM": mh.prefix_lm(n // 3),
    }


def correctness(device: torch.device, small: bool, flex_budget_s: float = 100.0) -> list[dict]:
    """Part 1: one row per (case, backend, dtype); compiled flex stops after ``flex_budget_s`` seconds."""
    flex_spent = 0.0
    n, b, hq, hkv, d = (40, 2, 4, 2, 16) if small else (300, 2, 8, 2, 64)
    cases: list[tuple[str, dict]] = [(f"prefill {m}", {"mask": mk}) for m, mk in masks(n).items()]
    cases += [
        ("causal + ALiBi", {"mask": mh.causal(), "bias": mh.alibi(hq)}),
        ("causal + soft-cap 30", {"mask": mh.causal(), "bias": mh.softcap(30.0)}),
        ("causal + sinks", {"mask": mh.causal(), "sinks": torch.randn(hq)}),
        ("decode 3 rows", {"mask": mh.causal(), "nq": 3}),
    ]
    rows = []
    for name, kw in cases:
        nq = kw.pop("nq", n)
        g = torch.Generator().manual_seed(0)
        q = torch.randn(b, hq, nq, d, generator=g, dtype=torch.float64)  # (B, Hq, Nq, D)
        k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)  # (B, Hkv, Nk, D)
        v = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)  # (B, Hkv, Nk, D)
        w = torch.randn(b, hq, nq, d, generator=g, dtype=torch.float64)  # (B, Hq, Nq, D) loss weights
        ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
        sinks = kw.get("sinks")
        ref = mh.attention(*ref_in, **kw, backend="reference")
        (ref * w).sum().backward()
        ref_grads = [t.grad for t in ref_in]
        for dtype in (torch.float32, torch.bfloat16):
            for backend in EXACT:
                if backend == "decode" and nq > 16:
                    continue  # decode steps only (it refuses more rows and says so)
                if backend == "flex" and flex_spent > flex_budget_s:
                    continue
                t0 = time.perf_counter()
                row: dict[str, Any] = {"case": name, "backend": backend, "dtype": str(dtype).split(".")[1]}
                ins = [t.to(device, dtype).requires_grad_(True) for t in (q, k, v)]
                args = dict(kw)
                if sinks is not None:
                    args["sinks"] = sinks.to(device, dtype)
                try:
                    out = mh.attention(*ins, **args, backend=backend)
                except ValueError as e:
                    row["refused"] = str(e).split(":")[0][:120]
                    rows.append(row)
                    continue
                except Exception as e:  # a compile failure (flex) is a finding, not a crash of the script
                    row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                    rows.append(row)
                    continue
                row["out_err"] = rel_err(out, ref)
                try:
                    (out.float() * w.to(device, torch.float32)).sum().backward()
                    row["grad_err"] = max(
                        rel_err(t.grad, r) for t, r in zip(ins, ref_grads) if t.grad is not None
                    )
                except Exception as e:
                    row["grad_refused"] = f"{type(e).__name__}: {str(e)[:120]}"
                tol = 2e-5 if dtype == torch.float32 else 2e-2
                row["ok"] = row["out_err"] <= tol and row.get("grad_err", 0.0) <= 2 * tol
                rows.append(row)
                if backend == "flex":
                    flex_spent += time.perf_counter() - t0
    return rows


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.detach().double().cpu()
    return float((x.detach().double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def timed(fn: Callable[[], object], device: torch.device, repeats: int, slow_ms: float = 1000.0) -> float:
    """Median milliseconds of ``fn`` after a warm-up call (CUDA events on a GPU). A method whose timed
    first call takes over ``slow_ms`` is reported from that one call (a slow path needs no median, and
    repeating it would spend the lease)."""
    fn()
    times: list[float] = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        if times[0] > slow_ms:
            break
    return statistics.median(times)


def speed_cases(small: bool) -> list[dict]:
    s = 16 if small else 1
    big = 16384 // s
    return [
        {"name": "dense", "n": 4096 // s},
        {"name": "causal", "n": 4096 // s, "mask": "causal"},
        {"name": "causal", "n": big, "mask": "causal"},
        {"name": "window 512", "n": big, "mask": "window:512"},
        {"name": "8 causal documents", "n": big, "mask": "docs:8"},
        {"name": "causal + ALiBi", "n": 8192 // s, "mask": "causal", "bias": True},
        {"name": "prefix-LM 1/4", "n": 8192 // s, "mask": "prefix:4"},
        {"name": "GQA decode 32/8", "n": big, "mask": "causal", "nq": 1, "hq": 32, "hkv": 8, "d": 128},
        {"name": "GQA decode 32/8", "n": 8 * big, "mask": "causal", "nq": 1, "hq": 32, "hkv": 8, "d": 128},
        {"name": "fwd+bwd causal", "n": 8192 // s, "mask": "causal", "grad": True},
        {"name": "fwd+bwd window 256", "n": 8192 // s, "mask": "window:256", "grad": True},
    ]


def speed(device: torch.device, small: bool, repeats: int, flex: bool, flex_budget_s: float) -> list[dict]:
    """Part 2: one row per (case, method)."""
    rows: list[dict] = []
    flex_spent = 0.0
    for c in sorted(speed_cases(small), key=lambda c: c["n"]):  # small first: a timeout keeps the most rows
        label, picked, methods = case_methods(c, device, flex)
        for method, fn in methods.items():
            row: dict[str, Any] = {"case": label, "method": method, "auto_picks": picked}
            t0 = time.perf_counter()
            if method == "flex" and flex_spent > flex_budget_s:
                row["skipped"] = f"flex compile budget of {flex_budget_s:.0f} s spent"
                rows.append(row)
                continue
            try:
                row["ms"] = timed(fn, device, repeats)
            except Exception as e:  # refusals, out of memory, compile failures: recorded, not fatal
                row["skipped"] = f"{type(e).__name__}: {str(e)[:160]}"
            if method == "flex":
                flex_spent += time.perf_counter() - t0
            rows.append(row)
            took = f"{row['ms']:.3f} ms" if "ms" in row else row["skipped"][:80]
            print(f"  {label}: {method} {took} (auto picks {picked})", flush=True)  # partial results survive
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def case_methods(
    c: dict, device: torch.device, flex: bool
) -> tuple[str, str, dict[str, Callable[[], object]]]:
    """``(label, auto's pick, {method: callable})`` for one speed case, inputs built on ``device``."""
    n, nq, hq, d = c["n"], c.get("nq", c["n"]), c.get("hq", 16), c.get("d", 64)
    hkv = c.get("hkv", hq)
    dt = torch.bfloat16
    g = torch.Generator(device).manual_seed(0)
    q = torch.randn(1, hq, nq, d, device=device, dtype=dt, generator=g)  # (1, Hq, Nq, D)
    k = torch.randn(1, hkv, n, d, device=device, dtype=dt, generator=g)  # (1, Hkv, Nk, D)
    v = torch.randn(1, hkv, n, d, device=device, dtype=dt, generator=g)  # (1, Hkv, Nk, D)
    grad = c.get("grad", False)
    if grad:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    mask = build_mask(c.get("mask", "none"), n)
    bias = mh.alibi(hq) if c.get("bias") else None
    with torch.no_grad():
        picked, _ = choose(make_problem(q, k, v, mask=mask, bias=bias))

    def call(body: Callable[[], torch.Tensor]) -> Callable[[], object]:
        if not grad:
            return lambda: _no_grad(body)
        return lambda: body().sum().backward()

    def ours(backend: str) -> Callable[[], object]:
        return call(lambda: mh.attention(q, k, v, mask=mask, bias=bias, backend=backend))

    methods = {"auto": ours("auto")}
    for name in EXACT:
        if not ((name == "flex" and not flex) or (name == "decode" and nq > 16)):
            methods[name] = ours(name)
    gqa = hq != hkv
    sdpa = F.scaled_dot_product_attention
    if (bias is None and (mask is None or (mask.is_causal and nq == n))) or nq == 1:
        causal = mask is not None and nq == n
        methods["torch sdpa"] = call(lambda: sdpa(q, k, v, is_causal=causal, enable_gqa=gqa))
    elif nq * n * (4 * hq if bias is not None else 1) <= 6 << 30:
        p = make_problem(q, k, v, mask=mask, bias=bias)
        dense = None if p.mask is None else p.mask.natural(p.ctx, device)  # (1, 1, Nq, Nk) bool
        if p.bias is not None:
            fb = p.bias.natural(p.ctx, device, dt)  # (1, Hq, Nq, Nk)
            dense = fb if dense is None else fb.masked_fill_(~dense, float("-inf"))
        methods["torch sdpa + dense mask"] = call(lambda: sdpa(q, k, v, attn_mask=dense, enable_gqa=gqa))
    return f"{c['name']} N={n}", picked, methods


def _no_grad(body: Callable[[], torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return body()


def speed_table(rows: list[dict]) -> str:
    lines = ["| case | auto picks | method | ms | vs torch SDPA |", "| --- | --- | --- | ---: | ---: |"]
    peer: dict[str, float] = {}
    for r in rows:
        if r["method"].startswith("torch sdpa") and "ms" in r:
            peer[r["case"]] = r["ms"]
    for r in rows:
        ms = r.get("ms")
        base = peer.get(r["case"])
        ratio = f"{ms / base:.2f}x" if ms is not None and base else ""
        cell = f"{ms:.3f}" if ms is not None else r.get("skipped", "")[:60]
        lines.append(f"| {r['case']} | {r['auto_picks']} | {r['method']} | {cell} | {ratio} |")
    return "\n".join(lines)


def correctness_table(rows: list[dict]) -> str:
    lines = [
        "| case | dtype | backend | out err | grad err | ok |",
        "| --- | --- | --- | ---: | ---: | --- |",
    ]
    for r in rows:
        head = f"| {r['case']} | {r['dtype']} | {r['backend']} |"
        if "refused" in r or "error" in r:
            what = (
                f"refused: {r['refused'][:50]} | | |"
                if "refused" in r
                else f"ERROR {r['error'][:70]} | | NO |"
            )
            lines.append(f"{head} {what}")
            continue
        grad = f"{r['grad_err']:.1e}" if "grad_err" in r else r.get("grad_refused", "")[:40]
        lines.append(f"{head} {r['out_err']:.1e} | {grad} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="toy sizes (a smoke test of the script)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-flex", action="store_true", help="do not time compiled FlexAttention")
    ap.add_argument("--flex-budget", type=float, default=120.0, help="seconds of flex compiling at most")
    ap.add_argument("--out", default="gpu", help="folder for correctness.json, speed.json and tables.md")
    args = ap.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, backends {EXACT}", flush=True)
    t0 = time.perf_counter()
    corr = correctness(device, args.small, args.flex_budget)
    bad = [r for r in corr if r.get("ok") is False]
    took = time.perf_counter() - t0
    print(f"correctness: {len(corr)} rows, {len(bad)} over tolerance, {took:.0f} s", flush=True)
    print(correctness_table(corr), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": name, "torch": torch.__version__}
    (out / "correctness.json").write_text(
        json.dumps({"meta": meta, "rows": corr}, indent=1)
    )  # kept if timed out
    t1 = time.perf_counter()
    sp = speed(device, args.small, args.repeats, not args.no_flex, args.flex_budget)
    print(f"speed: {time.perf_counter() - t1:.0f} s", flush=True)
    print(speed_table(sp), flush=True)
    (out / "speed.json").write_text(json.dumps({"meta": meta, "rows": sp}, indent=1))
    (out / "tables.md").write_text(f"{meta}\n\n{correctness_table(corr)}\n\n{speed_table(sp)}\n")


if __name__ == "__main__":
    main()
