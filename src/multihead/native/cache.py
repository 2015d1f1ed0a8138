"""The private directory the native kernels are built into, and the checks a kept library passes
before it is loaded.

A shared library is code: whoever can write the file that ``ctypes`` loads runs code as the user. So
a directory is used only when this account alone can change it (SECURITY.md, "Native kernels"):

- the directory and each file in it are owned by the current user, are not writable by the group or
  others, and are not symbolic links (checked with ``os.lstat`` / ``O_NOFOLLOW``, so a link planted
  in its place is refused, not followed);
- every directory above it (symbolic links resolved) is owned by the user or root and is not writable
  by others, unless it has the sticky bit (``/tmp``), where others cannot rename or remove our entries.

:func:`private_dir` tries the cache directory, then ``<tmp>/multihead-<uid>``, then a fresh directory
with an unpredictable name (``tempfile.mkdtemp``, removed at exit), and says why it skipped each.
Directories it creates are made mode 0700. A kept library carries the sha256 of its bytes, recorded at
build time (:func:`record`, written atomically), and is loaded only while it matches (:func:`verify`).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

__all__ = [
    "check_dir",
    "check_file",
    "file_digest",
    "private_dir",
    "read_record",
    "record",
    "remove_entry",
    "sidecar",
    "verify",
]

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def _problem(st: os.stat_result, path: Path, want_dir: bool) -> str | None:
    """Why an entry with ``lstat`` result ``st`` cannot be trusted, or None."""
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if want_dir and not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if not want_dir and not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid != uid:
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & _WRITABLE_BY_OTHERS:
        return f"{path} can be written by its group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def check_dir(path: Path) -> str | None:
    """Why directory ``path`` is not private to this user (owner, mode, a link), or None."""
    try:
        return _problem(os.lstat(path), path, want_dir=True)
    except OSError as e:
        return f"{path} cannot be examined: {e.strerror or e}"


def check_file(path: Path) -> str | None:
    """Why file ``path`` cannot be trusted (owner, mode, not a plain file, a link), or None."""
    try:
        return _problem(os.lstat(path), path, want_dir=False)
    except OSError as e:
        return f"{path} cannot be examined: {e.strerror or e}"


def _check_ancestors(real: Path) -> str | None:
    """Why a directory below the existing, symlink-free directory ``real`` could be replaced by another
    account (an ancestor it owns or may write), or None."""
    uid = os.getuid()
    for d in (real, *real.parents):
        st = os.lstat(d)
        if st.st_uid not in (uid, 0):
            return f"{d} (above the cache) is owned by uid {st.st_uid}, neither this user nor root"
        if st.st_mode & _WRITABLE_BY_OTHERS and not st.st_mode & stat.S_ISVTX:
            return f"{d} (above the cache) can be written by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _make_private(path: Path) -> tuple[Path | None, str | None, bool]:
    """Create ``path`` and its missing parents mode 0700 (or find them there) and check them.

    Returns:
        (the directory with the links above it resolved, None), or (None, why it cannot be used,
        whether that is because it is unsafe rather than impossible to create).
    """
    path = Path(os.path.abspath(path))
    existing = path.parent
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    try:
        here = Path(os.path.realpath(existing))  # links above the cache are resolved, then checked
        reason = _check_ancestors(here)
        if reason is not None:
            return None, reason, True
        for part in path.relative_to(existing).parts:
            here = here / part
            try:
                os.mkdir(here, 0o700)
                os.chmod(here, 0o700)  # whatever the umask
            except FileExistsError:
                pass  # made by someone: the check below decides
            reason = check_dir(here)
            if reason is not None:
                return None, reason, True
    except OSError as e:
        return None, f"{path} cannot be created: {e.strerror or e}", False
    return here, None, False


def _fresh_dir() -> tuple[Path | None, str | None]:
    """A new directory with an unpredictable name, mode 0700, removed when the interpreter exits."""
    try:
        made = Path(tempfile.mkdtemp(prefix="multihead-native-"))
    except OSError as e:
        return None, f"no fresh directory in {tempfile.gettempdir()}: {e.strerror or e}"
    atexit.register(shutil.rmtree, made, ignore_errors=True)
    real = Path(os.path.realpath(made))
    reason = _check_ancestors(real.parent) or check_dir(real)
    return (None, reason) if reason else (real, None)


def private_dir(preferred: Path) -> tuple[Path | None, list[str], bool]:
    """The first usable of ``preferred``, ``<tmp>/multihead-<uid>`` and a fresh directory.

    Returns:
        (directory or None, why each directory before it was skipped, whether one was skipped for
        being unsafe rather than impossible to create: a directory planted by another account).
    """
    notes: list[str] = []
    any_unsafe = False
    shared = Path(tempfile.gettempdir()) / f"multihead-{os.getuid()}"
    for candidate in (preferred, shared):
        found, reason, unsafe = _make_private(candidate)
        if found is not None:
            return found, notes, any_unsafe
        any_unsafe = any_unsafe or unsafe
        notes.append(f"not building in {candidate}: {reason}")
    made, reason = _fresh_dir()
    if reason is not None:
        notes.append(reason)
    return made, notes, any_unsafe


def sidecar(library: Path, kind: str) -> Path:
    """The file kept next to ``library``: ``kind`` "sha256" (its digest at build time) or "checked"
    (the digest that passed the self-check in a separate process)."""
    return library.with_name(f"{library.name}.{kind}")


def _read_private(path: Path) -> bytes:
    """The bytes of ``path``, opened without following a link and checked on the open descriptor.

    Raises:
        OSError: it is missing, a link, or not owned by this user / writable by others.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        reason = _problem(os.fstat(fd), path, want_dir=False)
        if reason is not None:
            raise PermissionError(reason)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def file_digest(path: Path) -> str:
    """The sha256 of ``path``'s bytes (hex), read as :func:`_read_private` does.

    Raises:
        OSError: as :func:`_read_private`.
    """
    return hashlib.sha256(_read_private(path)).hexdigest()


