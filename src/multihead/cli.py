"""The ``multihead`` command line (also ``python -m multihead``).

Commands::

    multihead study   [--quick | --full] [--out DIR] [--json]     the whole report on the default workload
    multihead explain [--seq N] [--batch B] [--heads H] [--kv-heads H] [--head-dim D]
                      [--mask causal|none|sliding:W|prefix:N] [--dtype T] [--phase prefill|decode] [--json]

Every command has ``--help``, runs with no arguments, and prints a machine-readable result with
``--json``. :func:`main` returns the exit code: 0 on success, 2 on bad arguments or an error the library
reports (the message goes to stderr, without a traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch
from rich.console import Console

from . import __version__, approx_cli, bench, cost, encode_cli, generate_cli, study, train_cli
from .functional import _choose, explain
from .masks import Mask, causal, prefix_lm, sliding_window
from .problem import make_problem

__all__ = ["build_parser", "main", "parse_mask"]

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
PICTURE_MAX = 16  # the mask picture shows at most this many query rows and key columns


def parse_mask(spec: str) -> Mask | None:
    """``"none"`` -> None, ``"causal"``, ``"sliding:W"`` -> sliding_window(W), ``"prefix:N"`` -> prefix_lm(N).

    Raises:
        ValueError: on any other spec or a bad number.
    """
    name, _, arg = spec.partition(":")
    if name == "none" and not arg:
        return None
    if name == "causal" and not arg:
        return causal()
    if name in ("sliding", "prefix") and arg.lstrip("-").isdigit():
        return sliding_window(int(arg)) if name == "sliding" else prefix_lm(int(arg))
    raise ValueError(f"unknown mask {spec!r}; use causal, none, sliding:W (e.g. sliding:64) or prefix:N")


def _mask_arg(spec: str) -> str:
    try:
        parse_mask(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _console() -> Console:
    """A console on stdout; wide when stdout is not a terminal, so tables do not wrap in files."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 160
    return console


# -- multihead study -----------------------------------------------------------------------------------
def _cmd_study(args: argparse.Namespace) -> int:
    """Run the study; print its tables (or its JSON) and write ``--out``/report.md."""
    console = None if args.json else _console()
    report = study.run_study(quick=args.quick, out_dir=args.out, progress=True, console=console)
    if args.json:
        print(json.dumps(report, indent=1))
    elif args.out is not None:
        print(f"wrote {report['report']} and {report['html']} ({len(report['figures'])} figures)")
    return 0


# -- multihead explain ---------------------------------------------------------------------------------
def _explain_tensors(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) for the problem on the command line."""
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    nq = 1 if args.phase == "decode" else args.seq
    dtype = DTYPES[args.dtype]
    q = torch.empty(args.batch, args.heads, nq, args.head_dim, dtype=dtype)  # (B, Hq, Nq, D)
    k = torch.empty(args.batch, kv_heads, args.seq, args.head_dim, dtype=dtype)  # (B, Hkv, Nk, D)
    return q, k, k


def _mask_picture(mask: Mask | None, nq: int, nk: int) -> str:
    if mask is None:
        return "mask: none (every query sees every key)"
    small = (min(nq, PICTURE_MAX), min(nk, PICTURE_MAX))
    head = (
        "" if small == (nq, nk) else f"the mask, drawn at {small[0]}x{small[1]} (the problem is {nq}x{nk}):\n"
    )
    return head + mask.picture(*small)


def _cmd_explain(args: argparse.Namespace) -> int:
    """Say which backend ``auto`` picks for the problem, draw its mask, and walk the layer's cost."""
    mask = parse_mask(args.mask)
    q, k, v = _explain_tensors(args)
    text = explain(q, k, v, mask=mask)
    chosen, rejected = _choose(make_problem(q, k, v, mask=mask))
    d_model = args.heads * args.head_dim
    ops = cost.layer_walk(
        d_model=d_model,
        n_heads=args.heads,
        n_kv_heads=k.shape[1],
        d_ff=4 * d_model,
        seq_len=args.seq,
        batch=args.batch,
        dtype=DTYPES[args.dtype],
        phase=args.phase,
        head_dim=args.head_dim,
    )
    picture = _mask_picture(mask, q.shape[2], k.shape[2])
    if args.json:
        doc = {
            "backend": chosen,
            "rejected": rejected,
            "explain": text,
            "mask": picture,
            "walk": [o.as_dict() for o in ops],
        }
        print(json.dumps(doc, indent=1))
        return 0
    console = _console()
    console.print(text, markup=False)
    console.print()
    console.print(picture, markup=False)
    console.print()
    title = f"the layer's cost, {args.phase} (d_model={d_model}, d_ff={4 * d_model}, eq. 9.31-9.43)"
    console.print(study.walk_table(ops, title).rich())
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
        help="the default workload only, a few seconds (default)",
    )
    size.add_argument("--full", dest="quick", action="store_false", help="also the bf16 exactness run")
    p.add_argument(
        "--out",
        metavar="DIR",
        default="multihead-report",
        help="write DIR/report.md, DIR/report.html and the figures (default ./multihead-report)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    p.set_defaults(func=_cmd_study)


def _add_explain(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="which backend auto picks for a problem and why; its mask and cost",
        description="Build an attention problem of the given size, say which backend "
        "`auto` picks and why each other was rejected, draw the mask (at most "
        f"{PICTURE_MAX}x{PICTURE_MAX}), and walk the layer's FLOPs and bytes.",
    )
    p.add_argument("--seq", type=_positive_int, default=1024, help="sequence length N (keys) (default 1024)")
    p.add_argument("--batch", type=_positive_int, default=1, help="batch size B (default 1)")
    p.add_argument("--heads", type=_positive_int, default=8, help="query heads Hq (default 8)")
    p.add_argument("--kv-heads", type=_positive_int, default=None, help="kv heads Hkv (default: --heads)")
    p.add_argument("--head-dim", type=_positive_int, default=64, help="head dim D (default 64)")
    p.add_argument(
        "--mask",
        type=_mask_arg,
        default="causal",
        help="causal | none | sliding:W | prefix:N (default causal)",
    )
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="(default float32)")
    p.add_argument(
        "--phase",
        choices=["prefill", "decode"],
        default="prefill",
        help="prefill: N queries; decode: 1 query against N keys (default prefill)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_explain)


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
    _add_explain(sub)
    encode_cli.register(sub)
    generate_cli.register(sub)
    bench.add_parser(sub)
    approx_cli.register(sub)
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
