"""What every study section shares: the run's context, the table and section types, formatting helpers."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable

from .. import cost
from .figures import Figure, draw, render_markdown_figures

__all__ = [
    "Section",
    "StudyContext",
    "Table",
    "dtype_name",
    "human",
    "machine_rates",
    "machine_roof",
    "markdown_cell",
    "markdown_row",
    "one_thread",
    "walk_table",
]


@dataclass(frozen=True)
class StudyContext:
    """What every section receives: the run's options and a hook to report progress within it."""

    quick: bool = True
    #: ``step(what, done)``: "now doing <what>, fraction ``done`` of this section finished" (progress bar)
    step: Callable[[str, float], None] = lambda what, done: None
    #: the report directory, where :meth:`figure` writes PNGs; None draws nothing
    out_dir: Path | None = None

    def figure(self, name: str, caption: str, plot: Callable[[Any], None], **kw: Any) -> list[Figure]:
        """``[Figure]`` of ``plot(ax)`` saved as ``out_dir/name.png``; ``[]`` without a report directory."""
        fig = draw(self.out_dir, name, caption, plot, **kw)
        return [] if fig is None else [fig]


@functools.lru_cache(maxsize=1)
def machine_rates() -> dict[str, float]:
    """This machine's fp32 matmul GFLOP/s (key ``"torch.float32"``) and read GB/s (``"bandwidth"``),
    measured once per process: every section of a report quotes the same rates."""
    from ..cost.machine import machine_rates as measure

    return measure({"torch.float32"})


def machine_roof() -> cost.Roof:
    """The roofline's roof from :func:`machine_rates`."""
    from ..cost.machine import machine

    rates = machine_rates()
    label = f"{machine(rates)['cpu']}, {torch.get_num_threads()} threads, float32 matmul"
    return cost.Roof(rates["torch.float32"] * 1e9, rates["bandwidth"] * 1e9, label)


# -- rendering ---------------------------------------------------------------------------------------
@dataclass
class Table:
    """A table of already-formatted cells; ``align`` has one letter per column, ``l`` or ``r``."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    align: str = ""

    def _align(self, i: int) -> str:
        return self.align[i] if i < len(self.align) else "l"

    def markdown(self) -> str:
        """The table in markdown; every cell, header and the title through :func:`markdown_cell`."""
        rule = ["---:" if self._align(i) == "r" else "---" for i in range(len(self.columns))]
        lines = [
            f"**{markdown_cell(self.title)}**",
            "",
            markdown_row(self.columns),
            "|" + "|".join(rule) + "|",
        ]
        lines += [markdown_row(r) for r in self.rows]
        return "\n".join(lines)

    def rich(self) -> RichTable:
        """The table for a terminal; its text is data, never rich markup (brackets are kept)."""
        t = RichTable(title=escape(self.title), title_justify="left")
        for i, c in enumerate(self.columns):
            t.add_column(escape(c), justify="right" if self._align(i) == "r" else "left")
        for r in self.rows:
            t.add_row(*(escape(c) for c in r))
        return t


def markdown_cell(text: str) -> str:
    """``text`` as one markdown table cell: a pipe would end the cell (escaped as ``\\|``) and a line
    break the row (written as a space)."""
    return " ".join(text.replace("|", "\\|").splitlines())


def markdown_row(cells: list[str]) -> str:
    """One markdown table row of cells escaped by :func:`markdown_cell`."""
    return "| " + " | ".join(markdown_cell(c) for c in cells) + " |"


@dataclass
class Section:
    """One section's result: ``data`` goes to ``--json``; ``tables`` and ``notes`` to the report."""

    key: str
    title: str
    data: dict
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)

    def markdown(self) -> str:
        figs = render_markdown_figures(self.figures)
        parts = [
            f'<a id="{self.key}"></a>\n\n## {self.title}',
            *(t.markdown() for t in self.tables),
            *figs,
            *self.notes,
        ]
        return "\n\n".join(parts) + "\n"

    def print(self, console: Console) -> None:
        console.rule(self.title)
        for t in self.tables:
            console.print(t.rich())
        for n in self.notes:
            console.print(n, highlight=False, markup=False)  # a note's brackets are text


def human(x: float) -> str:
    """``1234567 -> '1.23 M'`` (SI prefixes)."""
    for unit, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= unit:
            return f"{x / unit:.2f} {prefix}"
    return f"{x:.0f}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def walk_table(ops: list[cost.Op], title: str) -> Table:
    """The rows of :func:`multihead.cost.layer_walk` plus a total, as a :class:`Table`."""
    rows = [
        [o.eq, o.name, o.in_shape, o.out_shape, human(o.flops), human(o.bytes), f"{o.intensity:.2f}"]
        for o in [*ops, cost.total(ops)]
    ]
    cols = ["eq", "step", "input", "output", "FLOPs", "bytes", "FLOP/B"]
    return Table(title, cols, rows, align="llllrrr")


@contextmanager
def one_thread() -> Iterator[None]:
    """Run small problems on one intra-op thread: a second one only adds synchronisation, and on a busy
    machine OpenMP's spin-waiting makes the float64 reference several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
