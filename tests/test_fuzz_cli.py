"""Property tests of the command line's arguments: any value given to any option of any command is
either taken within its documented range or refused by one line ``<command>: error: argument ...`` with
exit status 2; a shortened or misspelt option and an unknown command are refused the same way."""

from __future__ import annotations

import argparse
import contextlib
import io
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multihead.cli import args as cli_args
from multihead.cli.main import build_parser

PARSERS: dict[str, argparse.ArgumentParser] = {}


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
    PARSERS[" ".join(path)] = parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                _walk(sub, (*path, name))


_walk(build_parser(), ())
COMMANDS = {k: p for k, p in PARSERS.items() if k}
# (command, option, action) for every option that takes a value through a type
TYPED = [
    (name, a.option_strings[-1], a)
    for name, p in COMMANDS.items()
    for a in p._actions
    if a.option_strings and a.type is not None
]
# (command, option) for every long option of at least two letters, flags included
LONG = sorted(
    {(name, s) for name, p in COMMANDS.items() for a in p._actions for s in a.option_strings if len(s) > 3}
)
VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.sampled_from(["0", "-0", "1", "-1", "nan", "inf", "-inf", "1e18", "1e308", "0x10", "", " ", "١٢"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=12),
)
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _parse(argv: list[str]) -> tuple[argparse.Namespace | None, int | None, str]:
    """(namespace or None, exit code or None, stderr) of one parse."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return build_parser().parse_args(argv), None, err.getvalue()
        except SystemExit as e:
            return None, int(e.code or 0), err.getvalue()


def test_every_number_goes_through_a_bounded_type():
    """No option reads a number with bare int() or float(): those take 10**30, -5, nan and inf."""
    bare = [(name, opt) for name, opt, a in TYPED if a.type in (int, float)]
    assert bare == [], bare


def test_every_parser_refuses_option_prefixes():
    assert all(p.allow_abbrev is False for p in PARSERS.values())


@FAST
@given(case=st.sampled_from(TYPED), value=VALUES)
def test_any_value_is_taken_in_range_or_refused_in_one_line(case, value):
    name, option, action = case
    ns, code, err = _parse([*name.split(), f"{option}={value}"])
    prog = PARSERS[name].prog
    if ns is None:
        assert code == 2, err
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"{prog}: error: argument {option}"), err
        return
    got = getattr(ns, action.dest)
    for x in got if isinstance(got, list) else [got]:
        if isinstance(x, float):
            assert math.isfinite(x), (option, value, x)
        if isinstance(x, int):
            assert -1 < x <= cli_args.MAX_SEED, (option, value, x)


@FAST
@given(case=st.sampled_from(LONG), data=st.data())
def test_a_shortened_option_is_refused_by_its_command(case, data):
    name, option = case
    cut = data.draw(st.integers(min_value=3, max_value=len(option) - 1))
    short = option[:cut]
    options = {s for a in PARSERS[name]._actions for s in a.option_strings}
    if short in options:
        return
    ns, code, err = _parse([*name.split(), f"{short}=1"])
    assert ns is None and code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"{PARSERS[name].prog}: error: unrecognized arguments: {short}"), err


@FAST
@given(word=st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12))
def test_an_unknown_command_lists_only_documented_commands(word):
    if word in COMMANDS or word.startswith("-"):
        return
    ns, code, err = _parse([word])
    assert ns is None and code == 2, err
    assert err.startswith("multihead: error: argument <command>: invalid choice:"), err
    assert len(err.strip().splitlines()) == 1 and "heads-convert" not in err, err


@given(text=st.integers(min_value=-(2**80), max_value=2**80).map(str))
def test_integer_takes_exactly_its_range(text):
    parse = cli_args.integer(1, 100)
    if 1 <= int(text) <= 100:
        assert parse(text) == int(text)
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=rf"from 1 to 100, got '{text}'"):
            parse(text)


@given(x=st.floats(allow_nan=True, allow_infinity=True))
def test_real_takes_exactly_its_finite_range(x):
    parse = cli_args.real(0.0, 1.0, lo_open=True)
    if math.isfinite(x) and 0 < x <= 1:
        assert parse(repr(x)) == x
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=r"a finite number in \(0, 1\]"):
            parse(repr(x))
