"""``multihead approx``: every attention approximation, its quality against its cost, in one table.

    multihead approx                          quick: MiniLM fidelity on 32 docstrings, time/memory at N=1K
    multihead approx --n 1024 4096 16384      the cost at several lengths
    multihead approx --mqar --steps 5000      also train each method on MQAR (tens of minutes per method)
    multihead approx --only Nystrom Performer --png pareto.png --json

Prints the table (or JSON) and, with ``--png``, writes the Pareto plot of quality against time.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .threads import threads_option

__all__ = ["register"]


def _cmd_approx(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from ..bench import approx as measure
    from ..study.sections import approximations as report
    from ..train.trainer import TrainConfig
    from .console import progress_columns, writing

    if args.png:
        _check_png(args)
    names = None
    if args.only:
        names = [measure.METHODS[0].name]  # exact is the reference of every ratio
        for name in args.only:
            matches = [m.name for m in measure.METHODS if name in (m.name, m.name.split("(")[0])]
            if not matches:
                raise ValueError(
                    f"unknown approximation {name!r}; choose from {[m.name for m in measure.METHODS]}"
                )
            names += [m for m in matches if m not in names]
    # the trainer's recipe, scaled: the first 40% of the steps are its short-sequence curriculum
    mqar = TrainConfig(steps=args.steps, short_steps=2 * args.steps // 5) if args.mqar else None
    ns = tuple(args.n)
    with Progress(*progress_columns(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("approx", total=1.0)
        res = report.compare(
            names, ns, args.texts, mqar, lambda what, done: bar.update(task, description=what, completed=done)
        )
    rows: list[dict[str, Any]] = res["rows"]
    if args.json:
        png = None
        if args.png:
            with writing(args.png, "--png"):
                png = measure.pareto_png(rows, args.png, max(ns))
        if args.png and png is None:
            res["notes"].append("no plot: no method has a quality score to plot")
        doc = {
            "ns": list(ns),
            "rows": [{**r, "cost": {str(k): v for k, v in r["cost"].items()}} for r in rows],
        }
        print(json.dumps({**doc, "notes": res["notes"], "png": png}, indent=1))
        return 0
    from .console import make_console

    console = make_console()
    console.print(report.table(rows, ns).rich())  # the table first: nothing after it can lose it
    for note in res["notes"]:
        console.print(note, markup=False)
    if args.png:
        with writing(args.png, "--png"):
            png = measure.pareto_png(rows, args.png, max(ns))
        console.print(
            f"wrote {png}" if png else "no plot: no method has a quality score to plot", markup=False
        )
    return 0


def _check_png(args: argparse.Namespace) -> None:
    """Fail before the work when --png cannot be drawn or written.

    Raises:
        ValueError: nothing to plot (--texts 0 without --mqar), matplotlib missing, or an unwritable path.
    """
    from .console import check_output_file

    if args.texts == 0 and not args.mqar:
        raise ValueError(
            "--png plots quality against time, and --texts 0 without --mqar measures no quality; "
            "give --texts N (MiniLM fidelity) or --mqar, or drop --png"
        )
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--png needs matplotlib, which is not installed: pip install matplotlib") from None
    check_output_file(args.png, "--png")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``approx`` subcommand to the ``multihead`` parser."""
    from .args import count, positive_int

    p = sub.add_parser(
        "approx",
        help="every attention approximation: MiniLM fidelity, MQAR recall, time and memory vs exact",
        description="Compare the approximations of multihead.approx (TopK, Threshold, local windows, "
        "Linformer, Nystrom, LowRank, LinearAttention, Performer) with exact attention: fidelity of the "
        "bundled all-MiniLM-L6-v2's embeddings on real text, MQAR accuracy after training (--mqar), and "
        "the time and peak memory of one attention call at each --n.",
    )
    p.add_argument(
        "--n", type=positive_int, nargs="+", default=[1024], help="sequence lengths (default 1024)"
    )
    p.add_argument(
        "--texts",
        type=count,
        default=32,
        help="docstrings for MiniLM fidelity; 0 skips it (and leaves --png nothing to plot without --mqar) "
        "(default 32)",
    )
    p.add_argument("--mqar", action="store_true", help="also train each method on MQAR (slow: minutes each)")
    p.add_argument("--steps", type=positive_int, default=5000, help="MQAR training steps (default 5000)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="methods to compare (exact is always included)")
    p.add_argument("--png", metavar="FILE", help="write the Pareto plot (quality vs time) to FILE")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=_cmd_approx)
    threads_option(p)
