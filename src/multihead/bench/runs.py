"""Figures over several runs of one benchmark, each run with its own probe of the limit: the median of
each run's rate over the limit probed in that same run (a busy machine slows a run and its probe alike),
and the median of the rates that were measurable.
``benchmarks/llamacpp_decode.py`` reads its runs through them.
"""

from __future__ import annotations

import math
import statistics

from . import timing

__all__ = ["median_rate", "paired_limit_text"]


def paired_limit_text(rates: list[float], limits: list[float], refusal: str = timing.ABOVE) -> str:
    """The median over runs of each run's rate over the limit probed in that run, as text ("73%"; "-"
    when no run was measurable; ``refusal`` (by default that of :func:`multihead.bench.timing.limit_text`)
    when the median is above 100%)."""
    pairs = zip(rates, limits, strict=True)
    fractions = [r / lim for r, lim in pairs if math.isfinite(r) and math.isfinite(lim) and lim > 0]
    if not fractions:
        return "-"
    return timing.limit_text(statistics.median(fractions), 1.0, refusal)


def median_rate(rates: list[float]) -> float | None:
    """The median of the measurable rates (NaN: too short to measure), None when there is none."""
    ok = [r for r in rates if math.isfinite(r)]
    return statistics.median(ok) if ok else None
