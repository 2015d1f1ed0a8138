"""The timing helper of every benchmark: :mod:`multihead.cost.timing` under the name the benchmarks and
the report import (it lives in the library so that the library's own probes use it too)."""

from __future__ import annotations

from ..cost.timing import (
    ABOVE,
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
    fraction_of_limit,
    from_samples,
    limit_text,
    measure,
    measure_all,
    once,
    rate_text,
    time_text,
)

__all__ = [
    "ABOVE",
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
    "fraction_of_limit",
    "from_samples",
    "limit_text",
    "measure",
    "measure_all",
    "once",
    "rate_text",
    "time_text",
]
