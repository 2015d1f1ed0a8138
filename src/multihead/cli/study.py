"""``multihead study``: the whole report on the default workload (tables on the terminal, report.md and
report.html with figures under ``--out``)."""

from __future__ import annotations

import argparse
import json

from ..study import run as study
from .console import make_console
from .threads import threads_option

__all__ = ["register"]


def _cmd_study(args: argparse.Namespace) -> int:
    """Run the study; print its tables (or its JSON) and write ``--out``/report.md."""
    console = None if args.json else make_console()
    report = study.run_study(
        quick=args.quick, out_dir=args.out, progress=True, console=console, only=args.only
    )
    if args.json:
        print(json.dumps(report, indent=1))
    elif args.out is not None:
        print(f"wrote {report['report']} and {report['html']} ({len(report['figures'])} figures)")
    return 0


def _first_line(f: object) -> str:
    return next(iter((f.__doc__ or "").strip().splitlines()), "")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``multihead study`` to the command line's subparsers."""
    p = sub.add_parser(
        "study",
        help="the whole report on the default workload (exactness, cost, KV cache)",
        description="Run the study's sections in order and print their tables:\n"
        + "\n".join(f"  {f.__name__:10} {_first_line(f)}" for f in study.SECTIONS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        dest="quick",
        action="store_true",
        default=True,
        help="every section on its small workload, about 4-5 minutes on 2 cores (default)",
    )
    size.add_argument(
        "--full",
        dest="quick",
        action="store_false",
        help="every section on its full workload (bf16 exactness, the bench's quick suite, approximations "
        "at 1K-16K, MiniLM curves at full size, a harder MQAR for the designs); tens of minutes",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        default="multihead-report",
        help="write DIR/report.md, DIR/report.html and the figures (default ./multihead-report)",
    )
    p.add_argument(
        "--only",
        metavar="NAMES",
        default=None,
        help="run only these sections, comma-separated (e.g. walk,kv_cache)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    p.set_defaults(func=_cmd_study)
    threads_option(p)
