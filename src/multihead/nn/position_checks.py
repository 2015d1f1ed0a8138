"""The argument checks shared by the position modules (:mod:`multihead.nn.positions`,
:mod:`multihead.nn.rotary`): sizes, position tensors (N,) or (B, N), and positions inside a table.

Shape legend: B batch, N positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_in_table", "check_positions", "check_size"]


def check_size(name: str, value: object, minimum: int = 1) -> int:
    """``value`` when it is an int >= ``minimum``; anything else (a bool too) raises ValueError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_positions(positions: object, what: str) -> Tensor:
    """An integer tensor of shape (N,) or (B, N); anything else raises ValueError."""
    if not isinstance(positions, Tensor):
        raise ValueError(
            f"{what} positions must be an integer tensor of shape (N,) or (B, N), got "
            f"{type(positions).__name__}; build them with torch.arange(N)"
        )
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(
            f"{what} positions must be an integer tensor, got dtype {positions.dtype}; "
            "convert with positions.long()"
        )
    if positions.dim() not in (1, 2):
        raise ValueError(
            f"{what} positions must have shape (N,) or (B, N), got {positions.dim()} dims "
            f"{tuple(positions.shape)}"
        )
    return positions


def check_in_table(positions: Tensor, max_len: int, what: str) -> None:
    """Positions index a table of ``max_len`` rows: they must lie in [0, max_len)."""
    if positions.numel() == 0:
        return
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0:
        raise ValueError(f"{what} positions must be >= 0, got a minimum of {lo}; positions count from 0")
    if hi >= max_len:
        raise ValueError(
            f"{what} positions must be < max_len={max_len}, got a maximum of {hi}; "
            f"build the module with max_len >= {hi + 1}"
        )
