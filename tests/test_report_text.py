"""The report's text survives its renderers: a table cell's pipe or line break does not break report.md,
and a bracketed phrase is not taken for rich markup on a terminal (constructed tables, no study run)."""

from __future__ import annotations

import io

from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from multihead.cli.console import make_console
from multihead.study.context import Section, Table, markdown_cell


def _columns_of(line: str) -> int:
    """Cells of a markdown table row: the pipes that are not escaped, less the outer two."""
    return line.replace("\\|", "").count("|") - 1


def test_a_pipe_in_a_header_or_cell_does_not_break_the_markdown_table():
    t = Table("MiniLM | parity", ["reference", "min cosine", "max |diff|"], [["a|b", "0.99", "1e-7\nmore"]])
    lines = t.markdown().splitlines()
    assert lines[0] == "**MiniLM \\| parity**"
    assert lines[2] == "| reference | min cosine | max \\|diff\\| |"
    assert lines[4] == "| a\\|b | 0.99 | 1e-7 more |"
    assert all(_columns_of(line) == 3 for line in lines[2:])


@given(st.lists(st.text(), min_size=1, max_size=4))
def test_every_row_keeps_its_columns_whatever_the_cells_hold(cells):
    t = Table("t", [f"c{i}" for i in range(len(cells))], [cells])
    header, _rule, row = t.markdown().splitlines()[2:]
    assert _columns_of(row) == _columns_of(header) == len(cells) and "\n" not in markdown_cell(
        "\n".join(cells)
    )


def _printed(section: Section, console: Console) -> str:
    section.print(console)
    out = console.file
    assert isinstance(out, io.StringIO)
    return out.getvalue()


def test_bracketed_text_reaches_the_terminal():
    s = Section(
        "k", "title [a]", {},
        [Table("scores [bootstrap 95% interval]", ["model [x]"], [["0.656 [0.612, 0.695] [bold]"]])],
        ["Human-judged scores ([percentile bootstrap 95% interval] over 200 resamples)"],
    )  # fmt: skip
    plain = Console(file=io.StringIO(), width=300, markup=True)  # even a console with markup on
    text = _printed(s, plain)
    for kept in ("[bootstrap 95% interval]", "[x]", "[bold]", "[percentile bootstrap 95% interval]"):
        assert kept in text


def test_the_commands_console_prints_brackets_as_text(capsys):
    make_console().print("the lowest [bootstrap 95% interval] and [red]not red[/red]")
    assert "[bootstrap 95% interval]" in capsys.readouterr().out
