"""``--threads N`` for every command that computes, and the hint when the machine is busier than its
cores. Without ``--threads`` the library picks threads by the work's size
(:func:`multihead.threads.threads_for`: small work runs on one thread)."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

import torch

from ..threads import busy_hint
from .args import threads as thread_count

__all__ = ["threads_option"]

HELP = (
    "torch threads, 1 to the cores (default: chosen by the work's size, one thread for small work; "
    "a machine busier than its cores gets a one-line note)"
)


def threads_option(parser: argparse.ArgumentParser, *, add: bool = True) -> None:
    """Give ``parser`` a ``--threads`` option (``add=False``: it has one) and wrap its ``func`` so the
    command runs on that many torch threads (restored after) and prints the busy-machine hint. Call it
    after ``parser.set_defaults(func=...)``."""
    if add:
        parser.add_argument("--threads", type=thread_count, default=None, help=HELP)
    run = parser.get_default("func")
    if run is None:
        raise ValueError(f"threads_option({parser.prog!r}) must come after set_defaults(func=...)")
    parser.set_defaults(func=functools.partial(_with_threads, run))


def _with_threads(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    before = torch.get_num_threads()
    n = getattr(args, "threads", None)
    if n is not None:
        torch.set_num_threads(n)
    hint = busy_hint(n)
    if hint:
        print(hint, file=sys.stderr)
    try:
        return run(args)
    finally:
        torch.set_num_threads(before)
