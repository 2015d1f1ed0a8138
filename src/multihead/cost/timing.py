"""How every benchmark and the report time things: one helper, three rules.

1. **Long enough, or no number.** A call is repeated (``inner`` calls per sample, doubled until one
   sample lasts at least ``min_sample`` seconds: 50 ticks of the clock, so rounding to the clock costs
   under 2%) and samples are taken until they add up to ``min_total`` seconds (0.2 s: many scheduler
   time slices of 3-24 ms, so a sample that lost the CPU to another process is one of many and the
   median does not read a time slice instead of the code). Where even ``max_inner`` calls do not
   reach one clock-resolvable sample, the result says "too short to measure" instead of a number.
2. **A spread with every median.** :class:`Timing` keeps the median and the quartiles of the
   samples (the min and max with fewer than 4); :func:`compare` calls two timings "same within noise"
   when their spreads overlap, and never reports such a ratio as a gain.
3. **No fraction above the physical limit.** :func:`fraction_of_limit` refuses a measured rate above
   its limit (a bandwidth or FLOP rate): such a figure means the probe of the limit, or the count of
   bytes or FLOPs, is wrong, and that is what it says.
4. **No impossible figure printed.** :func:`check_figure` (and :func:`rate_figure` for a rate read off a
   :class:`Timing`) is what every printed rate goes through: a figure without a number, with a spread
   wider than :data:`WIDE` times, above its limit (or a spread reaching above it), or below a rate it
   must be at least (a part of a step slower than the whole step) reads "n/a (why; what to pass)",
   naming the option that gives a figure, instead of the number.

The clock is a parameter, so tests drive every path with a fake one. The helper lives in the library
(``multihead.cost``) so that the library's own probes (:mod:`multihead.cost.machine`) use it too;
``multihead.bench.timing`` is the same module under the name the benchmarks import. Rules 1 and 2
live in :mod:`multihead.cost.sampling`, rules 3 and 4 in :mod:`multihead.cost.figures`; this module
re-exports both.
"""

from __future__ import annotations

from .figures import ABOVE, WIDE, Checked, check_figure, fraction_of_limit, limit_text, rate_figure
from .sampling import (
    FLOOR_SAMPLE,
    MIN_TICKS,
    MIN_TOTAL,
    SAME,
    TOO_SHORT,
    Comparison,
    Timing,
    clock_resolution,
    compare,
    difference,
    enough,
    first_call,
    from_samples,
    measure,
    measure_all,
    once,
    rate_text,
    time_text,
)

__all__ = [
    "ABOVE",
    "FLOOR_SAMPLE",
    "MIN_TICKS",
    "MIN_TOTAL",
    "SAME",
    "TOO_SHORT",
    "WIDE",
    "Checked",
    "Comparison",
    "Timing",
    "check_figure",
    "clock_resolution",
    "compare",
    "difference",
    "enough",
    "first_call",
    "fraction_of_limit",
    "from_samples",
    "limit_text",
    "measure",
    "measure_all",
    "once",
    "rate_figure",
    "rate_text",
    "time_text",
]
