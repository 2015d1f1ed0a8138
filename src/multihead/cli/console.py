"""What every command shares: the console it prints to, argument types, help text for a terminal, and
the checks of files a command reads or writes (done before any work, so a long run never ends in a
lost result)."""

from __future__ import annotations

import contextlib
import errno
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from .args import positive_int

__all__ = [
    "check_input_dir",
    "check_input_file",
    "check_output_dir",
    "check_output_file",
    "disk_full",
    "for_terminal",
    "make_console",
    "positive_int",
    "progress_columns",
    "writing",
]

#: errors of a write that ran out of room: no space, a quota, or numpy's short write of a full disk
_FULL = (errno.ENOSPC, errno.EDQUOT)
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")

# Sphinx roles (:func:`x`, :class:`~a.b`) and inline literals (``x``) read as plain text on a terminal
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def make_console() -> Console:
    """A console on stdout; wide when stdout is not a terminal, so tables do not wrap in files.

    Markup is off: what the commands print is data (notes, table cells, file names), and rich would
    take a bracketed phrase such as ``[bootstrap 95% interval]`` for a style tag and drop it.
    """
    console = Console(highlight=False, markup=False)
    if not console.is_terminal:
        console.width = 160
    return console


def for_terminal(doc: str | None) -> str:
    """A docstring as a parser's description: Sphinx roles and ````literals```` become plain words.

    (A description is printed as it is; only an argument's ``help=`` needs ``%%`` for a percent sign.)
    """
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", doc or ""))


def progress_columns(count: bool = False) -> tuple[ProgressColumn, ...]:
    """The columns of every progress bar: what runs, the bar, done/total, time spent and time left."""
    done = (MofNCompleteColumn(),) if count else ()
    return (
        TextColumn("{task.description}"),
        BarColumn(),
        *done,
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a pipe"), (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def check_input_file(path: str, flag: str, what: str = "a file") -> Path:
    """``path`` as a Path when it is a non-empty regular file that can be read.

    Raises:
        ValueError: it does not exist, is a folder, a device or pipe, is empty or cannot be read; the
            message names ``flag``, the path and what to give instead.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{flag} {path!r} does not exist; give {what}")
    if p.is_dir():
        raise ValueError(f"{flag} {path!r} is a folder; give {what}")
    mode = p.stat().st_mode
    if not stat.S_ISREG(mode):
        raise ValueError(f"{flag} {path!r} is {_kind(mode)}; give {what}")
    if p.stat().st_size == 0:
        raise ValueError(f"{flag} {path!r} is empty; give {what}")
    try:
        with p.open("rb"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path!r} cannot be read ({e.strerror}); give {what}") from None
    return p


def check_input_dir(path: str, flag: str, what: str = "a folder") -> Path:
    """``path`` as a Path when it is an existing folder.

    Raises:
        ValueError: it does not exist or is not a folder; the message names ``flag`` and the path.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{flag} {path!r} does not exist; give {what}")
    if not p.is_dir():
        raise ValueError(f"{flag} {path!r} is a file, not a folder; give {what}")
    return p


def _probe(folder: Path, flag: str, path: str) -> None:
    """Create and remove a file in ``folder``: the only reliable test (permissions, a read-only file
    system, root's exemptions, quotas all show here and nowhere else)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(
            f"{flag} {path!r} cannot be written: {e.strerror or e} in {str(folder)!r}; choose another path"
        ) from None


def _nearest_existing(p: Path) -> Path:
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_output_file(path: str, flag: str) -> Path:
    """Check, before any work, that a file can be written at ``path`` (missing parent folders are fine:
    the writers create them). Returns ``path`` as a Path.

    Raises:
        ValueError: ``path`` is a folder, a parent is a file, or the nearest existing folder cannot be
            written (permissions, a read-only file system); the message names ``flag`` and the path.
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path!r} is a folder; give a file name")
    base = _nearest_existing(p.parent)
    if not base.is_dir():
        raise ValueError(f"{flag} {path!r} cannot be written: {str(base)!r} is a file, not a folder")
    _probe(base, flag, path)
    return p


def check_output_dir(path: str, flag: str, *, inside: bool = False) -> Path:
    """Check, before any work, that a folder can be written (or created) at ``path``: the writers build
    it next to ``path`` and rename it into place, so its parent folder must take new entries (with
    ``inside``: the writer puts its files into ``path``, which must take them when it exists).

    Raises:
        ValueError: ``path`` or a parent is a file, or the nearest existing parent cannot be written.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path!r} is a file; give a folder")
    base = _nearest_existing(p.absolute() if inside else p.absolute().parent)
    if not base.is_dir():
        raise ValueError(f"{flag} {path!r} cannot be written: {str(base)!r} is a file, not a folder")
    _probe(base, flag, path)
    return p


def disk_full(e: BaseException) -> bool:
    """Whether ``e`` is a write that ran out of room (no space, a quota, a short write)."""
    return isinstance(e, OSError) and (e.errno in _FULL or bool(_SHORT_WRITE.search(str(e))))


@contextlib.contextmanager
def writing(path: str | Path, flag: str, *, full_only: bool = False) -> Iterator[None]:
    """Name ``flag`` and ``path`` when writing there fails: a full disk says so and how much is free;
    another OSError (unless ``full_only``, for a block that also reads) says what the system said.

    Raises:
        ValueError: in place of the OSError, naming the option, the path and the fix.
    """
    try:
        yield
    except OSError as e:
        if disk_full(e):
            from ..core.limits import format_bytes

            folder = _nearest_existing(Path(path))
            try:
                free = f"{format_bytes(shutil.disk_usage(folder).free)} free in {str(folder)!r}"
            except OSError:
                free = f"in {str(folder)!r}"
            raise ValueError(
                f"{flag} {str(path)!r} could not be written: the disk is full ({free}); free some space "
                "or choose another path"
            ) from None
        if full_only:
            raise
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
        raise ValueError(
            f"{flag} {str(path)!r} could not be written: {e.strerror or e}{where}; choose another path"
        ) from None
