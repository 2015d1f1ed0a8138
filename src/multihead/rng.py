"""Seeded random draws that leave torch's global generator alone.

Building a model with a seed (``mh.pretrained.random_lm(seed=0)``) must give the same weights every
time, but a library that called ``torch.manual_seed`` would reset the generator its caller samples
from: every later ``torch.randn`` or ``generate(do_sample=True)`` of the host would repeat the same
numbers. :func:`private` instead routes every draw made inside its block (``nn.Linear``'s own
initialisation, ``nn.init.normal_``, ``torch.randn``, ``Tensor.uniform_``, ...) to a private
``torch.Generator`` seeded with the seed, through a torch function mode (a per-thread setting: other
threads keep drawing from the global generator meanwhile). The global generator is neither read nor
advanced, and the weights are the ones ``torch.manual_seed(seed)`` followed by the same code gives
(the private generator is the same algorithm, seeded alike).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["private"]

#: torch's functions and tensor methods that draw and take ``generator=``
_DRAWS: set[Callable[..., Any]] = {
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.normal,
    torch.bernoulli,
    torch.multinomial,
    torch.poisson,
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.random_,
    torch.Tensor.bernoulli_,
    torch.Tensor.bernoulli,
    torch.Tensor.multinomial,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
}
# nn.init's functions dispatch through the mode themselves (before reaching the tensor methods)
_DRAWS |= {
    f
    for name in dir(torch.nn.init)
    if callable(f := getattr(torch.nn.init, name))
    and not name.startswith("_")
    and inspect.isfunction(f)
    and "generator" in inspect.signature(f).parameters
}


class _PrivateDraws(TorchFunctionMode):
    """Gives every draw without a generator of its own the private one."""

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.generator = generator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _DRAWS and kwargs.get("generator") is None:
            kwargs["generator"] = self.generator
        return func(*args, **kwargs)


@contextlib.contextmanager
def private(seed: int) -> Iterator[torch.Generator]:
    """Run the block's random draws (on the CPU) from a private generator seeded with ``seed``; yields it.

    Raises:
        ValueError: a seed that is not an int >= 0.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    g = torch.Generator().manual_seed(seed)
    with _PrivateDraws(g):
        yield g
