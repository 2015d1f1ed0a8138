"""The study's report files: the sections' figures, ``report.md`` and a self-contained ``report.html``.

A section draws its figures through :func:`multihead.study.figures.draw`; both renderers put each figure
after the section's tables. The HTML is one static page (inline CSS, no script, images referenced by
relative path), so ``report.html`` opens from disk in any browser and the directory can be zipped or
served as is.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .context import Section, Table

__all__ = ["render_html"]


_CSS = """
body { font-family: system-ui, sans-serif; max-width: 75rem; margin: 2rem auto; padding: 0 1rem;
       color: #1b1b1b; background: #fff; line-height: 1.45; }
h1 { border-bottom: 2px solid #444; padding-bottom: .3rem; }
#key-findings { border: 1px solid #8aa; background: #f3f8f8; padding: .2rem 1rem; margin: 1rem 0; }
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


def render_html(
    sections: Sequence[Section], title: str, subtitle: str, findings: Sequence[tuple[str, str]] = ()
) -> str:
    """The whole report as one static HTML page (key findings linked to their sections, tables, figures
    by relative path, notes)."""
    toc = "".join(f'<li><a href="#{html.escape(s.key)}">{_inline(s.title)}</a></li>' for s in sections)
    titles = {s.key: s.title for s in sections}
    box = ""
    if findings:
        items = "".join(
            f'<li>{_inline(text)} <a href="#{html.escape(key)}">({_inline(titles.get(key, key))})</a></li>'
            for key, text in findings
        )
        box = f'<aside id="key-findings"><h2>Key findings</h2><ol>{items}</ol></aside>\n'
    body = "\n".join(_section_html(s) for s in sections)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>\n"
        f"<h1>{html.escape(title)}</h1><p>{_inline(subtitle)}</p>\n{box}<nav><ul>{toc}</ul></nav>\n{body}\n"
        "</body></html>\n"
    )
