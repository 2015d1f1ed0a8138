"""The study's figures: a plot saved as a PNG next to the report, and its markdown."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..pretrained.files import atomic_write

__all__ = ["Figure", "draw", "render_markdown_figures"]


@dataclass(frozen=True)
class Figure:
    """A PNG written next to the report: ``file`` is relative to the report directory."""

    file: str
    caption: str


_SAFE = re.compile(r"[^a-z0-9_.-]+")


def draw(
    out_dir: str | Path | None,
    name: str,
    caption: str,
    plot: Callable[[Any], None],
    *,
    size: tuple[float, float] = (6.4, 3.8),
) -> Figure | None:
    """Draw ``plot(ax)`` on a fresh matplotlib figure, save ``out_dir/name.png``, return its :class:`Figure`.

    Returns None when ``out_dir`` is None (a study run without a report directory draws nothing).

    Raises:
        ValueError: if ``name`` is empty after keeping only ``[a-z0-9_.-]``.
    """
    if out_dir is None:
        return None
    stem = _SAFE.sub("-", name.lower()).strip("-.")
    if not stem:
        raise ValueError(f"figure name {name!r} has no usable characters; use letters, digits, '-' or '_'")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(out_dir) / f"{stem}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=size)
    try:
        plot(ax)
        fig.tight_layout()
        with atomic_write(path) as tmp:
            fig.savefig(tmp, dpi=100)
    finally:
        plt.close(fig)
    return Figure(path.name, caption)


def render_markdown_figures(figures: Sequence[Figure]) -> list[str]:
    """Markdown image lines for a section's figures."""
    return [f"![{f.caption}]({f.file})\n\n*{f.caption}*" for f in figures]


# -- HTML ------------------------------------------------------------------------------------------------
