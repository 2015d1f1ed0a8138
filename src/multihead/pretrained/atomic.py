"""Writes a user keeps, all at once: a temporary in the target's folder, renamed over the target only
when complete (``os.replace``), so a reader sees the old file or the new one, never a part; the
temporary is removed on an error, Ctrl-C (KeyboardInterrupt), and on SIGTERM and SIGHUP where the
program ends on them with an exception or runs :func:`multihead.temporaries.remove_all` (the
``multihead`` command line does both: :func:`multihead.startup.end_on_termination`); from any thread,
and at exit. No signal handler is installed here: a library leaves the program's signals alone. A
folder of several files that belong together (weights and the record that describes them) is written
whole beside the old one and swapped with it in one step (:func:`atomic_folder`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import secrets
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .. import temporaries

__all__ = ["atomic_folder", "atomic_write", "temporary_name"]

_LIVE: dict[Path, int] = {}  # the writes in progress: temporary -> its key in multihead.temporaries
_LOCK = threading.Lock()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():  # an atomic_folder's temporary
        shutil.rmtree(path, ignore_errors=True)
        return
    with contextlib.suppress(OSError):  # no permission: nothing of ours to clean up
        path.unlink(missing_ok=True)


def _track(tmp: Path, cleanup: Callable[[], None] | None = None) -> None:
    """Register the clean-up of ``tmp`` (default: remove it) with :mod:`multihead.temporaries`, which
    runs it at exit and from the command line's SIGTERM / SIGHUP handler: a write on another thread
    than the main one is not unwound by the exception that handler raises."""
    key = temporaries.add(cleanup or functools.partial(_remove, tmp))
    with _LOCK:
        _LIVE[tmp] = key


def _untrack(tmp: Path) -> None:
    with _LOCK:
        key = _LIVE.pop(tmp, None)
    if key is not None:
        temporaries.discard(key)


def temporary_name(path: Path, kind: str = "tmp") -> Path:
    """A fresh hidden name next to ``path`` that keeps its suffix (``np.save`` adds ``.npy`` otherwise)."""
    return path.with_name(f".{path.stem}.{kind}-{secrets.token_hex(4)}{path.suffix}")


@contextmanager
def atomic_write(path: str | Path) -> Iterator[Path]:
    """Write ``path`` all at once: yields a temporary path in the same folder to write to, then renames it
    over ``path`` (``os.replace``: a reader sees the old file or the new one, never a part).

    The temporary is removed when the block raises, on Ctrl-C (KeyboardInterrupt), at exit, and on
    SIGTERM / SIGHUP in a program that ends on them as the command line does (see the module's
    docstring), whichever thread writes. Works with any writer
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
    """Write the folder ``path`` all at once: yields a temporary folder next to it to fill, then swaps
    it into place, so a reader sees the whole old folder or the whole new one, never a mix of their
    files: on Linux one ``renameat2(RENAME_EXCHANGE)`` call swaps the two folders; elsewhere the old
    folder is renamed aside, the new one renamed in, and the old one put back if that fails or is
    interrupted. The temporary (after the swap: the old folder) is removed on success, an error,
    Ctrl-C, SIGTERM or SIGHUP, as in :func:`atomic_write`. For folders the writer owns whole (a
    ``save_pretrained`` output, a converted checkpoint).

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

    def cleanup() -> None:
        if old.exists() and not target.exists():  # interrupted between the two renames
            with contextlib.suppress(OSError):
                os.replace(old, target)
        _remove(tmp)
        _remove(old)

    tmp.mkdir()
    _track(tmp, cleanup)
    try:
        yield tmp
        _swap_in(tmp, target, old)
    finally:
        cleanup()
        _untrack(tmp)


def _swap_in(new: Path, target: Path, old: Path) -> None:
    """Put the folder ``new`` at ``target``; the old ``target`` (if any) ends at ``new`` or ``old``."""
    if not target.exists():
        os.replace(new, target)
    elif not _exchange(new, target):
        os.replace(target, old)
        os.replace(new, target)  # if this fails, the caller's clean-up puts ``old`` back


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one system call (Linux ``renameat2`` with ``RENAME_EXCHANGE``);
    False where the C library or the file system does not offer it.

    Raises:
        OSError: the call failed for another reason (no permission, ...).
    """
    rename = getattr(_libc(), "renameat2", None)
    if rename is None:
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE from <fcntl.h> / <linux/fs.h>
    if rename(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM):
        return False  # no such flag here (old kernel, a file system without it)
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def _libc() -> Any:
    """The process's C library (already loaded: nothing new is loaded), or None."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):  # TypeError: Windows has no process-wide handle
        return None
