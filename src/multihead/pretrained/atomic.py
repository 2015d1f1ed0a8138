"""Writes a user keeps, all at once: a temporary in the target's folder, renamed over the target only
when complete (``os.replace``), so a reader sees the old file or the new one, never a part; the
temporary is removed on an error, Ctrl-C (KeyboardInterrupt), SIGTERM and SIGHUP.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["atomic_folder", "atomic_write", "temporary_name"]

_LIVE: set[Path] = set()  # temporaries of the atomic writes in progress (removed on SIGTERM)
_LOCK = threading.Lock()
_PREVIOUS: dict[int, Any] = {}


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():  # an atomic_folder's temporary
        shutil.rmtree(path, ignore_errors=True)
        return
    with contextlib.suppress(OSError):  # no permission: nothing of ours to clean up
        path.unlink(missing_ok=True)


def _on_signal(signum: int, frame: Any) -> None:
    """A Python handler installed before ours runs (if it raises, the ``finally`` of each write removes
    its temporary); otherwise remove every live temporary and end the process as the signal's default
    action would."""
    previous = _PREVIOUS.get(signum)
    if callable(previous):
        previous(signum, frame)
        return
    for tmp in list(_LIVE):
        _remove(tmp)
    _LIVE.clear()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _track(tmp: Path) -> None:
    with _LOCK:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                if sig not in _PREVIOUS and signal.getsignal(sig) is not signal.SIG_IGN:
                    _PREVIOUS[sig] = signal.signal(sig, _on_signal)
        _LIVE.add(tmp)


def _untrack(tmp: Path) -> None:
    with _LOCK:
        _LIVE.discard(tmp)
        if not _LIVE and threading.current_thread() is threading.main_thread():
            for sig, previous in list(_PREVIOUS.items()):
                signal.signal(sig, signal.SIG_DFL if previous is None else previous)
                del _PREVIOUS[sig]


def temporary_name(path: Path, kind: str = "tmp") -> Path:
    """A fresh hidden name next to ``path`` that keeps its suffix (``np.save`` adds ``.npy`` otherwise)."""
    return path.with_name(f".{path.stem}.{kind}-{secrets.token_hex(4)}{path.suffix}")


@contextmanager
def atomic_write(path: str | Path) -> Iterator[Path]:
    """Write ``path`` all at once: yields a temporary path in the same folder to write to, then renames it
    over ``path`` (``os.replace``: a reader sees the old file or the new one, never a part).

    The temporary is removed when the block raises, on Ctrl-C (KeyboardInterrupt) and on SIGTERM / SIGHUP
    (the handler removes it, then the signal ends the process as it would have). Works with any writer
    that takes a path: ``save_file(sd, tmp)``, ``np.save(tmp, a)``, ``fig.savefig(tmp)``,
    ``tmp.write_text(s)``.

    Raises:
        ValueError: the parent folder does not exist (naming it).
    """
    target = Path(path)
    if not target.parent.is_dir():
        raise ValueError(
            f"cannot write {str(target)!r}: the folder {str(target.parent)!r} does not exist; create it first"
        )
    tmp = temporary_name(target)
    _track(tmp)
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        _remove(tmp)  # after os.replace it no longer exists
        _untrack(tmp)


@contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """Write the folder ``path`` all at once: yields a temporary folder next to it to fill, then moves it
    into place (an old ``path`` is renamed aside first and removed after), so a reader never sees a mix of
    old and new files. The temporary is removed on an error, Ctrl-C, SIGTERM or SIGHUP, as in
    :func:`atomic_write`. For folders the writer owns whole (e.g. a ``save_pretrained`` output).

    Raises:
        ValueError: the parent folder does not exist, or ``path`` is a file.
    """
    target = Path(path)
    if not target.parent.is_dir():
        raise ValueError(
            f"cannot write {str(target)!r}: the folder {str(target.parent)!r} does not exist; create it first"
        )
    if target.exists() and not target.is_dir():
        raise ValueError(f"cannot write the folder {str(target)!r}: a file of that name is in the way")
    tmp, old = temporary_name(target), temporary_name(target, "old")
    tmp.mkdir()
    _track(tmp)
    try:
        yield tmp
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
    finally:
        _remove(tmp)
        _remove(old)
        _untrack(tmp)
