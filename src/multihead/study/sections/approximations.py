"""The comparison of every approximation in one table (``multihead approx``, the study section).

:func:`compare` measures each method of :data:`~multihead.bench.approx.METHODS` (fidelity on MiniLM,
MQAR accuracy, time and peak memory per length); :func:`table` renders the rows with the study's
:class:`~multihead.study.context.Table`; :func:`approximations` is the study section (listed in
``study.SECTIONS``; this module imports study lazily, so there is no import cycle).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...bench import approx as measure

if TYPE_CHECKING:  # study imports this module to register the section: import it lazily at run time
    from ..context import Section, StudyContext, Table

__all__ = ["approximations", "compare", "empty_column_notes", "table"]


def _minilm(n_texts: int) -> tuple[Any, list[str], Any] | str:
    """(encoder, texts, exact embeddings), or the reason MiniLM is unavailable."""
    try:
        from ...pretrained import minilm, stdlib_docstrings
    except ImportError as e:  # pragma: no cover - the pretrained package is part of multihead
        return str(e)
    try:
        encoder = minilm()
    except ImportError as e:
        return str(e)
    texts = stdlib_docstrings(n_texts)
    return encoder, texts, encoder.encode(texts, packed=False)


def compare(
    names: list[str] | None = None,
    ns: tuple[int, ...] = (1024,),
    n_texts: int = 32,
    mqar: Any = None,
    step: Callable[[str, float], None] = lambda what, done: None,
) -> dict[str, Any]:
    """Measure every method; returns ``{"rows": [...], "notes": [...]}`` (JSON-ready but for int keys).

    Args:
        names: method names (default: all of ``measure.METHODS``).
        ns: sequence lengths of the cost benchmark.
        n_texts: docstrings for the MiniLM fidelity (0 skips it).
        mqar: a :class:`~multihead.train.trainer.TrainConfig` to train each method on MQAR, or None to skip.
        step: progress hook ``step(what, fraction_done)``.

    Raises:
        ValueError: an unknown method name.
    """
    methods = [m for m in measure.METHODS if names is None or m.name in names]
    if names is not None and len(methods) != len(names):
        known = [m.name for m in measure.METHODS]
        raise ValueError(f"unknown approximation in {names}; choose from {known}")
    notes: list[str] = []
    mini = _minilm(n_texts) if n_texts > 0 else None
    if isinstance(mini, str):
        notes.append(f"MiniLM fidelity skipped: {mini}")
        mini = None
    rows: list[dict[str, Any]] = [
        {"name": m.name, "cost": {}, "mean_cos": None, "worst_cos": None, "mqar_acc": None} for m in methods
    ]
    for n in ns:  # every method's calls at one length timed together, interleaved
        step(f"time and memory at N={n}", 0.0)
        fit = {m.name: m.build(max(ns)) for m in methods if m.max_n is None or n <= m.max_n}
        timed = measure.costs(fit, n)
        for row in rows:
            if row["name"] in timed:
                row["cost"][n] = timed[row["name"]]
    for i, (m, row) in enumerate(zip(methods, rows)):
        if mini is not None:
            step(f"{m.name}: MiniLM fidelity", i / len(methods))
            encoder, texts, exact = mini
            approx = m.build(encoder.max_length)
            row.update(
                {"mean_cos": 1.0, "worst_cos": 1.0}
                if approx is None
                else measure.fidelity(encoder, approx, texts, exact)
            )
        if mqar is not None:
            from ...train.trainer import train_mqar

            step(f"{m.name}: MQAR training", i / len(methods))
            res = train_mqar(mqar, m.build(mqar.seq_len))
            row.update({"mqar_acc": res.accuracy, "mqar_causal": res.causal, "mqar_seconds": res.seconds})
    return {"rows": rows, "notes": notes + mqar_notes(rows)}


def mqar_notes(rows: list[dict]) -> list[str]:
    """What the MQAR column cannot show: a note per row whose score rests on MQAR's fixed layout."""
    if not any(measure.mqar_layout_bound(r) for r in rows):
        return []
    return [
        "Linformer's learned (k, max_len) projections are tied to absolute positions, and MQAR always puts "
        "its pairs at the first 2 x n_pairs positions: a Linformer can pass MQAR by keeping those positions "
        "and fails once the pairs move (benchmarks/mqar_shift.py measures it)."
    ]


