"""Rules 1 and 2 of :mod:`multihead.cost.timing`: a call timed in samples long enough for the clock and
the scheduler (or "too short to measure"), and a spread with every median (:class:`Timing`), compared
only where the spreads do not overlap (:func:`compare`).

The clock is a parameter, so tests drive every path with a fake one. :mod:`multihead.cost.timing`
re-exports everything here.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "FLOOR_SAMPLE",
    "MIN_TICKS",
    "MIN_TOTAL",
    "SAME",
    "TOO_SHORT",
    "Comparison",
    "Timing",
    "clock_resolution",
    "compare",
    "difference",
    "enough",
    "first_call",
    "from_samples",
    "measure",
    "measure_all",
    "once",
    "rate_text",
    "time_text",
]

Clock = Callable[[], float]
Sync = Callable[[float], float]
T = TypeVar("T")

TOO_SHORT = "too short to measure"
SAME = "same within noise"
MIN_TOTAL = 0.2  # seconds of samples: ~16 scheduler slices of 12 ms
MIN_TICKS = 50  # clock ticks per sample: rounding to the clock costs under 2%
FLOOR_SAMPLE = 1e-4  # seconds: a sample shorter than this is mostly the timer's own cost


@dataclass(frozen=True)
class Timing:
    """Seconds per call: ``median`` with the spread ``low`` .. ``high`` (quartiles of the samples, or
    min / max with fewer than 4 samples), over ``samples`` samples of ``inner`` calls each.

    ``median`` is None when the call was too short to measure; ``why`` then says why.
    """

    median: float | None
    low: float | None
    high: float | None
    samples: int
    inner: int
    why: str = ""
    best: float | None = None  # the fastest sample per call: for a limit's probe, the best case counts

    @property
    def ok(self) -> bool:
        return self.median is not None

    def rate(self, work: float) -> float | None:
        """``work`` per second (tokens, FLOPs, bytes) at the median; None when too short to measure."""
        return None if self.median is None else work / self.median

    def __str__(self) -> str:
        return time_text(self)


@dataclass(frozen=True)
class Comparison:
    """``ratio`` = time of ``a`` / time of ``b`` (below 1: a is faster); ``same`` when the spreads
    overlap (the difference is inside the noise); ``ratio`` None when either side has no number."""

    ratio: float | None
    same: bool

    def __str__(self) -> str:
        if self.ratio is None:
            return TOO_SHORT
        return SAME if self.same else f"{self.ratio:.2f}x"


def clock_resolution(clock: Clock = time.perf_counter, reads: int = 100_000) -> float | None:
    """The smallest step of ``clock`` seen in up to ``reads`` reads (three steps are watched), or None
    when it never moved: a clock that does not advance by itself cannot time anything."""
    steps: list[float] = []
    last = clock()
    for _ in range(reads):
        now = clock()
        if now != last:
            steps.append(now - last)
            last = now
            if len(steps) == 3:
                break
    positive = [s for s in steps if s > 0]
    return min(positive) if positive else None


def _spread(xs: Sequence[float]) -> tuple[float, float]:
    if len(xs) < 4:
        return min(xs), max(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _sample(fn: Callable[[], object], inner: int, clock: Clock, sync: Sync) -> float:
    start = clock()
    for _ in range(inner):
        fn()
    return sync(clock() - start)


def _calibrate(
    fn: Callable[[], object], min_sample: float, max_inner: int, clock: Clock, sync: Sync
) -> tuple[int, float]:
    """Calls per sample (doubled or scaled up until a sample lasts ``min_sample``) and that sample."""
    inner, first = 1, _sample(fn, 1, clock, sync)
    while first < min_sample and inner < max_inner:
        grow = 2 if first <= 0 else min(max(2, math.ceil(1.2 * min_sample / first)), 1 << 10)
        inner = min(inner * grow, max_inner)
        first = _sample(fn, inner, clock, sync)
    return inner, first


def _summary(per_call: Sequence[float], inner: int) -> Timing:
    low, high = _spread(per_call)
    return Timing(statistics.median(per_call), low, high, len(per_call), inner, best=min(per_call))


def enough(
    samples: Sequence[float],
    *,
    min_total: float = MIN_TOTAL,
    min_samples: int = 5,
    max_samples: int = 200,
    max_seconds: float = 10.0,
) -> bool:
    """Whether ``samples`` (seconds each) suffice: ``max_samples`` of them, or ``min_samples`` adding up
    to ``min_total`` seconds, or ``max_seconds`` of them with at least ``min(3, min_samples)`` (a slow
    call). :func:`measure_all`'s rule, for callers that take their samples elsewhere (a worker
    process) and ask after each round whether to take another."""
    total = sum(samples)
    return (
        len(samples) >= max_samples
        or (len(samples) >= min_samples and total >= min_total)
        or (total >= max_seconds and len(samples) >= min(3, min_samples))
    )


def from_samples(seconds: Sequence[float], *, inner: int = 1, floor: float = FLOOR_SAMPLE) -> Timing:
    """A :class:`Timing` from samples taken elsewhere (in a worker process, by a GPU's events): each
    sample ``inner`` calls; "too short to measure" when there is none or one is under ``floor``
    seconds (by default 0.1 ms, where the timer's own cost dominates; the caller's clock may need
    more: 50 of its ticks).

    Raises:
        ValueError: ``inner`` below 1.
    """
    if inner < 1:
        raise ValueError(f"inner must be >= 1 (calls per sample), got {inner}")
    if not seconds:
        return Timing(None, None, None, 0, inner, f"{TOO_SHORT}: no samples")
    if min(seconds) < floor:
        return Timing(
            None, None, None, len(seconds), inner,
            f"{TOO_SHORT}: a sample of {inner} call(s) took {min(seconds):.3g} s, under {floor:.3g} s",
        )  # fmt: skip
    return _summary([s / inner for s in seconds], inner)


def once(
    fn: Callable[[], T], *, clock: Clock = time.perf_counter, resolution: float | None = None
) -> tuple[T, Timing]:
    """Call ``fn`` once, timed, never again: a call that must not be repeated (a training run, a
    first call that compiles). Returns its result and its :class:`Timing` (one sample), "too short to
    measure" under 50 ticks of ``clock`` (or 0.1 ms) rather than a duration the clock cannot tell."""
    tick = clock_resolution(clock) if resolution is None else resolution
    start = clock()
    out = fn()
    took = clock() - start
    floor = math.inf if tick is None else max(MIN_TICKS * tick, FLOOR_SAMPLE)
    return out, from_samples([took], floor=floor)


def first_call(
    fn: Callable[[], T], *, clock: Clock = time.perf_counter, resolution: float | None = None
) -> tuple[T, Timing]:
    """Call ``fn`` once, timed, for its result and what it leaves behind (a peak of memory, a saved
    output); where that call is too short for ``clock`` (under 50 of its ticks), time more calls of it
    (:func:`measure`: one sample of as many calls as the clock needs, or "too short to measure").
    Returns the first call's result and the :class:`Timing` of one sample (seconds per call)."""
    tick = clock_resolution(clock) if resolution is None else resolution
    start = clock()
    out = fn()
    took = clock() - start
    if tick is not None and took >= max(MIN_TICKS * tick, FLOOR_SAMPLE):
        return out, _summary([took], 1)
    options: dict[str, Any] = {"min_samples": 1, "max_samples": 1, "min_total": 0.0, "warmup": 0}
    return out, measure(fn, clock=clock, resolution=tick, **options)


def measure(fn: Callable[[], object], **options: Any) -> Timing:
    """Time ``fn()``: seconds per call, median and spread, or "too short to measure". The options are
    :func:`measure_all`'s."""
    return measure_all({"fn": fn}, **options)["fn"]


def measure_all(
    fns: Mapping[str, Callable[[], object]],
    *,
    min_total: float = MIN_TOTAL,
    min_samples: int = 5,
    max_samples: int = 200,
    max_inner: int = 1 << 12,
    max_seconds: float = 10.0,
    warmup: int = 1,
    clock: Clock = time.perf_counter,
    resolution: float | None = None,
    progress: Callable[[str], None] | None = None,
    sync: Sync | None = None,
) -> dict[str, Timing]:
    """Time every call of ``fns``, samples interleaved and rotated (a, b, c, b, c, a, c, a, b, ...) so
    that a change of load on a shared machine hits them alike, and no call always runs right after the
    same other one: name -> :class:`Timing`.

    Args:
        fns: name -> the call to time (its result is dropped).
        min_total: seconds each call's samples must add up to (more samples are taken until they do).
        min_samples: samples at least (fewer only when ``max_seconds`` runs out: a slow call).
        max_samples: samples at most.
        max_inner: calls per sample at most, while looking for a sample long enough for the clock.
        max_seconds: a call stops taking samples after this many seconds of them, with at least
            ``min(3, min_samples)`` (keeps slow calls affordable).
        warmup: untimed calls of each first (threads, caches, lazy packing settle).
        clock: seconds now; ``time.perf_counter`` (tests pass a fake one).
        resolution: the clock's tick; measured with :func:`clock_resolution` when None.
        progress: called with the name of each call before it is timed.
        sync: maps every duration measured here (the clock's tick included) to the one all processes
            agree on - the maximum over the ranks of a process group, through an all-reduce - so that
            processes timing one collective call take the same decisions and the same number of calls
            (none would wait forever for another); None: each duration as measured.

    Raises:
        ValueError: a count below 1 or a duration below 0.
    """
    for name, v in (("min_samples", min_samples), ("max_samples", max_samples), ("max_inner", max_inner)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if min_total < 0 or max_seconds < 0 or warmup < 0:
        raise ValueError(
            f"min_total, max_seconds and warmup must be >= 0, got {min_total}, {max_seconds}, {warmup}"
        )
    agree: Sync = sync or (lambda seconds: seconds)
    seen = clock_resolution(clock) if resolution is None else resolution
    tick = agree(-1.0 if seen is None else seen)  # -1: this clock never moved (all agree when every one)
    if tick <= 0:
        return {k: Timing(None, None, None, 0, 0, f"{TOO_SHORT}: the clock did not advance") for k in fns}
    min_sample = max(MIN_TICKS * tick, FLOOR_SAMPLE)
    inner: dict[str, int] = {}
    samples: dict[str, list[float]] = {}
    out: dict[str, Timing] = {}
    say = progress or (lambda what: None)
    for k, fn in fns.items():
        say(k)
        for _ in range(warmup):
            fn()
        inner[k], first = _calibrate(fn, min_sample, max_inner, clock, agree)
        if first >= min_sample:
            samples[k] = [first]
        else:
            out[k] = Timing(
                None, None, None, 1, inner[k],
                f"{TOO_SHORT}: {inner[k]} calls took {first:.3g} s, under {min_sample:.3g} s "
                f"({MIN_TICKS} ticks of a {tick:.3g} s clock)",
            )  # fmt: skip

    def done(xs: list[float]) -> bool:
        return enough(
            xs, min_total=min_total, min_samples=min_samples, max_samples=max_samples, max_seconds=max_seconds
        )

    rounds = 0
    while todo := [k for k in samples if not done(samples[k])]:
        # each round starts one further along, so no call always follows the same one (a call that
        # frees a lot of memory or evicts the caches would otherwise always slow the same next one)
        shift = rounds % len(todo)
        for k in todo[shift:] + todo[:shift]:
            say(k)
            samples[k].append(_sample(fns[k], inner[k], clock, agree))
        rounds += 1
    for k, xs in samples.items():
        out[k] = _summary([s / inner[k] for s in xs], inner[k])
    return {k: out[k] for k in fns}


def difference(longer: Timing, shorter: Timing) -> Timing:
    """``longer`` - ``shorter`` (e.g. generating n tokens minus generating 1: the decode steps alone),
    with the widest spread the two allow; "too short to measure" when that spread reaches zero, since
    then the difference is inside the noise of its two terms."""
    if longer.median is None or shorter.median is None:
        return Timing(None, None, None, 0, 0, f"{TOO_SHORT}: {longer.why or shorter.why}")
    assert longer.low is not None and longer.high is not None
    assert shorter.low is not None and shorter.high is not None
    low, high = longer.low - shorter.high, longer.high - shorter.low
    med = longer.median - shorter.median
    if low <= 0 or med <= 0:
        return Timing(
            None, None, None, 0, 0,
            f"{TOO_SHORT}: the difference {med:.3g} s is inside the noise ({low:.3g} .. {high:.3g} s) "
            "of its two terms",
        )  # fmt: skip
    return Timing(med, low, high, min(longer.samples, shorter.samples), 1)


def compare(a: Timing, b: Timing) -> Comparison:
    """Time ratio a / b, and whether the spreads overlap ("same within noise": never a gain)."""
    if a.median is None or b.median is None or b.median <= 0:
        return Comparison(None, False)
    assert a.low is not None and a.high is not None and b.low is not None and b.high is not None
    same = a.low <= b.high and b.low <= a.high
    return Comparison(a.median / b.median, same)


def time_text(t: Timing, unit: str = "ms") -> str:
    """``"12.3 ms (11.9-12.8)"`` or ``"too short to measure"``."""
    if t.median is None or t.low is None or t.high is None:
        return TOO_SHORT
    k = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    return f"{t.median * k:.3g} {unit} ({t.low * k:.3g}-{t.high * k:.3g})"


def rate_text(t: Timing, work: float, spec: str = ".1f") -> str:
    """``work`` per second at the median, formatted with ``spec``, or "too short to measure"."""
    r = t.rate(work)
    return TOO_SHORT if r is None else format(r, spec)
