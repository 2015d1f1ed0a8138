"""``multihead bench``'s results as markdown tables for BENCHMARKS.md (``benchmarks/attention_speed.py``
prints them): one row per case, length and method with its time and spread, useful GFLOP/s and share of
the measured matmul rate, K/V bandwidth, peak memory and the time ratio to its peers; then the goals.
"""

from __future__ import annotations

from . import suite, timing

__all__ = ["markdown"]


def _f(x, spec: str) -> str:
    """``x`` formatted with ``spec``, or "-" for None."""
    return "-" if x is None else format(x, spec)


def markdown(doc: dict) -> str:
    """The results and the goals of one ``multihead bench`` run (:func:`multihead.bench.suite.run`, or
    its ``--json``) as two markdown tables, the machine's line above them; a ratio inside the spread reads
    "same within noise", a call too short for the clock says so instead of a time."""
    m = doc["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['threads']} threads, torch {m['torch']}; measured in the same run: "
        f"matmul {m['matmul_gflops']} GFLOP/s, memory bandwidth {m['bandwidth_gbps']} GB/s.",
        "",
        "| case | N | method | ms (spread) | useful GFLOP/s | % of matmul | GB/s (K/V) | peak extra MiB "
        "| time ratio vs peers |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in doc["results"]:
        method = r["method"] + (f" ({r['note']})" if r["note"] and r["ms"] is not None else "")
        if r["ms"] is None:
            what = timing.TOO_SHORT if timing.TOO_SHORT in r["note"] else "skipped"
            lines.append(f"| {r['case']} | {r['n']} | {method} | {what}: {r['note']} | | | | | |")
            continue
        ours = r["method"] in ("auto", "tiled", "decode")
        vs = suite.vs_text(r) if ours else ""  # a ratio inside the spread reads "same within noise"
        spread = r.get("ms_spread")
        ms = f"{r['ms']:.1f}" + (f" ({spread[0]:.1f}-{spread[1]:.1f})" if spread else "")
        lines.append(
            f"| {r['case']} | {r['n']} | {method} | {ms} | {_f(r['gflops'], '.1f')} | "
            f"{_f(100 * r['matmul_frac'], '.0f')} | {_f(r['gbps'], '.2f')} | {_f(r['peak_mib'], '.0f')} "
            f"| {vs} |"
        )
    lines += ["", "| goal | case | N | measured | met |", "|---|---|---:|---:|---|"]
    for g in doc["goals"]:
        lines.append(
            f"| {g['goal']} | {g['case']} | {g['n']} "
            f"| {timing.SAME if g.get('within_noise') else _f(g['value'], '.3f')} "
            f"| {'yes' if g['met'] else 'NO'} |"
        )
    return "\n".join(lines)
