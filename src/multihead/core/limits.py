"""How much memory a call may ask for, checked before it allocates.

Two bounds: the memory the device has free (``MemAvailable`` of /proc/meminfo on the CPU,
``torch.cuda.mem_get_info`` on a GPU), and a documented limit on one materialised (B, Hq, Nq, Nk) score
matrix, :data:`DEFAULT_MAX_SCORE_BYTES` (4 GiB), raised or lowered with the environment variable
``MULTIHEAD_MAX_SCORE_BYTES`` (a byte count). A request over either raises a ValueError that says how
much it needs and what to do, instead of an out-of-memory error (or the kernel's OOM killer) later.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = [
    "DEFAULT_MAX_SCORE_BYTES",
    "SCORE_LIMIT_ENV",
    "SMALL_BYTES",
    "available_bytes",
    "check_fits",
    "format_bytes",
    "max_score_bytes",
]

#: The environment variable that sets the largest score matrix the dense paths materialise.
SCORE_LIMIT_ENV = "MULTIHEAD_MAX_SCORE_BYTES"
#: Its default: 4 GiB.
DEFAULT_MAX_SCORE_BYTES = 4 << 30
#: Requests up to this size are not compared with the free memory (asking costs a file read).
SMALL_BYTES = 64 << 20


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def available_bytes(device: torch.device | str | None = None) -> int | None:
    """Bytes free on ``device`` (None: the CPU), or None when the platform does not say."""
    dev = torch.device("cpu" if device is None else device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    if dev.type == "meta":
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(nbytes: int, what: str, fix: str, device: torch.device | str | None = None) -> None:
    """Raise unless ``nbytes`` fit in the memory ``device`` has free.

    Raises:
        ValueError: ``"{what} needs {size}, but only {free} is free on {device}; {fix}"``.
    """
    if nbytes <= SMALL_BYTES:
        return  # not worth a read of /proc/meminfo on every call
    free = available_bytes(device)
    if free is not None and nbytes > free:
        dev = "the CPU" if device is None or torch.device(device).type == "cpu" else str(device)
        raise ValueError(
            f"{what} needs {format_bytes(nbytes)}, but only {format_bytes(free)} is free on {dev}; {fix}"
        )


def max_score_bytes() -> int:
    """The largest (B, Hq, Nq, Nk) score matrix the dense paths may materialise, in bytes.

    Raises:
        ValueError: ``MULTIHEAD_MAX_SCORE_BYTES`` is set to something other than a whole number >= 0.
    """
    raw = os.environ.get(SCORE_LIMIT_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_MAX_SCORE_BYTES
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{SCORE_LIMIT_ENV}={raw!r} must be a whole number of bytes >= 0, e.g. {8 << 30}")
    return value
