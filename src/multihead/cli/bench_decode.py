"""``multihead bench decode``: decode tokens/s per dtype (fp32, bf16, int8) against transformers'
``generate``, with bytes read per token, the measured read bandwidth and the bandwidth limit."""

from __future__ import annotations

import argparse

from ..bench import decode
from .args import positive_int
from .args import threads as thread_count
from .console import for_terminal
from .threads import threads_option

__all__ = ["register"]


def register(sub) -> None:
    """Register ``decode`` on the subparsers of ``multihead bench``."""
    from ..pretrained import PRESETS

    p = sub.add_parser(
        "decode",
        help="decode tokens/s per dtype against transformers, and the bandwidth limit",
        description=for_terminal(decode.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=decode.DEFAULT_PRESET,
        help=f"model shape, random weights (default {decode.DEFAULT_PRESET}: about 4 CPU-minutes, measured "
        "235 s of CPU time on a 2-core AVX-512 machine, so 2-4 minutes when the machine is idle and "
        "longer when it is busy; llama-tiny: seconds; llama-155m: 8x the weights of llama-20m, longer)",
    )
    p.add_argument(
        "--threads",
        type=thread_count,
        default=None,
        help="torch threads, 1 to the cores (default: torch's own)",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="timed samples per call at least, interleaved; the median counts, with its spread (the "
        "bandwidth probe takes twice as many and its fastest counts; default 3)",
    )
    p.add_argument(
        "--new-tokens",
        type=positive_int,
        default=32,
        help="tokens per timed generate call, >= 2 (default 32)",
    )
    p.add_argument("--prompt", type=positive_int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.set_defaults(func=_cmd_decode)
    threads_option(p, add=False)


def _cmd_decode(args) -> int:
    """Run the decode benchmark with a progress bar and the time left; print the table (or JSON)."""
    from rich.console import Console

    from .progress import eta_progress

    console = Console(highlight=False, markup=False, stderr=args.json)  # row names are data, not markup
    if not console.is_terminal:
        console.width = 160
    with eta_progress() as bar:
        task = bar.add_task("decode benchmark", total=None)

        def step(what: str) -> None:
            t = bar.tasks[task]
            total = None if t.total is None else max(t.total, t.completed + 2)  # short calls: more samples
            bar.update(task, description=what, advance=0 if t.total is None else 1, total=total)

        doc = decode.run(
            args.preset,
            threads=args.threads,
            rounds=args.rounds,
            new_tokens=args.new_tokens,
            prompt=args.prompt,
            progress=step,
            plan=lambda units: bar.update(task, total=units, completed=0),
        )
    if args.json:
        print(decode.to_json(doc))
        return 0
    console.print(decode.render(doc))
    for line in decode.summary_lines(doc):
        console.print(line)
    return 0
