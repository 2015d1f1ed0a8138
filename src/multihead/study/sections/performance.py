"""The study's performance section: ``auto`` against its peers, a selection of ``multihead bench``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...pretrained.files import atomic_write

if TYPE_CHECKING:  # study.py imports this module to register the section: import it at call time
    from ..context import Section, StudyContext

__all__ = ["SLOWER", "one_rate", "performance", "slower_note"]


# -- section (d): performance against peers ----------------------------------------------------------
def _perf_suite(quick: bool) -> list:
    """The quick study's short selection of ``multihead bench`` (a minute); the full study runs the
    bench's quick suite."""
    from ...bench import suite as bench

    if not quick:
        return bench.cases("quick")
    Case = bench.Case
    return [
        *(Case("causal", "causal", n, mask="causal") for n in (1024, 2048)),
        Case("window 512", "window", 4096, mask="window:512"),
        Case("8 causal documents", "documents", 4096, mask="docs:8"),
        *(Case("GQA decode", "decode", n, mask="causal", nq=1, hq=32, hkv=8, d=128) for n in (4096, 16384)),
    ]


#: a time ratio above this is called slower (below it: within the noise of a shared machine)
SLOWER = 1.10


def one_rate(doc: dict) -> None:
    """Quote the report's one measured fp32 matmul rate and bandwidth (:func:`machine_rates`, as the
    walk section) instead of the suite's own probe, rescaling the "% of matmul" column to it."""
    from ...bench import suite as bench
    from ...cost.machine import machine
    from ..context import machine_rates

    rates = machine_rates()
    own = doc["machine"]["matmul_gflops"]
    if set(own) != {"torch.float32"}:  # another dtype ran: keep the suite's own rates
        return
    scale = own["torch.float32"] / rates["torch.float32"]
    for r in doc["results"]:
        if r.get("matmul_frac") is not None:
            r["matmul_frac"] *= scale
        r["matmul_gflops"] = rates["torch.float32"]
    doc["machine"] = {**machine(rates), "threads": doc["machine"]["threads"]}
    doc["goals"] = bench.check_goals(doc["results"])


def slower_note(results: list[dict]) -> str:
    """Every case where auto took more than :data:`SLOWER` times a peer's time outside the noise, read
    off the same verdicts as the table's cells (:func:`multihead.bench.suite.verdicts`): a ratio the
    table calls "same within noise" is never called slower here."""
    from ...bench.suite import verdicts

    slow = [
        f"{r['case']} N={r['n']}: {v.ratio:.2f}x the time of {v.peer}"
        for r in results
        if r["method"] == "auto" and r["ms"] is not None
        for v in verdicts(r)
        if v.slower(SLOWER)
    ]
    if not slow:
        return (
            f"auto is within {SLOWER:.2f}x of every peer's time in every case of this run (or the same "
            "within noise)."
        )
    return (
        f"auto is slower than a peer (by more than {SLOWER:.2f}x, outside the noise) in: "
        + "; ".join(slow)
        + "."
    )


def performance(ctx: StudyContext) -> Section:
    """Speed against peers: ``auto`` vs SDPA (dense mask), SDPA per block and the eager path, as in
    ``multihead bench`` (time ratios measured in the same run)."""
    from ...bench import suite as bench
    from ..context import Section, Table

    suite = _perf_suite(ctx.quick)
    done = [0]

    def progress(what: str) -> None:
        ctx.step(f"bench {what}", done[0] / len(suite))
        done[0] += 1

    doc = bench.run("study", repeats=2 if ctx.quick else 3, progress=progress, suite=suite)
    one_rate(doc)
    m = doc["machine"]
    rows = []
    for r in doc["results"]:
        if r["ms"] is None:
            continue
        peers = bench.vs_text(r) if r["method"] == "auto" else ""
        method = r["method"] + (f" ({r['note']})" if r["note"] else "")
        frac = "-" if r["matmul_frac"] is None else f"{100 * r['matmul_frac']:.0f}"
        rows.append([r["case"], str(r["n"]), method, bench.ms_text(r), bench.gflops_text(r), frac, peers])
    table = Table(
        f"attention speed, fp32, B=1, H=8, D=64 (decode: 32 q / 8 kv heads, D=128); {m['threads']} threads",
        ["case", "N", "method", "ms", "useful GFLOP/s", "% of matmul", "auto's time vs peers"],
        rows,
        align="lrlrrrl",
    )
    notes = [
        "Measured in this run: matmul "
        + ", ".join(f"{v:.1f} GFLOP/s ({k.replace('torch.', '')})" for k, v in m["matmul_gflops"].items())
        + ", memory bandwidth "
        + f"{m['bandwidth_gbps']} GB/s. Ratios below 1 mean auto is faster. Useful FLOPs count only the "
        "(query, key) pairs the mask allows (FlashAttention's convention). `multihead bench --full` runs "
        "the full suite (16K-32K tokens).",
        slower_note(doc["results"]),
    ]
    figures = ctx.figure(
        "performance", "Time vs N per method (log-log), cases with several N.", lambda ax: None
    )
    if figures and ctx.out_dir is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = bench.plot_figure(doc, plt)
        with atomic_write(ctx.out_dir / figures[0].file) as tmp:
            fig.savefig(tmp, dpi=100)
        plt.close(fig)
    return Section("performance", "Performance against peers", doc, [table], notes, figures)
