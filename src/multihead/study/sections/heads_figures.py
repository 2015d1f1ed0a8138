"""The figures of the study's heads section: the role grid and one text's attention maps
(:mod:`multihead.heads.plots`), the MHA -> GQA and pruning curves, and the surgery's KV bytes against
human-judged score (:func:`multihead.study.sections.surgery.plot_surgery`).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...cli.heads import DEFAULT_TEXT
from ...heads import plots
from ...heads.labels import HeadRole
from . import surgery

if TYPE_CHECKING:  # study.py imports the section: import the context at call time
    from ..context import StudyContext
    from ..figures import Figure

__all__ = ["plot_gqa", "plot_pruning", "section_figures"]


def plot_gqa(rows: list[dict[str, Any]], ax: Any) -> None:
    for i, method in enumerate(("mean", "aligned")):
        pts = [(r["n_kv"], r["mean_cos"], r["min_cos"]) for r in rows if r["method"] == method]
        ks = [p[0] for p in pts]
        ax.plot(ks, [p[1] for p in pts], "o-", color=f"C{i}", label=f"{method}: mean cos")
        ax.plot(ks, [p[2] for p in pts], "v:", color=f"C{i}", alpha=0.6, label=f"{method}: min cos")
    ax.set_xscale("log", base=2)
    ks = sorted({r["n_kv"] for r in rows})
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("kv heads per layer (12 = the original MHA)")
    ax.set_ylabel("cosine with the original embedding")
    ax.legend(fontsize=7)


def plot_pruning(rows: list[dict[str, Any]], ax: Any) -> None:
    for i, order in enumerate(("importance", "random")):
        pts = [
            (r["fraction"], r["mean_cos"], r["min_cos"])
            for r in rows
            if r["order"] == order or not r["removed"]
        ]
        fracs = [p[0] for p in pts]
        ax.plot(fracs, [p[1] for p in pts], "o-", color=f"C{i}", label=f"{order} order: mean cos")
        ax.plot(fracs, [p[2] for p in pts], "v:", color=f"C{i}", alpha=0.6, label=f"{order} order: min cos")
    ax.set_xlabel("fraction of the 72 heads removed")
    ax.set_ylabel("cosine with the original embedding")
    ax.legend(fontsize=7)


def section_figures(
    ctx: StudyContext,
    maps: torch.Tensor,
    table: list[HeadRole],
    pruning: list[dict],
    gqa: list[dict],
    surgery_rows: list[dict],
) -> list[Figure]:
    """The role grid and one text's maps (heads.plots), the GQA and pruning curves and the surgery's KV
    bytes vs human-judged score (ctx.figure)."""
    from ..figures import Figure

    if ctx.out_dir is None:
        return []
    out = Path(ctx.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    roles_png = plots.plot_roles(table, out / "heads-roles.png")
    maps_png = plots.plot_maps(maps, out / "heads-maps.png", table, title=DEFAULT_TEXT)
    return [
        Figure(roles_png.name, "Role of each of the 72 heads and the statistic that named it."),
        Figure(
            maps_png.name, f"Attention maps of every head (rows: layers, columns: heads) of “{DEFAULT_TEXT}”"
        ),
        *ctx.figure(
            "heads-gqa",
            "MHA -> GQA without retraining: embedding cosine vs kv heads per layer, mean vs aligned merge.",
            partial(plot_gqa, gqa),
        ),
        *ctx.figure(
            "heads-pruning",
            "Pruning: embedding cosine vs fraction of heads removed, by importance vs in random order.",
            partial(plot_pruning, pruning),
        ),
        *(
            ctx.figure(
                "heads-surgery",
                "Head surgery: lowest % of the original's human-judged score vs KV bytes per token; hollow "
                "markers before recovery, arrows to filled markers after it.",
                partial(surgery.plot_surgery, surgery_rows),
            )
            if surgery_rows
            else []
        ),
    ]
