"""The figures of the study's designs section: one marker and colour per head design, the same in every
plot (:func:`design_style`), points that share an x spread sideways (:func:`dodge`), and the two plots:
MQAR's held-out error against parameters (:func:`mqar_plot`), the language model's bits per byte against
KV-cache bytes per token (:func:`text_plot`). matplotlib is imported at call time.
"""

from __future__ import annotations

from typing import Any

from ...train.trainer import TrainConfig
from ...variants import NAMES

__all__ = ["MARKERS", "design_style", "dodge", "error_floor", "mqar_plot", "place", "text_plot"]


#: one marker and one colour per design (15 x 20 distinct pairs; the index is the design's place in a plot)
MARKERS = "os^vDPX*<>phH8d"


def design_style(i: int) -> tuple[str, str]:
    """(marker, colour) of the i-th design: no two of the first 15 designs share either."""
    import matplotlib

    colour = matplotlib.colormaps["tab20"](i % 20)
    return MARKERS[i % len(MARKERS)], matplotlib.colors.to_hex(colour)


def place(design: str, i: int) -> int:
    """A design's index in :data:`~multihead.variants.NAMES` (the designs trained, in table order: it
    looks the same in every plot), else ``i``."""
    return NAMES.index(design) if design in NAMES else i


def dodge(xs: list[float], spread: float = 0.07) -> list[float]:
    """Spread points that share an x sideways on a log axis (factor ``2**spread`` apart), centred on
    the shared x, so that no point hides another; a point alone keeps its x."""
    out = list(xs)
    for x in set(xs):
        same = [i for i, v in enumerate(xs) if v == x]
        for j, i in enumerate(same):
            out[i] = x * 2 ** (spread * (j - (len(same) - 1) / 2))
    return out


def text_plot(rows: list[dict[str, Any]], ax: Any) -> None:
    """Held-out bits/byte against KV-cache bytes per token, one point per design; designs with the same
    KV bytes are spread sideways (:func:`dodge`)."""
    xs = dodge([r["kv_bytes_per_token"] for r in rows])
    for i, (r, x) in enumerate(zip(rows, xs)):
        marker, colour = design_style(place(r["design"], i))
        label = f"{r['design']} ({r['bits_per_byte']:.2f})"
        ax.scatter(x, r["bits_per_byte"], s=40, marker=marker, color=colour, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("KV-cache bytes per token (all layers, log scale)")
    ax.set_ylabel("held-out bits per byte (lower is better)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))


def error_floor(cfg: TrainConfig) -> float:
    """Where the log axis draws an error of 0: half of one queried key's share of the eval, in percent."""
    return 50 / (cfg.eval_examples * cfg.n_pairs)


def mqar_plot(rows: list[dict[str, Any]], cfg: TrainConfig, ax: Any) -> None:
    """Held-out error (log scale, lower is better) against parameters: one point and legend entry per
    design; an error of 0 is drawn at half of one example's share, the smallest error the eval could see."""
    floor = error_floor(cfg)
    xs = dodge([r["params"] for r in rows])
    for i, (r, x) in enumerate(zip(rows, xs)):
        err = max(100 * (1 - r["accuracy"]), floor)
        marker, colour = design_style(place(r["design"], i))
        label = f"{r['design']} ({100 * r['accuracy']:.1f}%)"
        ax.scatter(x, err, s=40, marker=marker, color=colour, label=label)
    chance = 100 * (1 - 1 / cfg.n_pairs)
    ax.axhline(chance, color="grey", linestyle=":", label=f"a random one of the {cfg.n_pairs} values")
    ax.axhline(floor, color="grey", linestyle="--", linewidth=0.8, label=f"error 0 drawn here ({floor:.4g}%)")
    ax.set_yscale("log")
    ax.set_xlabel("parameters (whole model)")
    ax.set_ylabel("held-out error (%), log scale")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
