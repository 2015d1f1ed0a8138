"""Building, caching and loading the native library: the sources and flags (:data:`SOURCES`,
:data:`FLAGS`), the cache key (:func:`library_path`: the sources, headers, compiler, flags and CPU), and
:func:`load`, which finds a compiler and a private directory, builds once per machine, verifies the
recorded sha256 before every load, runs the first load of each build and its self-check in a separate
process (:func:`probe` is that process's side), and rebuilds a damaged entry once.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from . import build, cache, checks, first_load
from .signatures import open_library

__all__ = [
    "FLAGS",
    "HEADERS",
    "OPENMP",
    "SOURCES",
    "Loaded",
    "cache_dir",
    "cpu_key",
    "library_path",
    "load",
    "open_entry",
    "probe",
]

HERE = Path(__file__).parent
SOURCES = (
    HERE / "gemv.c",
    HERE / "gemv_rows.c",
    HERE / "decode_layer.c",
    HERE / "decode_team.c",
    HERE / "attend.c",
    HERE / "gemv_q8.c",
    HERE / "gemm_q8.c",
    HERE / "decode_greedy.c",
    HERE / "q8_rows.c",
    HERE / "gemv_q4.c",
    HERE / "gemv_qk.c",
    HERE / "gguf_dequant.c",
)  # and their headers: native.h and the private ones next to it
HEADER = HERE / "native.h"
HEADERS = tuple(sorted(HERE.glob("*.h")))  # every header next to the sources: all in the cache key
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11", "-Wno-psabi")
#: added when the compiler has it: products split over torch's OpenMP threads (torch's wheel ships the
#: GNU runtime, libgomp.so.1, which the built library then shares instead of loading a second one)
OPENMP = "-fopenmp"


def cache_dir() -> Path:
    """Where built kernels live: ``$MULTIHEAD_CACHE``, else ``$XDG_CACHE_HOME/multihead``, else
    ``~/.cache/multihead``."""
    if os.environ.get("MULTIHEAD_CACHE"):
        return Path(os.environ["MULTIHEAD_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "multihead"


def cpu_key() -> str:
    """The CPU's identity for the cache key: a kernel built with -march=native runs only where it was
    built (a home directory shared between machines must not hand one CPU's build to another)."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            text += "".join(line for line in f if line.startswith(("flags", "model name", "Features")))
    except OSError:
        text += platform.processor()
    return text


def library_path(cc: str, directory: Path | None = None) -> Path:
    """The shared library built from :data:`SOURCES` by the compiler command ``cc`` for this CPU, in
    ``directory`` (default :func:`cache_dir`); it may not exist yet."""
    code = [p.read_bytes() for p in (*SOURCES, *HEADERS)]
    key = hashlib.sha256(
        b"\0".join([*code, cc.encode(), " ".join((*FLAGS, OPENMP)).encode(), cpu_key().encode()])
    ).hexdigest()[:16]
    return (cache_dir() if directory is None else directory) / f"native-{key}.so"


def probe(library: str, digest: str) -> int:
    """The separate process's side of a build's first load (:func:`.first_load.check_apart`): load
    ``library`` if its bytes still have ``digest``, run :func:`.checks.check_library` with two threads or
    more; 0 when it passed, else prints why and returns 1."""
    path = Path(library)
    try:
        if cache.file_digest(path) != digest:
            print("its bytes changed while it was checked")
            return 1
    except OSError as e:
        print(f"it cannot be read: {e}")
        return 1
    # at least two threads (this process is the check's own), so that the decode layers' team step runs
    torch.set_num_threads(max(2, torch.get_num_threads()))
    reason = checks.check_library(open_library(path))
    if reason is not None:
        print(reason)
        return 1
    return 0


class Loaded(NamedTuple):
    lib: ctypes.CDLL | None
    reason: str | None  # why lib is None
    path: Path | None  # the file lib was loaded from
    notes: tuple[str, ...]  # what was skipped or repaired on the way


def open_entry(compiler: list[str], so: Path, notes: list[str]) -> tuple[ctypes.CDLL | None, str | None]:
    """Load the build at ``so``: verified against its digest, rebuilt when it fails (once), its first
    load checked in a separate process. Appends what it repaired to ``notes``."""
    for _ in range(2):
        digest, why = cache.verify(so)
        fresh = digest is None
        if digest is None:
            if why is not None:
                notes.append(f"{why}; rebuilt")
            cache.remove_entry(so)
            args = [*FLAGS, OPENMP, *map(str, SOURCES), "-lm"]
            digest, why = build.compile_library(compiler, args, OPENMP, so)
            if digest is None:
                return None, why
        if cache.read_record(so, "checked") != digest:
            why = first_load.check_apart(HERE / "__init__.py", so, digest)
            if why is not None:
                cache.remove_entry(so)
                if fresh:
                    return None, f"the newly built native library {why}; it was removed"
                notes.append(f"the cached native library {so} {why}; it was removed and rebuilt")
                continue
            cache.record(so, "checked", digest)
        if cache.verify(so)[0] != digest:
            notes.append(f"the cached native library {so} changed while it was checked; rebuilt")
            continue
        try:
            lib = open_library(so)
        except (OSError, AttributeError) as e:
            return None, f"loading the native kernels from {so} failed: {e}"
        reason = checks.check_library(lib)
        return (None, reason) if reason else (lib, None)
    return None, f"the native library at {so} failed twice: {'; '.join(notes[-2:])}"


@build.Once  # one build per process, however many threads ask at once
def load() -> Loaded:
    if os.environ.get("MULTIHEAD_NATIVE", "1") == "0":
        return Loaded(None, "disabled by MULTIHEAD_NATIVE=0", None, ())
    if not hasattr(os, "getuid"):
        return Loaded(
            None, "the native kernels need a POSIX system (their cache is checked by owner)", None, ()
        )
    compiler, reason = build.find_compiler()
    if compiler is None:
        return Loaded(None, reason, None, ())
    where, notes, unsafe = cache.private_dir(cache_dir())
    if unsafe:  # a directory planted by another account, or one anybody may write
        warnings.warn("multihead.native: " + "; ".join(notes), RuntimeWarning, stacklevel=4)
    if where is None:
        return Loaded(
            None, f"no private directory to build the native kernels in: {'; '.join(notes)}", None, ()
        )
    so = library_path(" ".join(compiler), where)
    seen = len(notes)
    try:
        lib, reason = open_entry(compiler, so, notes)
    except OSError as e:  # a full disk, a directory removed under us: no kernels, and why
        lib, reason = None, f"building or loading the native kernels in {where} failed: {e}"
    # an entry kept before digests were recorded is rebuilt as a matter of course: no warning
    repaired = [n for n in notes[seen:] if "no recorded digest" not in n]
    if repaired:
        warnings.warn("multihead.native: " + "; ".join(repaired), RuntimeWarning, stacklevel=4)
    return Loaded(lib, reason, so if lib is not None else None, tuple(notes))
