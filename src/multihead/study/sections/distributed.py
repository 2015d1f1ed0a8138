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
            f"{r['seconds']:.2f}",
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


def memory_note(rows: list[dict]) -> str:
    """What the table's own numbers say about per-rank memory as W grows (no cause it did not measure)."""
    first, last = rows[0], rows[-1]
    w = last["world_size"]
    head = (
        "Each rank holds one shard of the sequence; K/V shards travel around the ring and partial outputs "
        "merge by log-sum-exp, so a rank holds its own q, k, v and output plus two K/V shards in flight, "
        "all of them N/W tokens long. "
    )
    if not first["peak_bytes"] or not last["peak_bytes"]:
        return head + "Peak memory was not measured here (the probe reads Linux's /proc)."
    ratio = last["peak_bytes"] / first["peak_bytes"]
    mib = [r["peak_bytes"] / 2**20 for r in (first, last)]
    inputs = [r["input_bytes"] / 2**20 for r in (first, last)]
    line = (
        f"Here per-rank peak memory at W={w} is {ratio:.2f}x that of W=1 ({mib[1]:.1f} vs {mib[0]:.1f} MiB; "
        f"the rank's own q, k, v: {inputs[1]:.1f} vs {inputs[0]:.1f} MiB). "
    )
    if ratio < 1:
        line += "It falls as the shards shrink. "
    else:
        line += (
            f"It does not fall at N={first['tokens_per_rank']}: what scales with N/W is small here next to "
            "the rest of the peak; the table does not break that rest down. "
        )
    return head + line + "`multihead bench --distributed N --seq SEQ` measures other N and W."
