"""Finding the C compiler and running it: each way it can fail ends in a reason that names the command.

The compiler is ``$CC`` when it is set (split into words as a shell would: ``CC="ccache gcc"`` works),
else the first of ``cc``, ``gcc``, ``clang`` on ``PATH``. A build is published only when the compiler
exits with status 0 *and* wrote a shared library (an ELF or Mach-O file): a compiler that "succeeds"
with an empty or foreign file leaves nothing in the cache.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from . import cache

__all__ = ["TIMEOUT_S", "compile_library", "find_compiler", "library_problem", "signal_name"]

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


def compile_library(
    compiler: list[str], args: list[str], retry_without: str, out: Path
) -> tuple[str | None, str | None]:
    """Compile into ``out`` (in a private directory): ``compiler -o out args``, once more
    without the flag ``retry_without`` (OpenMP) when that fails. The library appears under its name
    only when it is one, with its sha256 recorded beside it (``cache.record``).

    Returns:
        (the library's sha256, None), or (None, why nothing was built: the command and its status or
        output, or what is wrong with the file it wrote).
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        for flags in (args, [a for a in args if a != retry_without]):
            argv = [*compiler, "-o", tmp, *flags]
            try:
                done = subprocess.run(
                    argv, capture_output=True, text=True, errors="replace", timeout=TIMEOUT_S
                )
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
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
