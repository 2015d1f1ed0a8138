"""``multihead bench hf``: multihead inside a Hugging Face model against transformers' "sdpa", "eager" and
"flex_attention" (prefill time, peak memory, exactness; decode tokens/s through ``generate``)."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def _lengths(text: str) -> list[int]:
    """argparse type: comma-separated token counts, e.g. ``4096,8192``."""
    from .args import positive_int

    try:
        out = [positive_int(t) for t in text.split(",") if t.strip()]
    except argparse.ArgumentTypeError:
        out = []
    if not out:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive lengths like 4096,8192, got {text!r}"
        )
    return out


def _impls(text: str) -> list[str]:
    from ..bench.hf import IMPLS

    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in out if t not in IMPLS]
    if not out or bad:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated names from {','.join(IMPLS)}, got {text!r}"
        )
    return out


def register(sub) -> None:
    """Add ``hf`` to the subparsers of ``multihead bench``."""
    from .args import count, positive_int
    from .args import threads as thread_count

    p = sub.add_parser(
        "hf",
        help="multihead as a transformers attention backend vs sdpa, eager and flex_attention",
        description=(
            "A Mistral-shaped random-weight model (2 layers, d=512, 8 heads, sliding window 1024, fp32, "
            "batch 1) with attn_implementation='multihead' against transformers' 'sdpa', 'eager' and "
            "'flex_attention': prefill wall time and peak extra memory at each length (each implementation "
            "in its own worker process, rounds interleaved), max |diff| against sdpa, and decode tokens/s "
            "through generate. Needs transformers (pip install multihead[hf])."
        ),
    )
    p.add_argument(
        "--lengths",
        type=_lengths,
        default=[4096, 8192, 16384],
        help="prefill lengths, comma-separated (default 4096,8192,16384; 32768 works too)",
    )
    p.add_argument("--repeats", type=positive_int, default=3, help="interleaved timed rounds (default 3)")
    p.add_argument(
        "--new-tokens", type=count, default=64, help="tokens generate makes in the decode rows; 0 skips (64)"
    )
    p.add_argument("--prompt", type=positive_int, default=512, help="decode prompt length (default 512)")
    p.add_argument(
        "--impls",
        type=_impls,
        default=None,
        help="implementations, comma-separated (default multihead,sdpa,eager,flex_attention; sdpa always)",
    )
    p.add_argument(
        "--eager-cap", type=positive_int, default=8192, help="skip eager above this many tokens (8192)"
    )
    p.add_argument(
        "--threads", type=thread_count, default=1, help="torch threads per worker, 1 to the cores (default 1)"
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also the model with an attention that computes nothing: the peak memory no impl goes below",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    p.set_defaults(func=_cmd_bench_hf)


def _cmd_bench_hf(args: argparse.Namespace) -> int:
    """Run the benchmark with a status line on stderr; print the tables (or JSON)."""
    import importlib.util

    from rich.console import Console

    from ..bench import hf

    if importlib.util.find_spec("transformers") is None:
        print("multihead bench hf needs transformers: pip install multihead[hf]")
        return 1
    err = Console(stderr=True, highlight=False)
    with err.status("bench hf") as status:
        doc = hf.run(
            args.lengths,
            repeats=args.repeats,
            new_tokens=args.new_tokens,
            prompt=args.prompt,
            impls=args.impls or hf.IMPLS,
            eager_cap=args.eager_cap,
            threads=args.threads,
            floor=args.floor,
            progress=lambda what: status.update(what),
        )
    if args.json:
        print(hf.to_json(doc))
        return 0
    from .console import make_console

    console = make_console()
    for t in hf.tables(doc):
        console.print(t)
    return 0
