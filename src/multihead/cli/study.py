"""``multihead study``: the whole report on the default workload (tables on the terminal, report.md and
report.html with figures under ``--out``)."""

from __future__ import annotations

import argparse
import json
import textwrap

from ..study import run as study
from .console import check_output_dir, for_terminal, make_console, writing
from .threads import threads_option

__all__ = ["register"]


def _cmd_study(args: argparse.Namespace) -> int:
    """Run the study; print its tables (or its JSON) and write ``--out``/report.md."""
    if args.out is not None:
        check_output_dir(args.out, "--out")
    console = None if args.json else make_console()
    with writing(args.out or ".", "--out", full_only=True):  # the run reads too: only a full disk here
        report = study.run_study(
            quick=args.quick, out_dir=args.out, progress=True, console=console, only=args.only
        )
    if args.json:
        print(json.dumps(report, indent=1))
    elif args.out is not None:
        print(f"wrote {report['report']} and {report['html']} ({len(report['figures'])} figures)")
    return 0


def _wrap(text: str, indent: int = 0) -> str:
    return textwrap.fill(text, width=100, subsequent_indent=" " * indent)


def _summary(f: object) -> str:
    """The first paragraph of a section's docstring as one line of plain text (no Sphinx markup)."""
    para = (f.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(for_terminal(para).split())


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``multihead study`` to the command line's subparsers."""
    p = sub.add_parser(
        "study",
        help="the whole report on the default workload (exactness, cost, KV cache)",
        description="Run the study's sections in order and print their tables:\n"
        + "\n".join(_wrap(f"  {f.__name__:15} {_summary(f)}", 18) for f in study.SECTIONS)
        + "\n\n"
        + _wrap(
            "The report is written into a new folder next to --out and moved into place at the end: an "
            "interrupted run leaves --out as it was."
        ),
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
