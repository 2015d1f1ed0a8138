"""The study: the whole report on the embedded default workload (``multihead study``).

A study is the list :data:`SECTIONS` of functions ``section(ctx: StudyContext) -> Section``. Each returns
its data as a JSON-ready dict plus the tables and notes that render it, as markdown (``report.md``) or as
rich tables on a terminal. Later issues add a section by appending a function to the list.

Sections today:
    exactness  every backend against the float64 ``reference`` (gold), forward and gradient
    walk       the layer of eq. (1)-(13) (docs/equations.md) step by step: shapes, FLOPs, bytes, intensity
    kv_cache   KV-cache size of MHA vs GQA vs MQA
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .. import temporaries
from .context import Section, StudyContext, Table, human, walk_table
from .findings import key_findings
from .references import references
from .render import render_html
from .sections.approximations import approximations
from .sections.designs import designs
from .sections.distributed import distributed
from .sections.exactness import exactness
from .sections.heads import heads
from .sections.kv_cache import kv_cache
from .sections.minilm import minilm
from .sections.performance import performance
from .sections.real_lm import real_lm
from .sections.walk import walk

__all__ = ["SECTIONS", "Section", "StudyContext", "Table", "human", "run_study", "walk_table"]


SECTIONS: list[Callable[[StudyContext], Section]] = [
    exactness,
    walk,
    kv_cache,
    performance,
    minilm,
    real_lm,
    approximations,
    heads,
    designs,
    distributed,
]


# -- the study ---------------------------------------------------------------------------------------
def select_sections(only: str | list[str] | None) -> list[Callable[[StudyContext], Section]]:
    """The sections named in ``only`` (comma-separated names or a list), in :data:`SECTIONS` order;
    all of them for None.

    Raises:
        ValueError: a name that is not a section's.
    """
    if only is None:
        return list(SECTIONS)
    names = [n.strip() for n in (only.split(",") if isinstance(only, str) else only) if n.strip()]
    known = [f.__name__ for f in SECTIONS]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown study section(s) {unknown or names!r}; choose from {','.join(known)}")
    return [f for f in SECTIONS if f.__name__ in names]


def run_sections(
    quick: bool = True,
    progress: bool = True,
    out_dir: Path | None = None,
    only: str | list[str] | None = None,
) -> list[Section]:
    """Run the sections of :data:`SECTIONS` (or those in ``only``) in order, with a progress bar on
    stderr; figures go to ``out_dir`` (none are drawn without it).

    Raises:
        ValueError: an unknown name in ``only``.
    """
    chosen = select_sections(only)
    results = []
    # the time left is a rough guess: it assumes the sections left take as long as those done
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), TextColumn("eta"),
               TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=not progress) as bar:
        task = bar.add_task("study", total=len(chosen))
        for i, section in enumerate(chosen):
            name = section.__name__
            bar.update(task, description=f"study: {name}", completed=i)
            step = partial(_describe, bar, task, name, i)
            results.append(section(StudyContext(quick, step, out_dir)))
        bar.update(task, completed=len(chosen))
    return results


def _describe(bar: Progress, task: TaskID, section: str, index: int, what: str, done: float) -> None:
    bar.update(task, description=f"study: {section}: {what}", completed=index + done)


def render_markdown(sections: list[Section], quick: bool) -> str:
    """The whole report as markdown."""
    from .. import __version__

    head = (
        f"# multihead study ({'quick' if quick else 'full'})\n\nmultihead {__version__}, "
        f"torch {torch.__version__}\n"
    )
    found = key_findings(sections)
    if found:
        titles = {s.key: s.title for s in sections}
        lines = [f"{i}. {text} ([{titles[key]}](#{key}))" for i, (key, text) in enumerate(found, 1)]
        head += "\n## Key findings\n\n" + "\n".join(lines) + "\n"
    return "\n".join([head, *(s.markdown() for s in sections)])


#: the files a report folder holds; a folder with anything else is not replaced
REPORT_SUFFIXES = (".md", ".html", ".png", ".json")


def _staging_folder(out: Path) -> Path:
    """A new empty folder next to ``out`` (same file system, so the final rename is atomic).

    Raises:
        OSError: the parent of ``out`` cannot be created or written, or ``out`` is a file.
        ValueError: ``out`` holds a folder or a file that is not a report's (:data:`REPORT_SUFFIXES`).
    """
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {str(out)!r} is a file; give a folder")
    if out.is_dir():
        foreign = [p.name for p in out.iterdir() if p.is_dir() or p.suffix not in REPORT_SUFFIXES]
        if foreign:  # the new report replaces the whole folder: never a folder of the user's own files
            raise ValueError(
                f"--out {str(out)!r} holds files that are not a report's ({', '.join(sorted(foreign)[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}); the report replaces the whole folder, so give a "
                "new folder, an empty one or a previous report's"
            )
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=parent, prefix=f".{out.name}.partial-"))
    if out.is_dir():  # mkdtemp makes it private (0700): give it the folder's own mode, or the usual one
        shutil.copymode(out, staging)
    else:
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)
    return staging


def _swap_in(staging: Path, out: Path) -> None:
    """Replace ``out`` by the finished ``staging`` folder: rename the old report aside, rename the new
    one into place, then delete the old one. A reader sees the old report or the new one, never a mix."""
    if not out.exists():
        os.rename(staging, out)
        return
    old = Path(tempfile.mkdtemp(dir=out.absolute().parent, prefix=f".{out.name}.old-"))
    try:
        os.rename(out, old / "report")
        os.rename(staging, out)
    except BaseException:  # an error, Ctrl-C or SIGTERM between the renames
        if not out.exists() and (old / "report").exists():
            os.rename(old / "report", out)  # put the old report back before reporting the error
        shutil.rmtree(old, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _discard(staging: Path | None) -> None:
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)


def _write_report(staging: Path, sections: list[Section], quick: bool) -> None:
    from .. import __version__

    (staging / "report.md").write_text(render_markdown(sections, quick))
    title = f"multihead study ({'quick' if quick else 'full'})"
    sub = f"multihead {__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    (staging / "report.html").write_text(render_html(sections, title, sub, key_findings(sections)))


def run_study(
    quick: bool = True,
    out_dir: str | Path | None = None,
    progress: bool = True,
    console: Console | None = None,
    only: str | list[str] | None = None,
) -> dict:
    """Run the study and return its data: ``{"quick", "versions", "sections": {key: data}}``.

    Args:
        quick: the default workload only (seconds); False adds the bf16 exactness run.
        out_dir: when given, write ``out_dir/report.md``, ``out_dir/report.html`` and the figures' PNGs.
            They are written into a new folder next to ``out_dir``, which replaces ``out_dir`` (and
            everything in it) once the report is complete; an error or Ctrl-C leaves ``out_dir`` as it was.
        progress: show a progress bar on stderr.
        console: when given, print each section's tables to it.
        only: run only these sections (names as in :data:`SECTIONS`, comma-separated or a list).

    Raises:
        OSError: if ``out_dir`` cannot be created or written, or is a file.
        ValueError: an unknown section name in ``only``; an ``out_dir`` holding other files than a
            report's (it would be replaced).
    """
    from .. import __version__

    select_sections(only)  # fail on a bad name before any work
    out = None if out_dir is None else Path(out_dir)
    staging = None if out is None else _staging_folder(out)  # fails before the work, not after
    discard = partial(_discard, staging)
    try:  # registered too: a study on a thread that SIGTERM's exception does not unwind
        with temporaries.registered(discard):
            sections = run_sections(quick, progress, staging, only)
            cited = references(sections)
            sections += [cited] if cited is not None else []
            if out is not None and staging is not None:
                _write_report(staging, sections, quick)
                _swap_in(staging, out)
    except BaseException:  # Ctrl-C and SIGTERM included: the user's folder stays as it was
        discard()
        raise
    report: dict = {
        "quick": quick,
        "versions": {"multihead": __version__, "torch": torch.__version__},
        "sections": {s.key: s.data for s in sections},
    }
    if out is not None:
        report["report"] = str(out / "report.md")
        report["html"] = str(out / "report.html")
        report["figures"] = [str(out / f.file) for s in sections for f in s.figures]
    report["findings"] = [{"section": key, "text": text} for key, text in key_findings(sections)]
    if console is not None:
        if report["findings"]:
            console.print("Key findings:", markup=False)
            for i, f in enumerate(report["findings"], 1):
                console.print(f"  {i}. {f['text']} [{f['section']}]", markup=False)
        for s in sections:
            s.print(console)
    return report
