"""Timing and time budgets shared by the parts of ``benchmarks/gpu_check.py`` (its speed and Hugging Face
parts, ``benchmarks/gpu_speed.py`` and ``benchmarks/gpu_hf.py``).

A part gets a :class:`Budget` of seconds; each row asks it before starting and is recorded as skipped
once it is spent, so the whole check stays bounded (a row already running - a compilation - finishes).
Times go through ``multihead.bench.timing`` on the device's clock (CUDA events on a GPU): warm calls
repeated until a sample is long enough, first calls timed once, "too short to measure" instead of a
number the clock cannot tell.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from . import timing


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

    def allows(self, compiles: bool) -> bool:
        """Whether a row may still start: a method that compiles per case (seconds each) only while the
        budget lasts, the others up to half the budget again, so a table stays complete for them."""
        return not ((compiles and self.over()) or self.left() < -0.5 * self.seconds)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_clock(device: torch.device) -> Callable[[], float]:
    """Seconds now as the device sees them: on a GPU a CUDA event recorded on the stream and waited
    for (the kernels' own timeline, as ``torch.cuda.Event(enable_timing=True)`` measures it), elsewhere
    ``time.perf_counter``. A sample between two reads spans every kernel launched in between."""
    if device.type != "cuda":
        return time.perf_counter
    base = torch.cuda.Event(enable_timing=True)
    base.record()
    torch.cuda.synchronize(device)

    def now() -> float:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        event.synchronize()
        return base.elapsed_time(event) / 1e3  # ms -> s

    return now


def once_ms(
    fn: Callable[[], object], device: torch.device, clock: Callable[[], float] | None = None
) -> float | None:
    """Milliseconds of one call, synchronised, never repeated (a first call: compilation and caches
    included): :func:`multihead.bench.timing.once`; None where it is too short to measure."""

    def call() -> None:
        fn()
        sync(device)

    sync(device)
    _, t = timing.once(call, clock=clock or time.perf_counter)
    return None if t.median is None else t.median * 1e3


def warm(
    fn: Callable[[], object], device: torch.device, repeats: int, clock: Callable[[], float] | None = None
) -> timing.Timing:
    """Seconds per call of an already warm ``fn`` (:func:`multihead.bench.timing.measure`: at least
    ``repeats`` samples, each long enough for the clock, on the device's clock: CUDA events on a GPU)."""
    return timing.measure(
        fn, min_samples=max(1, repeats), max_seconds=2.0, warmup=0, clock=clock or device_clock(device)
    )


def warm_ms(
    fn: Callable[[], object], device: torch.device, repeats: int, clock: Callable[[], float] | None = None
) -> float | None:
    """Median milliseconds of :func:`warm`; None where too short to measure."""
    t = warm(fn, device, repeats, clock)
    return None if t.median is None else t.median * 1e3


def first_and_warm(
    fn: Callable[[], object],
    device: torch.device,
    repeats: int,
    slow_ms: float = 1000.0,
    clock: Callable[[], float] | None = None,
) -> dict[str, float | bool | str | list[float] | None]:
    """``{"first_ms", "ms"}``: the first call, then the median warm call after one more warm-up.

    A method whose second call still takes over ``slow_ms`` is reported from that call alone
    (``"one_call": True``): a slow path needs no median, and repeating it would spend the budget. A warm
    call too short to measure has no ``"ms"`` but ``"skipped"``, the reason.
    """
    first = once_ms(fn, device, clock)
    second = once_ms(fn, device, clock)
    if second is not None and second > slow_ms:
        return {"first_ms": first, "ms": second, "one_call": True}
    t = warm(fn, device, repeats, clock)
    if t.median is None:
        return {"first_ms": first, "skipped": t.why}
    assert t.low is not None and t.high is not None
    return {"first_ms": first, "ms": t.median * 1e3, "spread_ms": [t.low * 1e3, t.high * 1e3]}


def time_ratio(slow: dict, fast: dict) -> float | str | None:
    """``slow``'s warm time over ``fast``'s (cells of :func:`first_and_warm`), rounded; "same within
    noise" where their spreads overlap (a cell without a spread is a single sample); None without two
    times."""

    def back(cell: dict) -> timing.Timing:
        ms = cell.get("ms")
        low, high = cell.get("spread_ms") or (ms, ms)
        return timing.Timing(ms, low, high, 1, 1) if ms else timing.Timing(None, None, None, 0, 0, "no time")

    c = timing.compare(back(slow), back(fast))
    return None if c.ratio is None else timing.SAME if c.same else round(c.ratio, 3)


def peer_ratios(
    cells: dict[str, dict], ours: tuple[str, ...], peers: tuple[str, ...]
) -> dict[str, float | str]:
    """``"ours vs peer"`` for every pair with two times: the peer's warm time over ours (above 1 = ours
    faster, :func:`time_ratio`), or "same within noise" where the spreads overlap."""
    out = {}
    for mine in ours:
        for peer in peers:
            r = time_ratio(cells.get(peer, {}), cells.get(mine, {}))
            if r is not None:
                out[f"{mine} vs {peer}"] = r
    return out
