"""Rules 3 and 4 of :mod:`multihead.cost.timing`: no fraction above its physical limit
(:func:`fraction_of_limit`, :func:`limit_text`), and no impossible figure printed (:func:`check_figure`,
:func:`rate_figure`: "n/a (why; what to pass)" instead of the number). :mod:`multihead.cost.timing`
re-exports everything here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .sampling import TOO_SHORT, Timing

__all__ = ["ABOVE", "WIDE", "Checked", "check_figure", "fraction_of_limit", "limit_text", "rate_figure"]

ABOVE = "above limit: probe or byte count wrong"
#: a spread whose ends are more than this many times apart says nothing about its median
WIDE = 10.0


def fraction_of_limit(rate: float | None, limit: float | None) -> float | None:
    """``rate / limit``, or None where either is missing.

    Raises:
        ValueError: the fraction is above 1: a rate above its physical limit means the limit's probe
            or the count of bytes / FLOPs per unit of work is wrong, and no figure is printed for it.
    """
    if rate is None or limit is None or not math.isfinite(rate) or limit <= 0:
        return None
    frac = rate / limit
    if frac > 1.0:
        raise ValueError(
            f"a measured rate of {rate:.4g} is {frac:.0%} of its limit {limit:.4g}: above 100% means "
            "the probe of the limit or the bytes/FLOPs counted per unit of work is wrong"
        )
    return frac


def limit_text(rate: float | None, limit: float | None, refusal: str = ABOVE) -> str:
    """The fraction of :func:`fraction_of_limit` as text: "92%", "-" without a number, or the refusal
    (default "above limit: probe or byte count wrong") instead of a figure above 100%."""
    try:
        frac = fraction_of_limit(rate, limit)
    except ValueError:
        return refusal
    return "-" if frac is None else f"{frac:.0%}"


@dataclass(frozen=True)
class Checked:
    """A figure that passed :func:`check_figure` (``why`` empty), or the reason it is not printed
    (``value`` None, ``why`` the reason and ``fix`` what to pass for a figure)."""

    value: float | None
    low: float | None = None
    high: float | None = None
    why: str = ""
    fix: str = ""

    @property
    def ok(self) -> bool:
        return self.value is not None and not self.why

    def text(self, spec: str = ".1f", spread_spec: str | None = None, unit: str = "") -> str:
        """``"605.2 tokens/s (590.1-620.4)"`` (``unit`` after the value, the spread where there is one),
        or ``"n/a (why; fix)"``."""
        if not self.ok:
            return "n/a (" + "; ".join(x for x in (self.why or TOO_SHORT, self.fix) if x) + ")"
        assert self.value is not None
        out = format(self.value, spec) + (f" {unit}" if unit else "")
        if self.low is not None and self.high is not None:
            inner = spread_spec or spec
            out += f" ({format(self.low, inner)}-{format(self.high, inner)})"
        return out

    def __str__(self) -> str:
        return self.text()


def check_figure(
    value: float | None,
    low: float | None = None,
    high: float | None = None,
    *,
    why: str = "",
    limit: float | None = None,
    limit_what: str = "its limit",
    at_least: float | None = None,
    at_least_what: str = "",
    fix: str = "",
) -> Checked:
    """Check a figure against what it can be; every rate the application prints goes through here.

    Args:
        value: the figure (a rate, a time); None when it has none (``why`` then says why).
        low, high: its spread (both or neither).
        why: the reason there is no value (e.g. a :class:`Timing`'s "too short to measure: ...").
        limit: the most it can be (a bandwidth limit in the same unit); the value, and the top of its
            spread, must not pass it.
        limit_what: the limit's name in the reason ("the bandwidth limit").
        at_least: the least it can be (a part of a step is at least as fast as the whole step).
        at_least_what: that bound's name in the reason ("the whole step's rate").
        fix: what to pass for an honest figure, named by its option ("pass --max-new-tokens 256").

    Returns:
        :class:`Checked` with the figure, or with ``value`` None and the reason; its ``text()`` reads
        "n/a (reason; fix)" then.
    """

    def refuse(reason: str) -> Checked:
        return Checked(None, None, None, reason, fix)

    if value is None or not math.isfinite(value):
        return refuse(why or TOO_SHORT)
    if low is not None and high is not None and (low <= 0 or high / low > WIDE):
        return refuse(
            f"its spread {low:.4g}-{high:.4g} is wider than {WIDE:g}x: the samples disagree too much "
            "to give one figure"
        )
    if limit is not None and limit > 0:
        if value > limit:
            return refuse(
                f"{value:.4g} is above {limit_what} {limit:.4g}: that limit's probe or count is wrong"
            )
        if high is not None and high > limit:
            return refuse(
                f"its spread reaches {high:.4g}, above {limit_what} {limit:.4g}: the samples are noise"
            )
    if at_least is not None and value < at_least:
        return refuse(f"{value:.4g} is below {at_least_what} {at_least:.4g}")
    return Checked(value, low, high)


def rate_figure(t: Timing, work: float, **checks: Any) -> Checked:
    """``work`` per second of ``t`` as a checked figure (:func:`check_figure`): the median's rate, with
    the rates the spread allows (``work / high`` .. ``work / low``); ``checks`` are check_figure's."""
    rate = t.rate(work)
    low = high = None
    if rate is not None and t.low is not None and t.high is not None and t.low > 0:
        low, high = work / t.high, work / t.low
    return check_figure(rate, low, high, why=checks.pop("why", "") or t.why, **checks)
