"""Ctrl-C while the command line is still starting: one line and exit status 130, not a traceback.

``python -m multihead`` and the ``multihead`` script import this package, and torch with it (seconds on a
busy machine), before :func:`multihead.cli.main.main` can catch an interrupt. The package imports this
module before any other, and importing it calls :func:`guard`: in a process that is the command line
(and nowhere else) SIGINT then prints ``multihead: interrupted`` and exits with 130 (128 + SIGINT, what
a shell reports for a process ended by Ctrl-C). The command line calls :func:`release` as it starts,
giving SIGINT back to Python's handler, so that a running command cleans up on its own
``KeyboardInterrupt``.

:func:`release` also makes SIGTERM and SIGHUP end the command line as Ctrl-C does, with an exception
(:class:`Terminated`, exit status 128 + the signal's number) raised in the main thread, so that every
``finally`` runs there, after the temporaries registered by other threads are removed and the native
kernels' compiler is stopped (:func:`multihead.temporaries.remove_all`). Only the command line does so
(:func:`end_on_termination`): a program that imports the library keeps its own signal handlers.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

from . import temporaries

__all__ = ["Terminated", "end_on_termination", "guard", "launched_as_command", "release"]

NAME = "multihead"


def launched_as_command() -> bool:
    """Whether this process is ``python -m multihead ...`` or the ``multihead`` script.

    While ``-m`` imports the package, ``sys.argv[0]`` is ``"-m"`` and ``sys.orig_argv`` holds the module's
    name (``python -m multihead.parallel`` is another program); the script's ``sys.argv[0]`` is its path,
    also in ``sys.orig_argv`` (a child process started by ``multiprocessing`` inherits the first, not the
    second: its parent handles Ctrl-C).
    """
    if not sys.argv:
        return False
    args = list(getattr(sys, "orig_argv", []))[1:]
    if sys.argv[0] != "-m":
        return os.path.basename(sys.argv[0]) in (NAME, f"{NAME}.exe") and sys.argv[0] in args
    for i, arg in enumerate(args):  # the interpreter's options come first; the first -m names the module
        if arg == "-m":
            return args[i + 1 : i + 2] == [NAME]
        if arg.startswith("-m"):  # python -mmultihead
            return arg[2:] == NAME
    return False


def _interrupted(signum: int, frame: FrameType | None) -> None:
    lead = "\n" if sys.stderr.isatty() else ""  # after the terminal's ^C
    print(f"{lead}{NAME}: interrupted", file=sys.stderr, flush=True)
    raise SystemExit(130)


def guard() -> None:
    """In the command line's process only: Ctrl-C from now until :func:`release` ends it in one line."""
    if not launched_as_command():
        return
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # a handler set before stays
            signal.signal(signal.SIGINT, _interrupted)
    except ValueError:  # not the main thread: signals are not ours to handle
        pass


def release() -> None:
    """Give SIGINT back to Python's handler (``KeyboardInterrupt``) if :func:`guard` took it; in the
    command line's process, end on SIGTERM and SIGHUP as on Ctrl-C (:func:`end_on_termination`)."""
    if signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if launched_as_command():
        end_on_termination()


class Terminated(SystemExit):
    """SIGTERM or SIGHUP arrived: raised in the main thread so that its clean-ups run (``finally``,
    ``except BaseException``), and not caught by ``except Exception``; the process exits with
    128 + the signal's number, as a shell reports a process ended by it."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


def _terminated(signum: int, frame: FrameType | None) -> None:
    temporaries.remove_all()  # the other threads' temporaries: their finally will not run
    raise Terminated(signum)


def end_on_termination() -> None:
    """From now on, SIGTERM and SIGHUP remove the registered temporaries and raise :class:`Terminated`
    in the main thread (a signal that is ignored, or has a handler of the program's, is left alone).
    For a program's main thread (the command line's); elsewhere it does nothing."""
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is None:  # no SIGHUP on Windows
            continue
        try:
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, _terminated)
        except ValueError:  # not the main thread: signals are not ours to handle
            return


guard()
