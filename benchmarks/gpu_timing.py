"""Timing and time budgets shared by the parts of ``gpu_check.py``.

A part gets a :class:`Budget` of seconds; each row asks it before starting and is recorded as skipped
once it is spent, so the whole check stays bounded (a row already running - a compilation - finishes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


class Budget:
    """Seconds left to one part of the check."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.perf_counter()

    def spent(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.spent()

    def over(self) -> bool:
        return self.left() <= 0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def once_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Wall milliseconds of one call, synchronised (a first call: compilation and caches included)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def warm_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls of an already warm ``fn`` (CUDA events on a GPU)."""
    times: list[float] = []
    for _ in range(max(1, repeats)):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def first_and_warm(
    fn: Callable[[], object], device: torch.device, repeats: int, slow_ms: float = 1000.0
) -> dict[str, float | bool]:
    """``{"first_ms", "ms"}``: the first call, then the median warm call after one more warm-up.

    A method whose second call still takes over ``slow_ms`` is reported from that call alone
    (``"one_call": True``): a slow path needs no median, and repeating it would spend the budget.
    """
    first = once_ms(fn, device)
    second = once_ms(fn, device)
    if second > slow_ms:
        return {"first_ms": first, "ms": second, "one_call": True}
    return {"first_ms": first, "ms": warm_ms(fn, device, repeats)}
