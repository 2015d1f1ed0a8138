"""Every command's ``--help`` as a terminal shows it: plain text (no Sphinx markup, no ``%%``), whole
sentences, and the facts a user needs (convert under heads, a train default that takes minutes)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from multihead.cli import study as study_cli
from multihead.cli import train as train_cli
from multihead.cli.main import build_parser, main
from multihead.study import run as study

MARKUP = ("``", ":func:", ":class:", ":mod:", ":meth:", ":data:", ":attr:", "%%")
# a text that ends on one of these words was cut mid-sentence
DANGLING = {"a", "an", "the", "as", "in", "of", "and", "or", "to", "with", "by", "for", "vs", "than"}


def _parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    def walk(parser: argparse.ArgumentParser, path: list[str]):
        yield " ".join(path) or "multihead", parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, [*path, name])

    yield from walk(build_parser(), [])


PARSERS = dict(_parsers())


def _texts(parser: argparse.ArgumentParser) -> list[str]:
    """The description and every argument's help, as printed."""
    fmt = parser._get_formatter()
    texts = [parser.description or ""]
    texts += [fmt._expand_help(a) for a in parser._actions if a.help and a.help != argparse.SUPPRESS]
    return texts


@pytest.mark.parametrize("name", list(PARSERS))
def test_help_is_plain_text(name):
    text = PARSERS[name].format_help()
    assert not [m for m in MARKUP if m in text], text


@pytest.mark.parametrize("name", list(PARSERS))
def test_help_sentences_are_complete(name):
    for text in _texts(PARSERS[name]):
        for para in re.split(r"\n\s*\n", text.strip()):
            words = re.findall(r"[A-Za-z]+", para.splitlines()[-1] if para else "")
            assert not words or words[-1].lower() not in DANGLING, f"{name}: unfinished: {para!r}"


def test_study_help_lists_each_section_once_in_whole_sentences():
    text = PARSERS["study"].format_help()
    for f in study.SECTIONS:
        summary = study_cli._summary(f)
        assert summary.endswith("."), summary
        assert not re.match(r"\(\w+\)", summary), summary  # no letters like "(d)": they repeated
        assert f.__name__ in text
    labels = re.findall(r"^\s+\w+\s+(\(\w+\))", text, flags=re.M)
    assert len(labels) == len(set(labels)), labels
    # the list as printed: each section's entry (its line and the wrapped lines under it) is whole
    listing = text.split("print their tables:\n", 1)[1].split("\n\n", 1)[0]
    entries = re.split(r"\n(?=  \w)", listing)
    assert [e.split()[0] for e in entries] == [f.__name__ for f in study.SECTIONS], entries
    assert all(" ".join(e.split()).endswith(".") for e in entries), entries


def test_heads_help_names_convert(capsys):
    assert "heads convert" in PARSERS["heads"].format_help()
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    assert re.search(r"heads\s+.*convert", top), top


def test_train_runs_minutes_by_default_and_full_is_the_long_recipe():
    from multihead.train.trainer import TrainConfig

    args = build_parser().parse_args(["train"])
    train_cli._resolve_recipe(args)
    assert (args.seq_len, args.pairs, args.steps) == (64, 4, 2000)
    full = build_parser().parse_args(["train", "--full", "--steps", "7"])
    train_cli._resolve_recipe(full)
    assert (full.seq_len, full.pairs, full.steps) == (TrainConfig().seq_len, TrainConfig().n_pairs, 7)
    assert "--full" in PARSERS["train"].format_help()


@pytest.mark.parametrize("module", ["train", "approx", "encode"])
def test_long_commands_show_time_left(module):
    """The progress bars of long commands have a time-remaining column (study's: its own columns)."""
    import importlib
    import inspect

    from rich.progress import TimeRemainingColumn

    from multihead.cli import console

    assert any(isinstance(c, TimeRemainingColumn) for c in console.progress_columns())
    assert "progress_columns(" in inspect.getsource(importlib.import_module(f"multihead.cli.{module}"))
    assert "TimeRemainingColumn()" in inspect.getsource(study.run_sections)
