"""The native library built for another x86-64 target than this CPU's (``-march=...`` instead of
``-march=native``), so that tests reach the AVX2 and portable code paths on an AVX-512 machine."""

from __future__ import annotations

import contextlib
import platform
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


@contextlib.contextmanager
def built_for(march: str, flag: str, monkeypatch: pytest.MonkeyPatch, cache: Path) -> Iterator[None]:
    """Within the block, :func:`multihead.native.library` is a build for ``-march=march`` (in ``cache``);
    skips the test where this is not an x86-64 CPU with ``flag`` (the build's widest instructions)."""
    if platform.machine() != "x86_64" or not cpu_has(flag):
        pytest.skip(f"-march={march} needs an x86-64 CPU with {flag}")
    monkeypatch.setenv("MULTIHEAD_CACHE", str(cache))
    monkeypatch.setattr(
        native, "FLAGS", tuple(f"-march={march}" if f == "-march=native" else f for f in native.FLAGS)
    )
    native._load.cache_clear()
    try:
        yield
    finally:
        native._load.cache_clear()
