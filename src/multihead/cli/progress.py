"""The progress bar of the long commands: a description, a bar with a total, done / total, the time
spent and the time left (rich's estimate from the units done so far), on stderr."""

from __future__ import annotations

from typing import Any

__all__ = ["eta_progress"]


def eta_progress(console: Any = None) -> Any:
    """A ``rich.progress.Progress`` (use it as a context manager) whose tasks show the time left once
    they have a total; ``console`` defaults to one on stderr, so piped output stays clean."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
    )
    return Progress(*columns, console=console or Console(stderr=True), transient=True)
