"""The roofline (Williams et al., 2009): an op of intensity I FLOP/byte runs at most at
``min(peak_flops, bandwidth * I)``; below the ridge ``peak_flops / bandwidth`` it is memory-bound.

:func:`measure_roof` takes this machine's roof from the benchmark's own probes (the matmul rate of a
2048^3 matmul and the bandwidth of a sum over 512 MiB, :func:`multihead.bench_methods.machine_rates`);
:func:`plot_roofline` draws the roof and places each op of one or more :class:`~multihead.cost.Cost`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .estimate import Cost
    from .walk import Op

__all__ = ["Roof", "RooflinePoint", "measure_roof", "plot_roofline", "roofline"]


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
    from ..bench_methods import machine, machine_rates

    rates = machine_rates({str(dtype)})
    cpu = machine(rates)["cpu"]
    label = f"{cpu}, {torch.get_num_threads()} threads, {str(dtype).replace('torch.', '')} matmul"
    return Roof(rates[str(dtype)] * 1e9, rates["bandwidth"] * 1e9, label)


def plot_roofline(
    costs: Cost | Mapping[str, Cost], roof: Roof, path: str | Path, *, title: str | None = None
) -> Path:
    """Write a log-log roofline PNG: the roof (memory slope and compute ceiling) and every op with FLOPs
    of each cost as a point at (intensity, attainable GFLOP/s); matmuls filled, the rest hollow.

    Args:
        costs: one :class:`Cost` or several by label (e.g. {"decode B=1": ..., "decode B=64": ...}).
        roof: the machine's roof (:func:`measure_roof`, or a :class:`Roof` of a spec sheet).
        path: the PNG to write.

    Returns:
        ``path`` as a Path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {"": costs} if not isinstance(costs, Mapping) else dict(costs)
    ops = [(label, o) for label, c in series.items() for o in c.rows if o.flops > 0]
    lo = min([roof.ridge / 100, *(o.intensity for _, o in ops)]) / 2
    hi = max([roof.ridge * 100, *(o.intensity for _, o in ops)]) * 2
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = [lo, roof.ridge, hi]
    ax.plot(xs, [roof.attainable(x) / 1e9 for x in xs], color="black", lw=2, label="roof")
    ax.axvline(roof.ridge, color="grey", ls=":", lw=1)
    ax.annotate(
        f"ridge {roof.ridge:.1f} FLOP/B",
        (roof.ridge, roof.peak_flops / 1e9),
        fontsize=8,
        xytext=(4, -12),
        textcoords="offset points",
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, cost) in enumerate(series.items()):
        color = colors[i % len(colors)]
        clusters: dict[float, list[str]] = {}  # matmuls at about the same intensity share one label
        for o in cost.rows:
            if o.flops == 0:
                continue
            y = roof.attainable(o.intensity) / 1e9
            face = color if o.is_matmul else "none"
            ax.scatter(o.intensity, y, s=36, facecolors=face, edgecolors=color, zorder=3)
            if o.is_matmul:
                names = clusters.setdefault(round(3 * math.log10(o.intensity)) / 3, [])
                names.append(o.name.split(" =")[0])
        for key, names in clusters.items():
            x = 10**key
            ax.annotate(
                ", ".join(dict.fromkeys(names)),
                (x, roof.attainable(x) / 1e9),
                fontsize=6,
                color=color,
                xytext=(6, -4 - 8 * i),
                textcoords="offset points",
            )
        ax.scatter([], [], color=color, label=label or cost.model.name)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="arithmetic intensity (FLOP/byte)",
        ylabel="attainable GFLOP/s",
        xlim=(lo, hi),
    )
    ax.set_title(title or f"roofline: {roof.label or 'given roof'}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
