"""The study's distributed section: ring attention over 1 and 2 local gloo processes (per-rank memory,
time, bytes sent), from :func:`multihead.bench.distributed.run_distributed_bench`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...bench.distributed import run_distributed_bench

if TYPE_CHECKING:  # study.py imports this module: import its classes at call time, not here
    from ..context import Section, StudyContext

__all__ = ["distributed", "memory_note"]


def distributed(ctx: StudyContext) -> Section:
    """Ring attention scaling: W = 1, 2 (quick, N = 4096) or 1, 2, 4 (full, N = 16384)."""
    from ..context import Section, Table

    sizes, n = ((1, 2), 4096) if ctx.quick else ((1, 2, 4), 16384)
    ctx.step(f"ring attention, N={n}, W={list(sizes)}", 0.0)
    doc = run_distributed_bench(sizes, n)
    base = doc["rows"][0]["peak_bytes"] or 1
    rows = [
        [
            str(r["world_size"]),
            str(r["tokens_per_rank"]),
            f"{r['peak_bytes'] / 2**20:.1f}",
            f"{r['peak_bytes'] / base:.3f}",
            "too short to measure" if r["seconds"] is None else f"{r['seconds']:.2f}",
            f"{r['sent_bytes'] / 2**20:.1f}",
        ]
        for r in doc["rows"]
    ]
    c = doc["config"]
    table = Table(
        f"Ring attention per rank, N={c['seq_len']}, Hq={c['heads']}, D={c['head_dim']}, {c['dtype']}, "
        f"mask={c['mask']}, layout={c['layout']}",
        ["world size", "tokens/rank", "peak MiB/rank", "vs W=1", "time s", "sent MiB/rank"],
        rows,
        align="rrrrrr",
    )
    return Section("distributed", "Distributed: ring attention", doc, [table], [memory_note(doc["rows"])])


def shard_tensors(world: int) -> int:
    """Shard-sized tensors a rank holds at its peak (BENCHMARKS.md, "Ring attention", measured at
    N = 64K): q, k, v, the running output, the step's partial output and workspace (5), plus the K/V in
    flight: none at W=1, the next pair at W=2, the pair computed and the pair arriving from W=3 on."""
    return 5 if world == 1 else 8 if world == 2 else 10


def memory_note(rows: list[dict]) -> str:
    """What the table's own numbers say about per-rank memory as W grows, next to what the count of
    shard-sized tensors (:func:`shard_tensors`) predicts."""
    first, last = rows[0], rows[-1]
    w = last["world_size"]
    head = (
        "Each rank holds one shard of the sequence; K/V shards travel around the ring and partial outputs "
        "merge by log-sum-exp. "
    )
    if not first["peak_bytes"] or not last["peak_bytes"]:
        return head + "Peak memory was not measured here (the probe reads Linux's /proc)."
    ratio = last["peak_bytes"] / first["peak_bytes"]
    mib = [r["peak_bytes"] / 2**20 for r in (first, last)]
    inputs = [r["input_bytes"] / 2**20 for r in (first, last)]
    model = shard_tensors(w) / (shard_tensors(1) * w)
    line = (
        f"Here per-rank peak memory at W={w} is {ratio:.2f}x that of W=1 ({mib[1]:.1f} vs {mib[0]:.1f} MiB; "
        f"the rank's own q, k, v: {inputs[1]:.1f} vs {inputs[0]:.1f} MiB). Counted in shard-sized tensors a "
        f"rank holds {shard_tensors(1)} at W=1 and {shard_tensors(w)} at W={w} (the K/V in flight), which "
        f"predicts {model:.2f}x: "
    )
    line += "the measurement is " + (
        "close to it. " if abs(ratio - model) <= 0.15 else "not (see the table). "
    )
    line += "From W=3 on the count stays at 10, so memory halves with each doubling of W. "
    return head + line + "`multihead bench --distributed N --seq SEQ` measures other N and W."
