"""Study section: the layer of eq. (1)-(13) step by step (shapes, FLOPs, bytes, intensity) and the
roofline of this machine."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ... import cost
from ..context import Section, StudyContext, Table, dtype_name, walk_table
from ..figures import Figure

# -- section (b): the walk through eq. (1)-(13) -------------------------------------------------------
WALK_CONFIG: dict[str, Any] = {"d_model": 512, "n_heads": 8, "d_ff": 2048, "seq_len": 1024}  # original sizes


def _intensity(ops: list[cost.Op], name: str) -> float:
    return next(o.intensity for o in ops if o.name == name)


def _batching_table(dtype: torch.dtype) -> Table:
    """Decode intensity as the batch grows: weights are shared across requests, K/V caches are not."""
    names = ["Q = X W^Q", "S = Q K^T", "A = P V", "U = T3 W1 (FFN up)"]
    batches = [1, 8, 64]
    walks = {b: cost.layer_walk(**WALK_CONFIG, batch=b, dtype=dtype, phase="decode") for b in batches}
    rows = [[n, *(f"{_intensity(walks[b], n):.2f}" for b in batches)] for n in names]
    dt = dtype_name(dtype)
    return Table(
        f"decode intensity (FLOP/B) by batch, {dt}",
        ["step", *(f"B={b}" for b in batches)],
        rows,
        align="lrrr",
    )


def walk(ctx: StudyContext) -> Section:
    """The layer of eq. (1)-(13) at the original Transformer's sizes: prefill and batch-1 decode."""
    prefill = cost.layer_walk(**WALK_CONFIG, phase="prefill")
    decode = cost.layer_walk(**WALK_CONFIG, phase="decode")
    cfg = ", ".join(f"{k}={v}" for k, v in WALK_CONFIG.items())
    dec16 = cost.layer_walk(**WALK_CONFIG, phase="decode", dtype=torch.bfloat16)
    notes = [
        f"Batch-1 decode multiplies each weight matrix by one vector: the Q projection does "
        f"{_intensity(decode, 'Q = X W^Q'):.2f} FLOP/B at fp32 and {_intensity(dec16, 'Q = X W^Q'):.2f} "
        f"at bf16 (prefill: {_intensity(prefill, 'Q = X W^Q'):.0f}), far below any CPU or GPU's "
        "FLOP/byte ratio: decoding is memory-bound (docs/equations.md, section 6). Batching shares the "
        "weight reads "
        "and raises the projections' intensity; the attention matmuls read a private K/V cache per "
        "sequence and stay at 2 x Hq/Hkv FLOPs per cached element at any batch size.",
    ]
    tables = [
        walk_table(prefill, f"prefill, fp32, batch 1, N=1024 ({cfg})"),
        walk_table(decode, "decode one token after 1023 cached, fp32, batch 1"),
        _batching_table(torch.bfloat16),
    ]
    data = {
        "config": WALK_CONFIG,
        "prefill": [o.as_dict() for o in prefill],
        "decode": [o.as_dict() for o in decode],
    }
    roof_table, roof_data, roof_fig = _roofline(ctx)
    tables.append(roof_table)
    data["roofline"] = roof_data
    figures = ctx.figure(
        "walk-intensity",
        "Arithmetic intensity of each step, prefill (N=1024) vs batch-1 decode, fp32 (log scale): "
        "decode's projections sit near 0.5 FLOP/B, memory-bound on any machine.",
        partial(_plot_intensity, prefill, decode),
        size=(7.5, 4.2),
    )
    pts = roof_data["points"]
    mem1 = sum(p["bound"] == "memory" for p in pts["decode B=1"])
    comp64 = [p["name"] for p in pts["decode B=64"] if p["bound"] == "compute"]
    notes.append(
        f"Roofline: this machine measured {roof_data['peak_gflops']:.1f} GFLOP/s (fp32 matmul, the rate "
        "the performance section quotes) and "
        f"{roof_data['bandwidth_gbps']:.1f} GB/s, a ridge at {roof_data['ridge']:.1f} FLOP/B: an op below it "
        f"is memory-bound. Decode at batch 1: {mem1} of {len(pts['decode B=1'])} ops memory-bound. At "
        f"batch 64, compute-bound: {', '.join(comp64) or 'none (the ridge is above 64 x 0.5 FLOP/B)'}; the "
        "attention matmuls S = Q K^T and A = P V stay near 0.5 FLOP/B at any batch (each sequence reads its "
        "own K/V cache)."
    )
    return Section("walk", "The layer, eq. (1)-(13), step by step", data, tables, notes, figures + roof_fig)


def _roofline(ctx: StudyContext) -> tuple[Table, dict, list[Figure]]:
    """The original Transformer's layer ops on this machine's measured roof: prefill, decode B=1, B=64."""
    from ..context import machine_roof

    roof = machine_roof()  # the rate the performance section quotes too
    n = WALK_CONFIG["seq_len"]
    calls = {
        "prefill B=1": cost.estimate("transformer-base", 1, n, phase="prefill", dtype=torch.float32),
        "decode B=1": cost.estimate("transformer-base", 1, n, phase="decode", dtype=torch.float32),
        "decode B=64": cost.estimate("transformer-base", 64, n, phase="decode", dtype=torch.float32),
    }
    points = {
        k: [p for p in c.roofline(roof.peak_flops, roof.bandwidth) if p.part == "layer" and p.flops > 0]
        for k, c in calls.items()
    }
    names = [p.name for p in points["decode B=1"]]
    rows = []
    for name in names:
        cells = [name]
        for key in calls:
            p = next(p for p in points[key] if p.name == name)
            cells.append(f"{p.intensity:.2f} ({p.bound[0]})")
        rows.append(cells)
    table = Table(
        f"roofline, fp32, N={n}: FLOP/B per op and the bound (m = memory, c = compute); ridge "
        f"{roof.ridge:.1f} FLOP/B",
        ["step", *calls],
        rows,
        align="lrrr",
    )
    data = {
        "peak_gflops": roof.peak_flops / 1e9,
        "bandwidth_gbps": roof.bandwidth / 1e9,
        "ridge": roof.ridge,
        "points": {k: [p.as_dict() for p in v] for k, v in points.items()},
    }
    figures: list[Figure] = []
    if ctx.out_dir is not None:
        ctx.out_dir.mkdir(parents=True, exist_ok=True)
        cost.plot_roofline(
            calls, roof, ctx.out_dir / "roofline.png", title="original Transformer layer, fp32"
        )
        figures.append(Figure("roofline.png", f"Roofline of this machine ({roof.label}) with every op."))
    return table, data, figures


def _plot_intensity(prefill: list[cost.Op], decode: list[cost.Op], ax: Any) -> None:
    names = [o.name for o in prefill]
    y = range(len(names))
    ax.barh([i + 0.2 for i in y], [max(o.intensity, 1e-3) for o in prefill], height=0.4, label="prefill")
    ax.barh([i - 0.2 for i in y], [max(o.intensity, 1e-3) for o in decode], height=0.4, label="decode")
    ax.set_yticks(list(y), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("FLOP per byte moved")
    ax.legend(loc="lower right")
