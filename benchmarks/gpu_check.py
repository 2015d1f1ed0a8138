"""The GPU check: correctness of every backend, the speed table, new masks, and Hugging Face models.

    python benchmarks/gpu_check.py                       # on the first CUDA device; JSON + tables in ./gpu
    python benchmarks/gpu_check.py --device cpu --small  # the same parts at toy sizes (a smoke test)
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --device cpu --small   # with the triton rows

Parts, each with its own time budget (seconds; ``--budget`` scales them) so that the whole check ends in
about five minutes on one H100 / H200, every row printed as it finishes and the JSON written after each
part (a run cut short keeps what it measured):

1. ``correctness`` (below): every backend and ``auto`` against the float64 oracle, output and
   gradients, under the numerics rule of ``tests/numerics.py``; the count over tolerance must be 0.
2. ``speed`` (:mod:`gpu_speed`): B=1, H=16, D=128, N=16384 bf16; causal, window 1024, 8 causal
   documents, prefix-LM, soft-cap 30, ALiBi, sinks, forward and forward+backward; multihead ``auto``,
   ``triton`` and ``flex`` (where registered), torch flex_attention compiled, SDPA; first call and warm.
3. ``new masks``: the first call with a new window size, document layout and length vs a warm call.
4. ``hf`` (:mod:`gpu_hf`): a Mistral-shape model's 16K prefill and 4K training step, multihead vs sdpa;
   Gemma-2 and gpt-oss shapes through multihead (which backend served).

The correctness part: for each case (masks, biases, sinks, GQA, a decode step, a ragged length) and
dtype, the output and the gradients of q, k, v of every registered backend (and ``auto``) are compared
with ``backend="reference"`` in float64 on the CPU: the max error may be at most 2x (output) / 3x (each
gradient) the error of the plain same-dtype ``matrix`` path, floor 1e-5. A backend that refuses a call (a
``ValueError`` saying why) is recorded as refused, not as a failure.

Shape legend: B batch, Hq / Hkv query / kv heads, Nq queries, Nk keys, D head dim.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import gpu_hf
import gpu_speed
import torch

import multihead as mh
from multihead.backends import registry
from multihead.bench.gpu_timing import Budget

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.numerics
from tests.numerics import allowed, max_err

BUDGETS = {"correctness": 60.0, "speed": 130.0, "new masks": 35.0, "hf": 60.0}  # seconds on one GPU
SMALL_SCALE = 0.4  # --small: a couple of minutes on a CPU, Triton's interpreter included


def speed_table(rows: list[dict]) -> str:
    methods = ["auto", *gpu_speed.FUSED, "torch flex", "sdpa"]
    head = (
        "| case | auto picks | "
        + " | ".join(f"{m} warm ms (first)" for m in methods)
        + " | speed (peer / ours) |"
    )
    lines = [head, "|" + " --- |" * (len(methods) + 3)]
    for r in rows:
        cells = []
        for m in methods:
            c = r["cells"].get(m, {"skipped": ""})
            first = "-" if c.get("first_ms") is None else f"{c['first_ms']:.0f}"
            cells.append(f"{c['ms']:.3f} ({first})" if "ms" in c else c["skipped"][:40])
        speed = ", ".join(f"{k} {v}" + ("x" if isinstance(v, float) else "") for k, v in r["speed"].items())
        lines.append(f"| {r['case']} | {r['auto_picks']} | " + " | ".join(cells) + f" | {speed} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="toy sizes (a smoke test of the script)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--budget", type=float, default=1.0, help="scale every part's time budget by this")
    ap.add_argument("--parts", default=",".join(BUDGETS), help=f"comma-separated subset of {list(BUDGETS)}")
    ap.add_argument("--out", default="gpu", help="folder for check.json and tables.md")
    ap.add_argument(
        "--cases", default=None, help="speed part: comma-separated case names (e.g. 'causal,window 1024')"
    )
    ap.add_argument(
        "--fused",
        default=",".join(gpu_speed.FUSED),
        help="our fused backends to time by name in the speed and new-mask parts (flex compiles per mask)",
    )
    args = ap.parse_args()
    gpu_speed.FUSED = tuple(f.strip() for f in args.fused.split(",") if f.strip())
    device = torch.device(args.device)
    parts = [p.strip() for p in args.parts.split(",")]
    unknown = [p for p in parts if p not in BUDGETS]
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown}; choose from {list(BUDGETS)}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = {"device": name, "torch": torch.__version__, "backends": mh.backends(), "small": args.small}
    print(f"device {name}, torch {torch.__version__}, backends {mh.backends()}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"meta": meta}
    tables: list[str] = [str(meta)]
    t0 = time.perf_counter()
    for part in parts:
        budget = Budget(BUDGETS[part] * args.budget * (SMALL_SCALE if args.small else 1.0))
        print(f"== {part} (budget {budget.seconds:.0f} s)", flush=True)
        rows, text = run_part(part, device, args, budget)
        result[part] = rows
        tables.append(f"## {part}\n\n{text}")
        print(text, flush=True)
        print(f"== {part}: {budget.spent():.0f} s", flush=True)
        (out / "check.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "tables.md").write_text("\n\n".join(tables) + "\n")
    print(
        f"total {time.perf_counter() - t0:.0f} s; results in {out}/check.json and {out}/tables.md", flush=True
    )


def run_part(part: str, device: torch.device, args, budget: Budget) -> tuple[list[dict], str]:
    if part == "correctness":
        rows = correctness(device, args.small, budget)
        bad = [r for r in rows if r.get("ok") is False or "error" in r]
        return rows, f"{len(rows)} rows, {len(bad)} over tolerance\n\n{table(rows)}"
    if part == "speed":
        torch_flex = device.type == "cuda"  # compiling flex on a CPU takes minutes for the table
        only = None if args.cases is None else [c.strip() for c in args.cases.split(",")]
        rows = gpu_speed.speed(device, args.small, args.repeats, budget, torch_flex, only)
        return rows, speed_table(rows)
    if part == "new masks":
        rows = gpu_speed.new_masks(device, args.small, args.repeats, budget)
        return rows, "\n".join(json.dumps(r) for r in rows)
    rows = gpu_hf.mistral_rows(device, args.small, args.repeats, budget)
    rows += gpu_hf.tiny_rows(device, args.small, budget)
    return rows, "\n".join(json.dumps(r) for r in rows)


# -- the correctness part ------------------------------------------------------------------------------


def cases(n: int, hq: int) -> list[tuple[str, dict]]:
    ids = torch.arange(n) * 3 // n  # (N,) three documents
    out: list[tuple[str, dict]] = [
        ("none", {}),
        ("causal", {"mask": mh.causal()}),
        ("window 64", {"mask": mh.sliding_window(64)}),
        ("causal documents", {"mask": mh.document(ids) & mh.causal()}),
        ("padding", {"mask": mh.padding([n, (2 * n) // 3])}),
        ("prefix-LM", {"mask": mh.prefix_lm(n // 3)}),
        ("causal + ALiBi", {"mask": mh.causal(), "bias": mh.alibi(hq)}),
        ("causal + soft-cap 30", {"mask": mh.causal(), "bias": mh.softcap(30.0)}),
        (
            "causal + sinks",
            {"mask": mh.causal(), "sinks": torch.randn(hq, generator=torch.Generator().manual_seed(3))},
        ),
        ("decode 3 rows", {"mask": mh.causal(), "nq": 3}),
        ("ragged length", {"mask": mh.sliding_window(50), "n": n - 37}),
    ]
    return out


def sizes(small: bool) -> tuple[int, int, int, int, int]:
    """(N, B, Hq, Hkv, D)."""
    return (40, 2, 4, 2, 16) if small else (300, 2, 8, 2, 64)


def correctness(
    device: torch.device, small: bool, budget: Budget, only: list[str] | None = None
) -> list[dict]:
    """One row per (case, dtype, backend), printed as each case finishes; ``only`` picks cases by name."""
    n0, b, hq, hkv, d = sizes(small)
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if device.type == "cuda" else [])
    backends = ["auto", *[x for x in registry.names() if x not in ("reference", "matrix")]]
    rows: list[dict] = []
    for name, kw in cases(n0, hq):
        if only is not None and name not in only:
            continue
        kw = dict(kw)
        n, nq = kw.pop("n", n0), kw.pop("nq", None)
        gold, gold_grads, data = _gold(b, hq, hkv, nq or n, n, d, kw)
        for dtype in dtypes:
            base = _errors("matrix", data, kw, dtype, device, gold, gold_grads)
            for backend in backends:
                if backend == "decode" and (nq or n) > 16:
                    continue  # decode steps only (it refuses more rows and says so)
                if budget.over() or (backend == "flex" and budget.left() < 0.4 * budget.seconds):
                    rows.append(
                        {"case": name, "dtype": _short(dtype), "backend": backend, "skipped": "budget"}
                    )
                    continue
                row = {"case": name, "dtype": _short(dtype), "backend": backend}
                row.update(_judge(_errors(backend, data, kw, dtype, device, gold, gold_grads), base))
                rows.append(row)
                if row.get("ok") is False or "error" in row:
                    print(f"  OVER TOLERANCE {row}", flush=True)
        done = [r for r in rows if r["case"] == name and "ok" in r]
        print(f"  {name}: {len(done)} checked, {sum(not r['ok'] for r in done)} over tolerance", flush=True)
    return rows


def _gold(b, hq, hkv, nq, n, d, kw) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, nq, d, generator=g, dtype=torch.float64)  # (B, Hq, Nq, D)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)  # (B, Hkv, Nk, D)
    v = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)  # (B, Hkv, Nk, D)
    w = torch.randn(b, hq, nq, d, generator=g, dtype=torch.float64)  # (B, Hq, Nq, D) loss weights
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = mh.attention(*ins, **kw, backend="reference")
    grads = torch.autograd.grad((out * w).sum(), ins)
    return out.detach(), list(grads), [q, k, v, w]


def _errors(backend, data, kw, dtype, device, gold, gold_grads) -> dict[str, Any]:
    """{"out": err, "grads": [dq, dk, dv errs]} or {"refused": why} / {"error": what}."""
    ins = [t.to(device, dtype).requires_grad_(True) for t in data[:3]]
    args = dict(kw)
    if args.get("sinks") is not None:
        args["sinks"] = args["sinks"].to(device, dtype)
    try:
        out = mh.attention(*ins, **args, backend=backend)
    except ValueError as e:
        return {"refused": str(e)[:160]}
    except Exception as e:  # a compile failure is a finding, not a crash of the script
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    res: dict[str, Any] = {"out": max_err(out.detach().cpu(), gold)}
    try:
        grads = torch.autograd.grad((out.float() * data[3].to(device, torch.float32)).sum(), ins)
        res["grads"] = [max_err(g.cpu(), r) for g, r in zip(grads, gold_grads, strict=True)]
    except ValueError as e:
        res["grad_refused"] = str(e)[:160]
    except Exception as e:
        res["error"] = f"backward: {type(e).__name__}: {str(e)[:300]}"
    return res


def _judge(res: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    if "out" not in res or "out" not in base:
        return res
    row = dict(res, out_allowed=allowed(base["out"]))
    ok = res["out"] <= row["out_allowed"]
    if "grads" in res and "grads" in base:
        row["grads_allowed"] = [allowed(e, grad=True) for e in base["grads"]]
        ok = ok and all(e <= a for e, a in zip(res["grads"], row["grads_allowed"], strict=True))
    row["ok"] = bool(ok)
    return row


def _short(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[1]


def table(rows: list[dict]) -> str:
    lines = [
        "| case | dtype | backend | out err (allowed) | worst grad err (allowed) | ok |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        head = f"| {r['case']} | {r['dtype']} | {r['backend']} |"
        if "out" not in r:
            what = r.get("refused") or r.get("error") or r.get("skipped", "")
            lines.append(f"{head} {what[:70]} | | {'NO' if 'error' in r else ''} |")
            continue
        grad = ""
        if "grads" in r and "grads_allowed" in r:
            i = max(range(3), key=lambda j: r["grads"][j] / r["grads_allowed"][j])
            grad = f"{r['grads'][i]:.1e} ({r['grads_allowed'][i]:.1e})"
        elif "grad_refused" in r:
            grad = "refused: " + r["grad_refused"][:40]
        lines.append(
            f"{head} {r['out']:.1e} ({r['out_allowed']:.1e}) | {grad} | {'yes' if r['ok'] else 'NO'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
