"""Masks and biases with their tensors on the device of the call, for kernels compiled from them.

Eager kernels evaluate a mask predicate or a bias on any device: the predicates move the tensors they
hold (document ids, padding lengths, ALiBi slopes, dense masks) to the device of the index grid they get.
A compiled kernel (``torch.compile`` of ``flex_attention``) cannot move data inside its generated code,
so the backends that compile take a copy with every held tensor already on the device of q.
"""

from __future__ import annotations

import copy
from typing import TypeVar

import torch
from torch import Tensor

from .biases import Bias
from .masks import Mask

__all__ = ["on_device"]

T = TypeVar("T")


def on_device(obj: T, device: torch.device | str) -> T:
    """A copy of ``obj`` (a :class:`Mask`, :class:`Bias` or tensor) whose tensors all live on ``device``.

    Combinations (``a & b``, ``~a``, bias chains) are copied part by part; the original is not changed.
    A tensor already on ``device`` is shared, not copied. Tensors captured inside a custom predicate's
    Python function are beyond reach: such a function should create them on the device it is called on.
    """
    if isinstance(obj, Tensor):
        return obj.to(device)  # type: ignore[return-value]
    if isinstance(obj, list | tuple):
        return type(obj)(on_device(x, device) for x in obj)
    if not isinstance(obj, Mask | Bias):
        return obj
    new = copy.copy(obj)
    for name, value in vars(obj).items():
        if isinstance(value, Tensor | Mask | Bias | list | tuple):
            setattr(new, name, on_device(value, device))
    return new
