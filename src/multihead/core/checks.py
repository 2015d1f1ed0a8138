"""Argument checks shared by the public boundary: each raises a ValueError that names the argument, the
value and, where one helps, the fix."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["MAX_INDEX", "as_int_tensor", "check_int", "check_number", "check_size"]

#: The largest size or position a mask, a bias or a generation length may name: positions are int64
#: tensors on every device, and the sum of two of them (an offset plus a position) must not overflow.
MAX_INDEX = 2**62


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


def check_size(name: str, value: Any, low: int, *, owner: str = "", fix: str = "") -> int:
    """:func:`check_int` with the upper bound :data:`MAX_INDEX` (a size or position that int64 index
    tensors can hold, with room for an offset).

    Raises:
        ValueError: naming the argument and the value; ``"... must be at most 2**62 ..."`` when too large.
    """
    check_int(name, value, low, owner=owner, fix=fix)
    if value > MAX_INDEX:
        who = f"{owner} {name}" if owner else name
        raise ValueError(
            f"{who} must be at most 2**62 = {MAX_INDEX} (positions are int64), got {value!r}"
            + (f"; {fix}" if fix else "")
        )
    return value


def as_int_tensor(name: str, value: Any, *, owner: str = "") -> Tensor:
    """``torch.as_tensor(value)`` for an argument that must hold integers; a list with ints too large
    for int64, ragged lists or non-numbers give a ValueError instead of torch's OverflowError /
    RuntimeError / TypeError. The dtype is the caller's to check.

    Raises:
        ValueError: naming the argument and what torch could not convert.
    """
    try:
        return torch.as_tensor(value)
    except (OverflowError, RuntimeError, TypeError, ValueError) as e:
        who = f"{owner} {name}" if owner else name
        raise ValueError(
            f"{who} must be a tensor or a list of ints that fit in int64 (|x| < 2**63), got a "
            f"{type(value).__name__} torch cannot convert: {e}"
        ) from None
