"""Finding the C compiler and running it: each way it can fail ends in a reason that names the command.

The compiler is ``$CC`` when it is set (split into words as a shell would: ``CC="ccache gcc"`` works),
else the first of ``cc``, ``gcc``, ``clang`` on ``PATH``. A build is published only when the compiler
exits with status 0 *and* wrote a shared library (an ELF or Mach-O file): a compiler that "succeeds"
with an empty or foreign file leaves nothing in the cache.

A build leaves nothing behind when it is cut short. The compiler runs in a process group of its own
with ``TMPDIR`` pointing at a fresh directory inside the private cache directory, where it writes its
temporaries and the library before it is published. When the build ends early (Ctrl-C's
``KeyboardInterrupt``, an exception raised by a signal handler, the timeout), the whole group (the
driver and the ``cc1`` / ``as`` / ``ld`` it started) is killed and that directory removed. Builds in
progress on other threads are listed, so that :func:`stop_all` (called at interpreter exit, and by a
program's own signal handler) can do the same for them: an exception raised in the main thread does
not unwind other threads. :class:`Once` makes the first load one build per process, however many
threads ask for the kernels at once.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from . import cache

__all__ = [
    "TIMEOUT_S",
    "Once",
    "compile_library",
    "find_compiler",
    "library_problem",
    "signal_name",
    "stop_all",
]

R = TypeVar("R")

TIMEOUT_S = 300  # a cold -O3 build takes seconds; minutes mean something hangs
#: the first bytes of a shared library: ELF, and Mach-O (32/64-bit, both byte orders, universal)
_MAGICS = (
    b"\x7fELF",
    b"\xfe\xed\xfa\xce",
    b"\xfe\xed\xfa\xcf",
    b"\xce\xfa\xed\xfe",
    b"\xcf\xfa\xed\xfe",
    b"\xca\xfe\xba\xbe",
)


def _why_not_executable(word: str) -> str:
    """Why ``shutil.which`` found no program ``word``."""
    if os.sep not in word:
        return f"no program {word!r} on PATH"
    path = Path(word)
    if not path.exists():
        return "no such file"
    if path.is_dir():
        return "it is a directory"
    return "it is not executable by this user"


def find_compiler() -> tuple[list[str] | None, str | None]:
    """(the compiler command as words, its executable resolved to a path; None) or (None, why none)."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        try:
            words = shlex.split(cc)
        except ValueError as e:
            return None, f"CC={cc!r} cannot be split into words ({e}); set CC to a C compiler's path"
        exe = shutil.which(words[0]) if words else None
        if exe is None:
            why = _why_not_executable(words[0]) if words else "it is empty"
            return None, f"CC={cc!r} is not an executable: {why}; set CC to a C compiler (or unset it)"
        return [exe, *words[1:]], None
    found = next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)
    if found is None:
        return None, "no C compiler found (no cc, gcc or clang on PATH; install gcc or clang, or set CC)"
    return [found], None


