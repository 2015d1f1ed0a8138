"""The roofline (Williams et al., 2009): an op of intensity I FLOP/byte runs at most at
``min(peak_flops, bandwidth * I)``; below the ridge ``peak_flops / bandwidth`` it is memory-bound.

:func:`measure_roof` takes this machine's roof from the benchmark's own probes (the matmul rate of a
2048^3 matmul and the bandwidth of a sum over 512 MiB, :func:`multihead.cost.machine.machine_rates`);
:func:`multihead.cost.plot_roofline` (in ``plot.py``) draws the roof and the ops of a cost estimate.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .walk import Op

__all__ = ["Roof", "RooflinePoint", "measure_roof", "roofline"]


@dataclass(frozen=True)
class Roof:
    """A machine's roof: ``peak_flops`` FLOP/s and ``bandwidth`` bytes/s.

    Raises:
        ValueError: a rate that is not positive.
    """

    peak_flops: float
    bandwidth: float
    label: str = ""

    def __post_init__(self) -> None:
        for name in ("peak_flops", "bandwidth"):
            val = getattr(self, name)
            if not isinstance(val, (int, float)) or not val > 0:
                raise ValueError(f"{name} must be a positive rate, got {val!r}; e.g. Roof(1e11, 2e10)")

    @property
    def ridge(self) -> float:
        """The intensity (FLOP/byte) where the memory slope meets the compute roof."""
        return self.peak_flops / self.bandwidth

    def attainable(self, intensity: float) -> float:
        """The highest FLOP/s an op of this intensity can reach."""
        return min(self.peak_flops, self.bandwidth * intensity)

    def bound(self, intensity: float) -> str:
        return "compute" if intensity >= self.ridge else "memory"


@dataclass(frozen=True)
class RooflinePoint:
    """One op on the roofline; ``flops``, ``bytes`` and ``seconds`` cover all ``count`` runs."""

    name: str
    part: str
    count: int
    flops: int
    bytes: int
    intensity: float
    attainable: float  # FLOP/s
    bound: str  # "memory" | "compute"
    seconds: float  # the roofline's lower bound on the op's time: max(flops / peak, bytes / bandwidth)

    def as_dict(self) -> dict:
        return asdict(self)


def roofline(ops: Iterable[Op], roof: Roof) -> list[RooflinePoint]:
    """Place every op under ``roof``: its attainable rate, which roof bounds it, its time."""
    points = []
    for o in ops:
        flops, nbytes = o.flops * o.count, o.bytes * o.count
        seconds = max(flops / roof.peak_flops, nbytes / roof.bandwidth)
        points.append(
            RooflinePoint(
                o.name,
                o.part,
                o.count,
                flops,
                nbytes,
                o.intensity,
                roof.attainable(o.intensity),
                roof.bound(o.intensity),
                seconds,
            )
        )
    return points


def measure_roof(dtype: torch.dtype = torch.float32) -> Roof:
    """This machine's roof, measured now with ``multihead bench``'s probes (a few seconds on a CPU).

    Args:
        dtype: the matmul's dtype (the bandwidth probe is dtype-free).
    """
    from .machine import machine, machine_rates

    rates = machine_rates({str(dtype)})
    cpu = machine(rates)["cpu"]
    label = f"{cpu}, {torch.get_num_threads()} threads, {str(dtype).replace('torch.', '')} matmul"
    return Roof(rates[str(dtype)] * 1e9, rates["bandwidth"] * 1e9, label)
