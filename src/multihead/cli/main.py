"""The ``multihead`` command line (also ``python -m multihead``).

Commands::

    multihead study   [--quick | --full] [--out DIR] [--only NAMES] [--json]   the report (report.md/.html)
    multihead explain [--seq N] [--batch B] [--heads H] [--kv-heads H] [--head-dim D]
                      [--mask causal|none|sliding:W|prefix:N] [--dtype T] [--phase prefill|decode] [--json]
    multihead explain --preset NAME | --hf DIR [--seq N] [--batch B] [--phase P] [--roof measure]
                      a whole model's shape walk, cost table, memory and roofline (cli/explain.py)
    multihead heads convert --to gqa|mla|prune [--recover-minutes M] [--out DIR]   (cli/heads.py)
    multihead eval    [--model DIR] [--bootstrap N] [--json]   human-judged scores (cli/eval.py)
    multihead chat    [--prompt TEXT] [--system TEXT] [--model smollm2|FILE.gguf]   (cli/chat.py)
    multihead serve   [--model M] [--host 127.0.0.1] [--port 8000]   OpenAI-compatible server (cli/serve.py)

Every command has ``--help``, runs with no arguments, and prints a machine-readable result with
``--json``. :func:`main` returns the exit code: 0 on success; 2 on bad arguments or an error a user can
cause (a bad value, a missing or unreadable file, a corrupt checkpoint), printed as one line
``multihead <command>: error: ...`` on stderr; 1 on an unexpected error (one line too; ``multihead
--debug <command>`` shows the traceback); 130 after Ctrl-C (one line, "interrupted"); 141 when the
reader of stdout goes away (``multihead encode --json | head``), quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .. import __version__, startup
from . import approx as approx_cli
from . import bench as bench_cli
from . import chat as chat_cli
from . import encode as encode_cli
from . import eval as eval_cli
from . import explain as explain_cli
from . import generate as generate_cli
from . import heads as heads_cli
from . import serve as serve_cli
from . import study as study_cli
from . import train as train_cli
from .args import Parser
from .console import disk_full
from .explain import parse_mask

__all__ = ["build_parser", "main", "parse_mask"]


def build_parser() -> argparse.ArgumentParser:
    """The ``multihead`` argument parser with one subparser per command."""
    parser = Parser(
        prog="multihead",
        description="Multi-head attention workbench. Every command runs with no arguments; "
        "`multihead <command> --help` lists its options; --json prints machine-readable results.",
    )
    parser.add_argument("--version", action="version", version=f"multihead {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    study_cli.register(sub)
    explain_cli.register(sub)
    encode_cli.register(sub)
    eval_cli.register(sub)
    generate_cli.register(sub)
    chat_cli.register(sub)
    serve_cli.register(sub)
    bench_cli.register(sub)
    approx_cli.register(sub)
    heads_cli.register(sub)
    heads_cli.register_convert(sub)
    train_cli.register(sub)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions a user's input can cause: bad values, files, checkpoints, missing optional packages.

    RuntimeError is here because torch reports bad input (a shape, a dtype, memory) with it, MemoryError
    for an input too large for the machine. (JSON and Unicode decoding errors are ValueErrors.)
    """
    errors: list[type[BaseException]] = [ValueError, OSError, RuntimeError, ImportError, MemoryError]
    try:
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    except ImportError:  # pragma: no cover - safetensors comes with the base install
        pass
    return tuple(errors)


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so that the flush at exit cannot fail again (the
    recipe of Python's documentation, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor behind sys.stdout (tests)
        pass


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if disk_full(e):  # a writer that did not say where: at least say what happened
        return f"the disk is full ({text}); free some space or write the output elsewhere"
    return text if isinstance(e, _user_errors()) else f"{type(e).__name__}: {text}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (0 ok, 2 bad arguments or an error a user can cause,
    1 an unexpected error, 130 interrupted, 141 stdout closed by its reader).

    Args:
        argv: the arguments without the program name (default ``sys.argv[1:]``).
    """
    startup.release()  # Ctrl-C is ours from here: the handlers below, after each command's own cleanup
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]  # accepted after the command too
    command = "multihead"
    try:
        parser = build_parser()
        if argv[:2] == ["heads", "convert"]:  # `heads` takes a text; its convert action has its own parser
            argv = ["heads-convert", *argv[2:]]
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help, --version and usage errors: argparse has printed the message
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        if args.command is None:
            parser.print_help()
            return 0
        command = f"multihead {args.command.replace('-', ' ')}"  # heads-convert is `heads convert`
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, inside the handlers, not at interpreter exit
        return code
    except KeyboardInterrupt:
        if debug:
            raise
        lead = "\n" if sys.stderr.isatty() else ""  # after the terminal's ^C
        print(f"{lead}{command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout is gone (`| head`): nothing left to say to anyone
        _quiet_stdout()
        return 141
    except Exception as e:
        if debug:
            raise
        expected = isinstance(e, _user_errors())
        hint = "" if expected else " (an unexpected error: run `multihead --debug ...` for the traceback)"
        print(f"{command}: error: {_one_line(e)}{hint}", file=sys.stderr)
        return 2 if expected else 1
