"""The command line's parser and argument types, shared by every command.

Every number a user gives is checked against its range when it is parsed (sizes and counts up to
:data:`MAX_COUNT`, seeds up to :data:`MAX_SEED`, threads up to the cores, floats finite), so a bad value
ends before any work. Every usage error is one line, ``multihead <command>: error: ...`` with exit
status 2; options must be spelt out whole (no prefixes: ``--max-new`` is not ``--max-new-tokens``), and
a misspelt option or command gets the closest name as a hint.
"""

from __future__ import annotations

import argparse
import difflib
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

__all__ = [
    "MAX_COUNT",
    "MAX_MINUTES",
    "MAX_SEED",
    "Parser",
    "count",
    "integer",
    "minutes",
    "positive_int",
    "real",
    "seed",
    "threads",
]

#: the largest size or count an option takes (2**31 - 1: every size fits a 32-bit index)
MAX_COUNT = 2**31 - 1
#: the largest seed: the trainer derives 64-bit stream seeds from it as ``(seed << 32) + step``
MAX_SEED = 2**32 - 1
#: the longest run a time option asks for: a week
MAX_MINUTES = 7 * 24 * 60.0


def _closest(word: str, names: Iterable[str]) -> str | None:
    """The name ``word`` most likely meant: one it starts, else the nearest by spelling."""
    names = sorted(names)
    if not word.strip("-"):
        return None
    starts = [n for n in names if n.startswith(word)]
    if starts:
        return min(starts, key=len)
    bare = {n.lstrip("-"): n for n in names}  # the dashes every option shares say nothing
    near = difflib.get_close_matches(word.lstrip("-"), list(bare), n=1, cutoff=0.7)
    return bare[near[0]] if near else None


class _Commands(argparse._SubParsersAction):
    """Subcommands whose unrecognized arguments are the subcommand's error (it names itself and knows
    its options), not the top level's."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        super().__call__(parser, namespace, values, option_string)
        extras = vars(namespace).pop(argparse._UNRECOGNIZED_ARGS_ATTR, None)
        if extras:
            sub = self._name_parser_map[values[0]]
            assert isinstance(sub, Parser)
            sub.unrecognized(extras)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser with no option prefixes, one-line errors and hidden commands.

    Args:
        hidden: a command reached by another spelling (``heads-convert`` is ``heads convert``): its
            parent neither lists it in ``--help`` nor in the choices of an error.
        allow_abbrev: False: an option is recognized by its whole name only.
    """

    def __init__(self, *args: Any, hidden: bool = False, allow_abbrev: bool = False, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = allow_abbrev
        super().__init__(*args, **kwargs)
        self.hidden = hidden
        self.register("action", "parsers", _Commands)

    def error(self, message: str) -> NoReturn:
        """Print ``{prog}: error: {message}`` as one line on stderr and exit with status 2."""
        line = " ".join(message.split())
        sys.stderr.write(f"{self.prog}: error: {line} (`{self.prog} --help` lists the options)\n")
        raise SystemExit(2)

    def unrecognized(self, extras: Sequence[str]) -> NoReturn:
        """Refuse arguments this parser does not know, with the closest option as a hint."""
        options = [s for a in self._actions for s in a.option_strings]
        hint = ""
        first = next((e.split("=", 1)[0] for e in extras if e.startswith("-")), None)
        guess = None if first is None else _closest(first, options)
        if guess is not None:
            hint = f"; did you mean {guess}?"
        self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """As ArgumentParser.parse_args, with :meth:`unrecognized`'s hint."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.unrecognized(extras)
        return parsed

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """An invalid choice lists only the documented ones and suggests the closest."""
        if action.choices is None or value in action.choices:
            return
        choices = action.choices
        pairs = choices.items() if isinstance(choices, dict) else ((c, None) for c in choices)
        shown = [str(name) for name, sub in pairs if not getattr(sub, "hidden", False)]
        guess = _closest(str(value), shown) if isinstance(value, str) else None
        hint = f"; did you mean {guess!r}?" if guess is not None else ""
        msg = f"invalid choice: {value!r} (choose from {', '.join(shown)}){hint}"
        raise argparse.ArgumentError(action, msg)


# -- argument types: each returns the value or raises ArgumentTypeError naming the range ---------------
def _parse_int(text: str) -> int | None:
    t = text.strip()
    body = t[1:] if t[:1] in "+-" else t
    return int(t) if body.isdigit() and body.isascii() else None


def integer(lo: int = 1, hi: int = MAX_COUNT, *, unit: str = "") -> Callable[[str], int]:
    """An argparse type: a whole number from ``lo`` to ``hi`` (written in decimal digits).

    Args:
        lo, hi: the range, both included.
        unit: what the number counts, for the message ("threads").
    """
    what = f" {unit}" if unit else ""

    def parse(text: str) -> int:
        n = _parse_int(text)
        if n is None or not lo <= n <= hi:
            if hi == MAX_COUNT:
                rule = f"an integer >= {lo}" + (f" (at most {hi})" if n is not None and n > hi else "")
            else:
                rule = f"an integer from {lo} to {hi}"
            raise argparse.ArgumentTypeError(f"expected {rule}{what}, got {text!r}")
        return n

    parse.__name__ = "integer"  # argparse names the type in "invalid integer value" messages
    return parse


#: an argparse type: a size or count >= 1
positive_int = integer(1)
#: an argparse type: a count >= 0
count = integer(0)
#: an argparse type: a seed from 0 to :data:`MAX_SEED`
seed = integer(0, MAX_SEED)


def threads(text: str) -> int:
    """An argparse type: torch threads, from 1 to the cores this process may run on (more threads than
    cores only wait for each other, and thousands fail inside the thread library)."""
    from ..threads import cores

    n = cores()
    try:
        return integer(1, n)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected an integer from 1 to {n} (the CPU cores this process may run on), got {text!r}"
        ) from None


def real(
    lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False
) -> Callable[[str], float]:
    """An argparse type: a finite float in the range from ``lo`` to ``hi`` (an end is left out when it
    is open)."""
    left, right = ("(" if lo_open else "["), (")" if hi_open else "]")
    rule = f"a finite number in {left}{lo:g}, {hi:g}{right}"
    if math.isinf(hi):
        rule = f"a finite number {'>' if lo_open else '>='} {lo:g}"

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            x = math.nan
        inside = (lo < x if lo_open else lo <= x) and (x < hi if hi_open else x <= hi)
        if not math.isfinite(x) or not inside:
            raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}")
        return x

    parse.__name__ = "real"
    return parse


#: an argparse type: minutes of wall time, from 0 to a week
minutes = real(0.0, MAX_MINUTES)
