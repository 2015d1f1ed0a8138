"""The native library built for another x86-64 target than this CPU's (``-march=...`` instead of
``-march=native``), so that tests reach the AVX2 and portable code paths on an AVX-512 machine."""

from __future__ import annotations

import atexit
import contextlib
import platform
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from multihead import native


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists ``flag`` (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(flag in line.split() for line in f if line.startswith("flags"))
    except OSError:
        return False


#: one cache for every test's builds (its file names hold the flags): each target is compiled once a run
_BUILDS = Path(tempfile.mkdtemp(prefix="multihead-test-builds-"))
atexit.register(shutil.rmtree, _BUILDS, ignore_errors=True)


@contextlib.contextmanager
def built_for(march: str, flag: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Within the block, :func:`multihead.native.library` is a build for ``-march=march``; ``march`` may
    add flags after it ("x86-64-v3 -mavxvnni"). The builds are kept for the rest of the test run (in one
    private temporary directory). Skips the test where this is not an
    x86-64 CPU with ``flag`` (the build's widest instructions)."""
    if platform.machine() != "x86_64" or not cpu_has(flag):
        pytest.skip(f"-march={march} needs an x86-64 CPU with {flag}")
    target, *extra = march.split()
    flags = [
        g
        for f in native.loader.FLAGS
        for g in ([f"-march={target}", *extra] if f == "-march=native" else [f])
    ]
    monkeypatch.setenv("MULTIHEAD_CACHE", str(_BUILDS))
    monkeypatch.setattr(native.loader, "FLAGS", tuple(flags))
    native.loader.load.cache_clear()
    try:
        yield
    finally:
        native.loader.load.cache_clear()