def read_record(library: Path, kind: str) -> str | None:
    """The digest in ``library``'s sidecar ``kind``, or None when it is missing or untrusted."""
    try:
        return _read_private(sidecar(library, kind)).decode("ascii", "replace").strip()
    except OSError:
        return None


def record(library: Path, kind: str, digest: str) -> None:
    """Write ``digest`` into ``library``'s sidecar ``kind`` atomically (a temporary file, then a
    rename: a reader sees the old record or the new one, never part of one)."""
    target = sidecar(library, kind)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(digest + "\n")
        os.replace(tmp, target)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def verify(library: Path) -> tuple[str | None, str | None]:
    """(digest, None) when ``library`` exists, is trusted and matches the digest recorded at its build;
    (None, why not) otherwise (why is None when there is simply no library yet)."""
    if not os.path.lexists(library):
        return None, None
    try:
        got = file_digest(library)
    except OSError as e:
        return None, f"the cached native library cannot be trusted: {e}"
    want = read_record(library, "sha256")
    if want is None:
        return None, f"the cached native library {library} has no recorded digest"
    if got != want:
        size = os.lstat(library).st_size
        return None, f"the cached native library {library} ({size} bytes) does not match its recorded digest"
    return got, None


def remove_entry(library: Path) -> None:
    """Remove ``library`` and its sidecars (those that exist), whatever they are: a file, a link (not
    its target) or a directory (with what it holds; links in it are removed, not followed). The
    directory holding them is private (:func:`private_dir`), so whatever is there was put there by this
    user, and the build that follows takes its place.

    Raises:
        OSError: an entry that cannot be removed (then nothing can be built in its place either).
    """
    for path in (library, sidecar(library, "sha256"), sidecar(library, "checked")):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
