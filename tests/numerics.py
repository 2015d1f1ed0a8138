"""The numerics rule of DESIGN.md, in one place (from the FlashAttention and PyTorch test suites).

Every backend is compared against ``reference`` in float64 ("gold"). For a dtype below float64, a
backend's max error against gold must be at most OUT_FACTOR (outputs) / GRAD_FACTOR (gradients) times the
error of the plain same-dtype ``matrix`` path against gold, with a floor of FLOOR. Fixed tolerances used
elsewhere in the tests live in TOL below - nowhere else.
"""

from __future__ import annotations

import torch

OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
FLOOR = 1e-5

# Fixed tolerances (atol) for comparisons that are not backend-vs-gold, by dtype.
TOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 2e-2,
    torch.float16: 2e-3,
}


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max absolute difference, computed in float64."""
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def allowed(baseline_err: float, *, grad: bool = False) -> float:
    """The error a backend may have, given the same-dtype ``matrix`` error against gold."""
    return max((GRAD_FACTOR if grad else OUT_FACTOR) * baseline_err, FLOOR)
