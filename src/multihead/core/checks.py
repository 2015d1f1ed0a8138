"""Argument checks shared by the public boundary: each raises a ValueError that names the argument, the
value and, where one helps, the fix."""

from __future__ import annotations

from typing import Any

__all__ = ["check_int", "check_number"]


def check_int(
    name: str, value: Any, low: int, high: int | None = None, *, owner: str = "", fix: str = ""
) -> int:
    """Return ``value`` after checking it is an int in [low, high] (``high`` None: no upper bound; bool is
    not an int here).

    Raises:
        ValueError: ``"{owner} {name} must be an int >= {low}, got {value!r}; {fix}"``.
    """
    bad = isinstance(value, bool) or not isinstance(value, int) or value < low
    if not bad and high is not None and value > high:
        bad = True
    if bad:
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        who = f"{owner} {name}" if owner else name
        raise ValueError(f"{who} must be an int {span}, got {value!r}" + (f"; {fix}" if fix else ""))
    return value


def check_number(
    name: str, value: Any, low: float, high: float, *, open_high: bool, owner: str = ""
) -> float:
    """Return ``value`` as a float after checking it lies in [low, high) (``open_high``) or [low, high].

    Raises:
        ValueError: naming the owner, the argument and the value.
    """
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    ok = ok and low <= value and (value < high if open_high else value <= high)
    if not ok:
        span = f"[{low}, {high})" if open_high else f"[{low}, {high}]"
        who = f"{owner} {name}" if owner else name
        raise ValueError(f"{who} must be a number in {span}, got {value!r}")
    return float(value)
