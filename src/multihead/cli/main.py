"""The ``multihead`` command line (also ``python -m multihead``).

Commands::

    multihead study   [--quick | --full] [--out DIR] [--only NAMES] [--json]   the report (report.md/.html)
    multihead explain [--seq N] [--batch B] [--heads H] [--kv-heads H] [--head-dim D]
                      [--mask causal|none|sliding:W|prefix:N] [--dtype T] [--phase prefill|decode] [--json]
    multihead explain --preset NAME | --hf DIR [--seq N] [--batch B] [--phase P] [--roof measure]
                      a whole model's shape walk, cost table, memory and roofline (explain_cli.py)

Every command has ``--help``, runs with no arguments, and prints a machine-readable result with
``--json``. :func:`main` returns the exit code: 0 on success, 2 on bad arguments or an error the library
reports (the message goes to stderr, without a traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .. import __version__
from ..bench import suite as bench
from ..study import run as study
from . import approx as approx_cli
from . import encode as encode_cli
from . import explain as explain_cli
from . import generate as generate_cli
from . import heads as heads_cli
from . import train as train_cli
from .console import make_console
from .explain import parse_mask

__all__ = ["build_parser", "main", "parse_mask"]


# -- multihead study -----------------------------------------------------------------------------------
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


# -- the parser ----------------------------------------------------------------------------------------
def _first_line(f: object) -> str:
    return next(iter((f.__doc__ or "").strip().splitlines()), "")


def _add_study(sub: argparse._SubParsersAction) -> None:
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
        help="every section on its small workload, about 3-4 minutes on 2 cores (default)",
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


def build_parser() -> argparse.ArgumentParser:
    """The ``multihead`` argument parser with one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="multihead",
        description="Multi-head attention workbench. Every command runs with no arguments; "
        "`multihead <command> --help` lists its options; --json prints machine-readable results.",
    )
    parser.add_argument("--version", action="version", version=f"multihead {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    _add_study(sub)
    explain_cli.register(sub)
    encode_cli.register(sub)
    generate_cli.register(sub)
    bench.add_parser(sub)
    approx_cli.register(sub)
    heads_cli.add_parser(sub)
    train_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (0 ok, 2 bad arguments or a library error).

    Args:
        argv: the arguments without the program name (default ``sys.argv[1:]``).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version and usage errors: argparse has printed the message
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.func(args))
    except (ValueError, OSError) as e:
        print(f"multihead {args.command}: error: {e}", file=sys.stderr)
        return 2
