"""Temporaries of work in progress, removed when the program ends before the work does.

Code that writes a temporary (an atomic write's hidden file, a report's staging folder) removes it in
``finally``, which runs on Ctrl-C's ``KeyboardInterrupt`` and on any exception a program's signal
handler raises. But an exception raised in the main thread does not unwind the other threads: a
write in progress on a worker thread would leave its temporary behind when the process ends. So such
code also registers its clean-up here, for as long as the temporary lives (:func:`registered`), and
:func:`remove_all` runs every registered clean-up and stops the native kernels' compiler if one is
running (its process group and its temporaries). It runs at interpreter exit, and a program calls it
from its own signal handler (the ``multihead`` command line does, for SIGTERM and SIGHUP).

The library installs no signal handler itself: which signals end a program, and how, is the program's
choice.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
from collections.abc import Callable, Iterator

__all__ = ["add", "discard", "registered", "remove_all"]

# re-entrant: remove_all may run in a signal handler on a thread that is inside registered()
_LOCK = threading.RLock()
_LIVE: dict[int, Callable[[], None]] = {}
_NEXT = [0]


def add(cleanup: Callable[[], None]) -> int:
    """Register ``cleanup`` (removes a temporary; must be safe to call twice, or after its owner removed
    the temporary itself); returns the key that :func:`discard` takes."""
    with _LOCK:
        _NEXT[0] += 1
        _LIVE[_NEXT[0]] = cleanup
        return _NEXT[0]


def discard(key: int) -> None:
    """Forget the clean-up registered under ``key`` (its owner removed the temporary)."""
    with _LOCK:
        _LIVE.pop(key, None)


@contextlib.contextmanager
def registered(cleanup: Callable[[], None]) -> Iterator[None]:
    """Keep ``cleanup`` registered (:func:`add`) while the block runs."""
    key = add(cleanup)
    try:
        yield
    finally:
        discard(key)


def remove_all() -> None:
    """Run and forget every registered clean-up, and stop the native kernels' builds in progress.

    A clean-up that fails is skipped (the others still run): this runs while the program ends.
    """
    with _LOCK:
        pending = list(_LIVE.values())
        _LIVE.clear()
    for cleanup in pending:
        with contextlib.suppress(Exception):
            cleanup()
    # the native package imports nothing of multihead (it is loaded apart for its self-check), so its
    # builds are reached here, and only once it was imported: nothing is imported while the program ends
    build = sys.modules.get(f"{__package__}.native.build")
    if build is not None:
        with contextlib.suppress(Exception):
            build.stop_all()


atexit.register(remove_all)