def signal_name(number: int) -> str:
    """``SIGBUS`` for 7 (on Linux), the number itself for one Python does not know."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _exit_reason(argv: list[str], done: subprocess.CompletedProcess[str]) -> str:
    """What a failed compiler run says: its status (or signal), its command and its last output."""
    rc = done.returncode
    how = f"was killed by signal {signal_name(-rc)}" if rc < 0 else f"exited with status {rc}"
    said = (done.stderr.strip() or done.stdout.strip())[-300:]
    return f"`{shlex.join(argv)}` {how}" + (f": {said}" if said else " and printed nothing")


def library_problem(path: Path) -> str | None:
    """Why the file a compiler wrote is not a shared library (empty, or not ELF / Mach-O), or None."""
    with open(path, "rb") as f:
        head = f.read(4)
    size = os.path.getsize(path)
    if size == 0:
        return "wrote an empty file"
    if head not in _MAGICS:
        return f"wrote a file that is not a shared library ({size} bytes starting {head!r})"
    return None


class Once(Generic[R]):
    """A function of no arguments whose result is computed on the first call only, even when several
    threads make that call together (they wait for the one computing it): one build and load of the
    kernels per process. ``cache_clear()`` forgets the result (tests)."""

    def __init__(self, fn: Callable[[], R]):
        self._fn = fn
        self._lock = threading.Lock()
        self._done: list[R] = []
        functools.update_wrapper(self, fn)

    def __call__(self) -> R:
        done = self._done
        if done:
            return done[0]
        with self._lock:
            if not self._done:
                self._done.append(self._fn())
            return self._done[0]

    def cache_clear(self) -> None:
        with self._lock:
            self._done = []


# re-entrant: stop_all may run in a signal handler on the thread that holds it
_LIVE_LOCK = threading.RLock()
_LIVE: dict[int, tuple[subprocess.Popen[str] | None, Path]] = {}  # build -> its compiler, its directory
_STOPPED = threading.Event()  # set by stop_all: the program is ending, no compiler starts any more


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill the compiler's whole process group (its driver has not been waited for yet, so the group's
    id is still its own), then reap the driver."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        proc.wait(timeout=10)


def stop_all() -> None:
    """Kill every compiler still running (and what it started) and remove its temporaries: for a
    program's exit, or its signal handler, while builds run on other threads. Those builds then
    report a failed compiler, and builds asked for afterwards fail at once (the program is ending)."""
    with _LIVE_LOCK:
        _STOPPED.set()
        live = list(_LIVE.values())
    for proc, work in live:
        if proc is not None:
            _kill_group(proc)
        shutil.rmtree(work, ignore_errors=True)


atexit.register(stop_all)


def _run(argv: list[str], work: Path, build: int) -> subprocess.CompletedProcess[str]:
    """``argv`` in a process group of its own with ``TMPDIR=work``; on any exception (the timeout, a
    ``KeyboardInterrupt``, an exception from a signal handler) its whole group is killed first.

    Raises:
        subprocess.TimeoutExpired: after :data:`TIMEOUT_S`.
        OSError: the compiler could not be started.
    """
    env = dict(os.environ, TMPDIR=str(work), TMP=str(work), TEMP=str(work))
    with _LIVE_LOCK:  # started and listed at once: stop_all sees every compiler
        if _STOPPED.is_set():
            raise OSError("the program is ending (native builds were stopped)")
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,  # its own group: killed whole; a terminal's Ctrl-C is ours to handle
        )
        _LIVE[build] = (proc, work)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        with _LIVE_LOCK:
            _LIVE[build] = (None, work)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def compile_library(
    compiler: list[str], args: list[str], retry_without: str, out: Path
) -> tuple[str | None, str | None]:
    """Compile into ``out`` (in a private directory): ``compiler -o out args``, once more
    without the flag ``retry_without`` (OpenMP) when that fails. The library appears under its name
    only when it is one, with its sha256 recorded beside it (``cache.record``). The compiler and its
    temporaries are gone when this returns or raises (see the module's docstring).

    Returns:
        (the library's sha256, None), or (None, why nothing was built: the command and its status or
        output, or what is wrong with the file it wrote).
    """
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    build = id(work)
    with _LIVE_LOCK:
        _LIVE[build] = (None, work)
    try:
        return _compile_in(compiler, args, retry_without, out, work, build)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        with _LIVE_LOCK:
            _LIVE.pop(build, None)


def _compile_in(
    compiler: list[str], args: list[str], retry_without: str, out: Path, work: Path, build: int
) -> tuple[str | None, str | None]:
    """:func:`compile_library`'s work, in the directory ``work`` that the caller removes."""
    tmp = str(work / out.name)
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))  # a compiler that writes nothing
    for flags in (args, [a for a in args if a != retry_without]):
        argv = [*compiler, "-o", tmp, *flags]
        try:
            done = _run(argv, work, build)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"running the compiler `{shlex.join(argv)}` failed: {e}"
        if done.returncode == 0:
            break
    else:
        return None, f"building the native kernels failed: {_exit_reason(argv, done)}"
    problem = library_problem(Path(tmp))
    if problem is not None:
        return (
            None,
            f"the compiler `{shlex.join(argv)}` exited with status 0 but {problem}; nothing was cached",
        )
    os.chmod(tmp, 0o700)  # the linker's mode follows the umask; the library must be ours alone
    digest = cache.file_digest(Path(tmp))
    cache.record(out, "sha256", digest)
    os.replace(tmp, out)
    return digest, None
