"""The progress bar of the long commands: :func:`multihead.cli.console.progress_columns` (what runs, the
bar, done / total, the time spent and the time left: rich's estimate from the units done so far) on
stderr, so piped output stays clean."""

from __future__ import annotations

from typing import Any

from .console import progress_columns

__all__ = ["eta_progress"]


def eta_progress(console: Any = None) -> Any:
    """A ``rich.progress.Progress`` (use it as a context manager) whose tasks show the time left once
    they have a total; ``console`` defaults to one on stderr."""
    from rich.console import Console
    from rich.progress import Progress

    return Progress(*progress_columns(count=True), console=console or Console(stderr=True), transient=True)
