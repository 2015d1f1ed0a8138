"""Drawing a roofline: the roof of a machine and the ops of one or more cost estimates on it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from ..pretrained.files import atomic_write
from .estimate import Cost
from .roofline import Roof

__all__ = ["plot_roofline"]


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
    with atomic_write(out) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return out
