"""The GPU check: correctness of every backend, the speed table, new masks, and Hugging Face models.

    python benchmarks/gpu_check.py                       # on the first CUDA device; JSON + tables in ./gpu
    python benchmarks/gpu_check.py --device cpu --small  # the same parts at toy sizes (a smoke test)
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --device cpu --small   # with the triton rows

Parts, each with its own time budget (seconds; ``--budget`` scales them) so that the whole check ends in
about five minutes on one H100 / H200, every row printed as it finishes and the JSON written after each
part (a run cut short keeps what it measured):

1. ``correctness`` (:mod:`gpu_correct`): every backend and ``auto`` against the float64 oracle, output
   and gradients, under the numerics rule of ``tests/numerics.py``; the count over tolerance must be 0.
2. ``speed`` (:mod:`gpu_speed`): B=1, H=16, D=128, N=16384 bf16; causal, window 1024, 8 causal
   documents, prefix-LM, soft-cap 30, ALiBi, sinks, forward and forward+backward; multihead ``auto``,
   ``triton`` and ``flex`` (where registered), torch flex_attention compiled, SDPA; first call and warm.
3. ``new masks``: the first call with a new window size, document layout and length vs a warm call.
4. ``hf`` (:mod:`gpu_hf`): a Mistral-shape model's 16K prefill and 4K training step, multihead vs sdpa;
   Gemma-2 and gpt-oss shapes through multihead (which backend served).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import gpu_correct
import gpu_hf
import gpu_speed
import torch
from gpu_timing import Budget

import multihead as mh

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
        rows = gpu_correct.correctness(device, args.small, budget)
        bad = [r for r in rows if r.get("ok") is False or "error" in r]
        return rows, f"{len(rows)} rows, {len(bad)} over tolerance\n\n{gpu_correct.table(rows)}"
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


if __name__ == "__main__":
    main()
