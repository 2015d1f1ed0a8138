"""The ``multihead`` command line (also ``python -m multihead``).

Commands::

    multihead study   [--quick | --full] [--out DIR] [--only NAMES] [--json]   the report (report.md/.html)
    multihead explain [--seq N] [--batch B] [--heads H] [--kv-heads H] [--head-dim D]
                      [--mask causal|none|sliding:W|prefix:N] [--dtype T] [--phase prefill|decode] [--json]
    multihead explain --preset NAME | --hf DIR [--seq N] [--batch B] [--phase P] [--roof measure]
                      a whole model's shape walk, cost table, memory and roofline (cli/explain.py)
    multihead heads convert --to gqa|mla|prune [--recover-minutes M] [--out DIR]   (cli/heads.py)
    multihead eval    [--model DIR] [--bootstrap N] [--json]   human-judged scores (cli/eval.py)

Every command has ``--help``, runs with no arguments, and prints a machine-readable result with
``--json``. :func:`main` returns the exit code: 0 on success, 2 on bad arguments or an error the library
reports (the message goes to stderr, without a traceback).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__
from . import approx as approx_cli
from . import bench as bench_cli
from . import encode as encode_cli
from . import eval as eval_cli
from . import explain as explain_cli
from . import generate as generate_cli
from . import heads as heads_cli
from . import study as study_cli
from . import train as train_cli
from .explain import parse_mask

__all__ = ["build_parser", "main", "parse_mask"]


def build_parser() -> argparse.ArgumentParser:
    """The ``multihead`` argument parser with one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="multihead",
        description="Multi-head attention workbench. Every command runs with no arguments; "
        "`multihead <command> --help` lists its options; --json prints machine-readable results.",
    )
    parser.add_argument("--version", action="version", version=f"multihead {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    study_cli.register(sub)
    explain_cli.register(sub)
    encode_cli.register(sub)
    eval_cli.register(sub)
    generate_cli.register(sub)
    bench_cli.register(sub)
    approx_cli.register(sub)
    heads_cli.register(sub)
    heads_cli.register_convert(sub)
    train_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (0 ok, 2 bad arguments or a library error).

    Args:
        argv: the arguments without the program name (default ``sys.argv[1:]``).
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["heads", "convert"]:  # `heads` takes a text; its convert action has a parser of its own
        argv = ["heads-convert", *argv[2:]]
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
