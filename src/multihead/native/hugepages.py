"""Weights in memory backed by 2 MiB pages, so that a decode step's stream through them misses the TLB
512x less often.

A batch-1 decode step reads every weight once, in order, from memory no cache holds: its floor is the
read bandwidth. With 4 KiB pages that stream also takes a TLB miss (a page walk, costlier still under
virtualisation) every 4 KiB; a 2 MiB page covers 512 of them. On the virtual machines we measured,
a large matrix-vector product read markedly faster from 2 MiB pages than from 4 KiB ones
(BENCHMARKS.md, "Decoding on the CPU").

:func:`collapse` asks for huge pages under tensors where they lie (``MADV_COLLAPSE``, Linux 6.1 and later;
addresses and views unchanged): a plain model's weights at its first native decode step.
:func:`move_to_huge_pages` copies tensors into one anonymous mapping that asks Linux for transparent huge
pages (``madvise(MADV_HUGEPAGE)``, honoured when ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``always`` or ``madvise``) and re-points the tensors at it in place, so every module holding them (a
tied head included) reads the new memory: ``quantize(kernel="native")``'s own copy of the weights.
Where the platform has no ``MADV_HUGEPAGE`` nothing moves.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["HUGE_PAGE", "available", "collapse", "coverage", "move_to_huge_pages"]

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's transparent huge page
_ALIGN = 4096  # each storage starts on its own 4 KiB boundary inside the mapping
_MADV_COLLAPSE = 25  # Linux >= 6.1: back a range with huge pages now, in place (<linux/mman.h>)


def available() -> bool:
    """Whether this platform can ask for transparent huge pages (Linux's ``MADV_HUGEPAGE``)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap.mmap, "madvise")


def _madvise() -> Any:
    """libc's ``madvise`` through ctypes, or None off Linux."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def collapse(tensors: Iterable[Tensor], min_bytes: int = HUGE_PAGE) -> int:
    """Ask Linux to back the CPU storages of ``tensors`` (those of at least ``min_bytes``) with huge pages
    where they lie, now (``madvise(MADV_COLLAPSE)``, Linux 6.1 and later): the memory's addresses, values
    and every view of it stay as they are; only the whole 2 MiB pages inside each storage can change.
    It costs a copy inside the kernel (milliseconds per MiB), so do it once per storage.

    Returns:
        the bytes now inside huge pages (0 off Linux, on an older kernel or where the kernel refused).
    """
    madvise = _madvise()
    if madvise is None:
        return 0
    done, seen = 0, set()
    for t in tensors:
        s = t.untyped_storage()
        if t.device.type != "cpu" or s.nbytes() < min_bytes or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        start = -(-s.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (s.data_ptr() + s.nbytes()) // HUGE_PAGE * HUGE_PAGE
        if end > start and madvise(start, end - start, _MADV_COLLAPSE) == 0:
            done += end - start
    return done


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping with ``nbytes`` usable from a 2 MiB-aligned offset, advised for huge pages."""
    import ctypes

    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: shared
    # anonymous memory is shmem, whose huge pages another switch (usually off) governs
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))  # where the mapping starts
    start = -base % HUGE_PAGE
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages: plain pages, same values
        mm.madvise(mmap.MADV_HUGEPAGE, start, (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE)
    return mm, start


def move_to_huge_pages(tensors: Iterable[Tensor], min_bytes: int = HUGE_PAGE) -> int:
    """Copy the CPU storages of ``tensors`` that hold at least ``min_bytes`` into one huge-page mapping
    and point every given tensor that viewed them at the copy (same values, shapes, strides and storage
    offsets; tensors sharing a storage keep sharing it). Gradient tracking is unchanged.

    Returns:
        the bytes moved (0 where :func:`available` is False or nothing qualified).

    Raises:
        ValueError: a tensor that is not on the CPU.
    """
    if not available():
        return 0
    groups: dict[int, list[Tensor]] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"move_to_huge_pages takes CPU tensors, got one on {t.device}")
        s = t.untyped_storage()
        if s.nbytes() >= max(min_bytes, 1):  # an empty storage has nothing to move
            groups.setdefault(s.data_ptr(), []).append(t)
            storages[s.data_ptr()] = s
    if not storages:
        return 0
    offsets, total = {}, 0
    for ptr, s in storages.items():
        offsets[ptr] = total
        total += -(-s.nbytes() // _ALIGN) * _ALIGN
    mm, start = _mapping(total)
    with torch.no_grad():
        for ptr, s in storages.items():  # each its own storage of exactly its bytes, inside the mapping
            new = torch.frombuffer(mm, dtype=torch.uint8, count=s.nbytes(), offset=start + offsets[ptr])
            new.copy_(torch.empty(0, dtype=torch.uint8).set_(s))  # (nbytes,): the storage's bytes as they are
            fresh = new.untyped_storage()  # keeps the mapping alive
            for t in groups[ptr]:
                t.data = torch.empty(0, dtype=t.dtype).set_(fresh, t.storage_offset(), t.shape, t.stride())
    return sum(s.nbytes() for s in storages.values())


def coverage(
    tensors: Iterable[Tensor], min_bytes: int = HUGE_PAGE, smaps: str = "/proc/self/smaps"
) -> float | None:
    """The share of the bytes of ``tensors``' CPU storages (those of at least ``min_bytes``, each counted
    once) that lie in huge pages, by mapping: each storage counts its mapping's ``AnonHugePages`` share
    (exact for one arena holding them all, as :func:`move_to_huge_pages` makes). None where ``smaps``
    cannot be read (not Linux) or no storage qualifies. A decode step that reads slower than its
    neighbours' can be checked with it.
    """
    try:
        with open(smaps) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    maps: list[list[int]] = []  # [start, end, huge bytes]
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            maps.append([lo, hi, 0])
        elif head == "AnonHugePages:" and maps:
            maps[-1][2] = int(line.split()[1]) * 1024
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == "cpu" and t.untyped_storage().nbytes() >= min_bytes:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    total = huge = 0.0
    for ptr, n in seen.items():
        for lo, hi, h in maps:
            if lo <= ptr < hi:
                total += n
                huge += n * min(1.0, h / (hi - lo))
                break
    return huge / total if total else None