def empty_column_notes(rows: list[dict], ns: tuple[int, ...]) -> list[str]:
    """Why a column of the table holds "-" or "n/a": one note per column that has such cells."""
    notes = []
    if rows and all(r["mqar_acc"] is None for r in rows):
        notes.append(
            'MQAR acc is "-" for every method: the report does not train (about 25 CPU minutes per method '
            "at MQAR's full size); `multihead approx --mqar` trains each method and fills the column."
        )
    for n in ns:
        costs = [(r["name"], r["cost"][n]) for r in rows if n in r["cost"]]
        unread = [name for name, c in costs if c["peak_bytes"] == 0]
        unknown = [name for name, c in costs if c["peak_bytes"] is None]
        if unknown:
            notes.append(
                f"peak MiB at N={n} is n/a for {', '.join(unknown)}: the resident-set peak is read from "
                "Linux's /proc, which this system does not have."
            )
        if unread:
            notes.append(
                f"peak MiB at N={n} is n/a for {', '.join(unread)}: the probe reads the growth of the "
                "process's peak resident set, and these calls took all their memory from pages the process "
                "already held, so the reading is 0 - not a measurement of zero bytes (less than the "
                "process's earlier peak)."
            )
        skipped = [r["name"] for r in rows if n not in r["cost"]]
        if skipped:
            notes.append(
                f"N={n} is n/a for {', '.join(skipped)}: beyond the longest length the cost benchmark runs "
                "the method at."
            )
    return notes


def _mib(b: int | None) -> str:
    """Peak MiB; "n/a" off Linux and for a reading of 0 (the call's memory came from pages the process
    already held, which the resident-set peak cannot see: not a measured zero)."""
    return "n/a" if not b else f"{b / 2**20:,.1f}"


def _seconds(c: dict) -> str:
    """Seconds per call with the spread of the samples ("0.012 s (0.011-0.013)"), or why none."""
    if c["seconds"] != c["seconds"]:  # nan: too short to measure
        return c.get("why") or "too short to measure"
    spread = c.get("spread")
    return f"{c['seconds']:.3f} s" + ("" if not spread else f" ({spread[0]:.3f}-{spread[1]:.3f})")


def table(rows: list[dict], ns: tuple[int, ...]) -> Table:
    """One row per method: fidelity, MQAR accuracy, time and peak memory per N (relative to exact)."""
    from ..context import Table

    base = next((r for r in rows if r["name"].startswith("exact")), None)
    cols = ["method", "MiniLM cos mean", "worst", "MQAR acc"]
    for n in ns:
        cols += [f"time N={n}", "vs exact", f"peak MiB N={n}"]
    out = []
    for r in rows:
        cells = [
            r["name"],
            "-" if r["mean_cos"] is None else f"{r['mean_cos']:.4f}",
            "-" if r["worst_cos"] is None else f"{r['worst_cos']:.4f}",
            "-"
            if r["mqar_acc"] is None
            else f"{100 * r['mqar_acc']:.2f}%" + ("" if r.get("mqar_causal", True) else " (bidir.)"),
        ]
        for n in ns:
            c = r["cost"].get(n)
            if c is None:
                cells += ["n/a", "", "n/a"]
                continue
            ref = None if base is None else base["cost"].get(n)
            itself = "1.00x" if c["seconds"] == c["seconds"] else ""  # nan: the reference has no time
            rel = itself if r is base else measure.vs_exact(c, ref)
            cells += [_seconds(c), rel, _mib(c["peak_bytes"])]
        out.append(cells)
    title = (
        "approximations: quality against cost (cost: one call, B=1, H=8, D=64, fp32, no mask; the median "
        "of interleaved samples with their quartiles; vs exact: same within noise where they overlap)"
    )
    return Table(title, cols, out, align="lrrr" + "rrr" * len(ns))


def approximations(ctx: StudyContext) -> Section:
    """Every approximation: MiniLM fidelity, time and peak memory vs exact tiled attention.

    Quick: 8 docstrings, N=1024 (about a minute); full: 128 docstrings, N=1K/4K/16K. MQAR accuracy
    needs training (minutes per method): ``multihead approx --mqar`` or ``benchmarks/bench_approx.py``.
    """
    from ..context import Section

    ns = (1024,) if ctx.quick else (1024, 4096, 16384)
    res = compare(ns=ns, n_texts=8 if ctx.quick else 128, step=ctx.step)
    notes = [
        *res["notes"],
        "TopK, Threshold and LowRank form every score (they measure what sparsity or rank costs in quality, "
        "not a speed-up on a CPU); local patterns run on the tiled kernel, which skips the tiles they empty; "
        "Linformer, Nystrom, LinearAttention and Performer are O(N). LowRank stops at N=4096 (dense N x N).",
        "Linformer's projections are learned weights: in the MiniLM fidelity column they are at their random "
        "initialisation (the pretrained model never had them), so its low cosine measures an untrained "
        "Linformer, not a trained one; only the MQAR column trains it.",
    ]
    notes += empty_column_notes(res["rows"], ns)
    data = {
        "ns": list(ns),
        "rows": [{**r, "cost": {str(k): v for k, v in r["cost"].items()}} for r in res["rows"]],
    }
    figures = []
    if ctx.out_dir is not None:
        from ...bench.approx import pareto_png
        from ..figures import Figure

        png = pareto_png(res["rows"], ctx.out_dir / "approx-pareto.png", ns[-1])
        if png is not None:
            figures.append(Figure("approx-pareto.png", f"Quality vs time per attention call at N={ns[-1]}."))
    return Section(
        "approx", "Approximations: what each costs in quality", data, [table(res["rows"], ns)], notes, figures
    )
