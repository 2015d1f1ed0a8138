"""What every command shares: the console it prints to and argument types."""

from __future__ import annotations

import argparse

from rich.console import Console

__all__ = ["make_console", "positive_int"]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def make_console() -> Console:
    """A console on stdout; wide when stdout is not a terminal, so tables do not wrap in files."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 160
    return console
