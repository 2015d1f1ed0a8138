"""The study's report files: the sections' figures, ``report.md`` and a self-contained ``report.html``.

A section draws a figure through :func:`draw` (matplotlib, Agg backend) into the report directory and
lists the returned :class:`Figure` in its ``figures``; both renderers put each figure after the section's
tables. The HTML is one static page (inline CSS, no script, images referenced by relative path), so
``report.html`` opens from disk in any browser and the directory can be zipped or served as is.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .study import Section, Table

__all__ = ["Figure", "draw", "render_html", "render_markdown_figures"]


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
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return Figure(path.name, caption)


def render_markdown_figures(figures: Sequence[Figure]) -> list[str]:
    """Markdown image lines for a section's figures."""
    return [f"![{f.caption}]({f.file})\n\n*{f.caption}*" for f in figures]


# -- HTML ------------------------------------------------------------------------------------------------
_CSS = """
body { font-family: system-ui, sans-serif; max-width: 75rem; margin: 2rem auto; padding: 0 1rem;
       color: #1b1b1b; background: #fff; line-height: 1.45; }
h1 { border-bottom: 2px solid #444; padding-bottom: .3rem; }
h2 { margin-top: 2.5rem; border-bottom: 1px solid #bbb; }
nav ul { columns: 2; }
table { border-collapse: collapse; margin: 1rem 0; font-size: .9rem; }
caption { text-align: left; font-weight: 600; padding: .3rem 0; }
th, td { border: 1px solid #ccc; padding: .25rem .5rem; }
th { background: #f0f0f0; }
td.r { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1rem 0; }
figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: .9rem; color: #444; }
p.note { max-width: 60rem; }
"""


def _inline(text: str) -> str:
    """Escape text, keeping markdown's **bold** and `code` (the only inline markup the sections use)."""
    out = html.escape(text)
    out = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", out)


def _table_html(t: Table) -> str:
    head = "".join(f"<th>{_inline(c)}</th>" for c in t.columns)
    body = []
    for row in t.rows:
        cells = []
        for i, cell in enumerate(row):
            cls = ' class="r"' if t._align(i) == "r" else ""
            cells.append(f"<td{cls}>{_inline(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><caption>{_inline(t.title)}</caption><tr>{head}</tr>{''.join(body)}</table>"


def _section_html(s: Section) -> str:
    parts = [f'<section id="{html.escape(s.key)}"><h2>{_inline(s.title)}</h2>']
    parts += [_table_html(t) for t in s.tables]
    for f in s.figures:
        src = html.escape(f.file, quote=True)
        alt = html.escape(f.caption, quote=True)
        parts.append(
            f'<figure><img src="{src}" alt="{alt}"><figcaption>{_inline(f.caption)}</figcaption></figure>'
        )
    parts += [f'<p class="note">{_inline(n)}</p>' for n in s.notes]
    parts.append("</section>")
    return "\n".join(parts)


def render_html(sections: Sequence[Section], title: str, subtitle: str) -> str:
    """The whole report as one static HTML page (tables, figures by relative path, notes)."""
    toc = "".join(f'<li><a href="#{html.escape(s.key)}">{_inline(s.title)}</a></li>' for s in sections)
    body = "\n".join(_section_html(s) for s in sections)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>\n"
        f"<h1>{html.escape(title)}</h1><p>{_inline(subtitle)}</p>\n<nav><ul>{toc}</ul></nav>\n{body}\n"
        "</body></html>\n"
    )
