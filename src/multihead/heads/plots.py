"""PNG pictures of heads (matplotlib, Agg): the layer x head grid of one text's maps, the role grid.

Shape legend: L layers, H heads, N tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from ..pretrained.files import atomic_write
from .labels import ABBREV, HeadRole

__all__ = ["plot_head", "plot_maps", "plot_roles"]

_COLORS = {
    "previous": "#4c72b0",
    "next": "#55a868",
    "self": "#8172b2",
    "[CLS]": "#c44e52",
    "[SEP]": "#dd8452",
    "punctuation": "#937860",
    "broad": "#cccccc",
    "mixed": "#ffffff",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_maps(
    maps: Tensor, path: str | Path, roles: Sequence[HeadRole] | None = None, title: str = ""
) -> Path:
    """Draw one input's (L, H, N, N) maps as an L x H grid of heatmaps (rows: layers) and save a PNG.

    Each panel is titled ``layer.head`` and, given ``roles``, the head's role.
    """
    plt = _pyplot()
    L, H = maps.shape[:2]
    fig, axes = plt.subplots(L, H, figsize=(1.3 * H, 1.4 * L), squeeze=False)
    role = {(r.layer, r.head): ABBREV.get(r.role, r.role) for r in roles or ()}
    for layer in range(L):
        for head in range(H):
            ax = axes[layer][head]
            ax.imshow(maps[layer, head].float().cpu().numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"{layer}.{head} {role.get((layer, head), '')}".strip(), fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out = Path(path)
    with atomic_write(out) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return out


def plot_head(attn: Tensor, tokens: Sequence[str], path: str | Path, title: str = "") -> Path:
    """Draw one head's (N, N) map with the tokens on both axes (queries down, keys across); save a PNG."""
    plt = _pyplot()
    n = attn.shape[-1]
    size = max(4.0, 0.28 * n)
    fig, ax = plt.subplots(figsize=(size, size))
    ax.imshow(attn.float().cpu().numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(n), list(tokens), rotation=90, fontsize=7)
    ax.set_yticks(range(n), list(tokens), fontsize=7)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    out = Path(path)
    with atomic_write(out) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return out


def plot_roles(roles: Sequence[HeadRole], path: str | Path, title: str = "") -> Path:
    """Draw the layer x head role table: one coloured cell per head with its role and score; save a PNG."""
    plt = _pyplot()
    L = 1 + max(r.layer for r in roles)
    H = 1 + max(r.head for r in roles)
    fig, ax = plt.subplots(figsize=(0.9 * H + 1.5, 0.6 * L + 1.2))
    for r in roles:
        ax.add_patch(plt.Rectangle((r.head, r.layer), 1, 1, color=_COLORS.get(r.role, "#ffffff"), ec="k"))
        label = f"{ABBREV.get(r.role, r.role)}\n{r.score:.2f}"
        ax.text(r.head + 0.5, r.layer + 0.5, label, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, H)
    ax.set_ylim(L, 0)
    ax.set_xticks([h + 0.5 for h in range(H)], [str(h) for h in range(H)])
    ax.set_yticks([layer + 0.5 for layer in range(L)], [str(layer) for layer in range(L)])
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title or "head roles (score: the role's weight; broadness for broad / mixed)", fontsize=9)
    fig.tight_layout()
    out = Path(path)
    with atomic_write(out) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return out
