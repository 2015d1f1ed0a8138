"""What each head does, measured: the statistics of Clark et al. (2019), "What Does BERT Look At?".

For every head the attention of each query token (every row of every map) is summarised, then averaged
over all rows of all inputs:

    to_prev / to_next / to_self   weight on the token at offset -1 / +1 / 0
    to_cls / to_sep / to_punct    weight on [CLS] / [SEP] / punctuation tokens (Clark et al., §3-4)
    entropy                       -sum_j a_j log a_j in nats (Clark et al., §5, "broad attention")
    broadness                     mean entropy / mean log(keys a row sees): 1 = uniform, 0 = one key
    offset, distance              E[j - i] and E|j - i| under the row's weights: where, and how far

A head gets the role of its largest targeted weight when that weight reaches :data:`DOMINANT` (half of
its attention, as Clark et al.'s "heads that put over half their attention on..."); otherwise "broad"
when its broadness reaches :data:`BROAD`, else "mixed" (no single pattern: often the syntactic heads).

Shape legend: L layers, H heads, N tokens.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

__all__ = ["BROAD", "DOMINANT", "HeadRole", "roles", "roles_grid", "roles_table"]

#: A targeted weight (previous, next, self, [CLS], [SEP], punctuation) at least this names the role.
DOMINANT = 0.5
#: Otherwise a head whose broadness (entropy / log of the keys seen) reaches this is "broad".
BROAD = 0.7
CLS_TOKENS = frozenset({"[CLS]", "<s>", "<|begin_of_text|>"})
SEP_TOKENS = frozenset({"[SEP]", "</s>", "<|endoftext|>", "<|end_of_text|>"})
_PUNCT = frozenset(string.punctuation)
#: Short names of the roles for the layer x head grid.
ABBREV = {
    "previous": "prev",
    "next": "next",
    "self": "self",
    "[CLS]": "CLS",
    "[SEP]": "SEP",
    "punctuation": "punc",
    "broad": "broad",
    "mixed": "mix",
}


@dataclass(frozen=True)
class HeadRole:
    """One head's measured behaviour (weights are mean fractions of a query row's attention)."""

    layer: int
    head: int
    role: str  # previous | next | self | [CLS] | [SEP] | punctuation | broad | mixed
    score: float  # the statistic that named the role (its weight, or broadness for broad / mixed)
    entropy: float
    broadness: float
    offset: float
    distance: float
    to_prev: float
    to_next: float
    to_self: float
    to_cls: float
    to_sep: float
    to_punct: float

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def _is_punct(tok: str) -> bool:
    core = tok.removeprefix("##").lstrip("Ġ▁")
    return bool(core) and all(c in _PUNCT for c in core)


def _token_masks(tokens: Sequence[str] | None, N: int) -> tuple[Tensor, Tensor, Tensor]:
    """Boolean (N,) masks of the [CLS], [SEP] and punctuation tokens (all False without tokens)."""
    if tokens is None:
        none = torch.zeros(N, dtype=torch.bool)
        return none, none, none
    if len(tokens) != N:
        raise ValueError(
            f"tokens has {len(tokens)} entries for a map of {N} tokens; pass each input's tokens"
        )
    cls = torch.tensor([t in CLS_TOKENS for t in tokens])
    sep = torch.tensor([t in SEP_TOKENS for t in tokens])
    punct = torch.tensor([_is_punct(t) and not (t in CLS_TOKENS or t in SEP_TOKENS) for t in tokens])
    return cls, sep, punct


def _row_sums(a: Tensor, tokens: Sequence[str] | None) -> dict[str, Tensor]:
    """Per-head sums over the query rows of one map ``a`` (L, H, N, N): each statistic -> (L, H)."""
    N = a.shape[-1]
    a = a.double().cpu()
    idx = torch.arange(N, dtype=torch.float64)
    rel = idx[None, :] - idx[:, None]  # (N, N): j - i
    cls, sep, punct = _token_masks(tokens, N)
    causal = bool((a.triu(1) == 0).all())
    keys = idx + 1 if causal else torch.full((N,), float(N), dtype=torch.float64)  # keys row i sees
    return {
        "to_self": a.diagonal(dim1=-2, dim2=-1).sum(-1),
        "to_prev": a.diagonal(offset=-1, dim1=-2, dim2=-1).sum(-1),
        "to_next": a.diagonal(offset=1, dim1=-2, dim2=-1).sum(-1),
        "to_cls": a[..., cls].sum((-1, -2)),
        "to_sep": a[..., sep].sum((-1, -2)),
        "to_punct": a[..., punct].sum((-1, -2)),
        "entropy": -torch.special.xlogy(a, a).sum((-1, -2)),
        "offset": (a * rel).sum((-1, -2)),
        "distance": (a * rel.abs()).sum((-1, -2)),
        "log_keys": keys.log().sum().expand(a.shape[:2]),
    }


def _label(stats: dict[str, float]) -> tuple[str, float]:
    targets = {
        "previous": stats["to_prev"],
        "next": stats["to_next"],
        "self": stats["to_self"],
        "[CLS]": stats["to_cls"],
        "[SEP]": stats["to_sep"],
        "punctuation": stats["to_punct"],
    }
    best = max(targets, key=lambda k: targets[k])
    if targets[best] >= DOMINANT:
        return best, targets[best]
    return ("broad" if stats["broadness"] >= BROAD else "mixed"), stats["broadness"]


def roles(maps: Sequence[Tensor], tokens: Sequence[Sequence[str]] | None = None) -> list[HeadRole]:
    """Label every head by what it measurably attends to, with Clark et al.'s statistics.

    Args:
        maps: per input a (L, H, N_i, N_i) attention map (from :func:`attention_maps`).
        tokens: per input its N_i token strings (from :func:`token_strings`), for the [CLS] / [SEP] /
            punctuation statistics; None leaves those at 0 (positional roles, broad and mixed only).

    Returns:
        L * H :class:`HeadRole` rows ordered by layer, then head; every statistic is the mean over all
        query rows of all inputs.

    Raises:
        ValueError: no maps, maps that are not 4-D or differ in L or H, tokens of the wrong count or length.
    """
    if len(maps) == 0:
        raise ValueError("maps is empty; pass the list that attention_maps returns")
    if tokens is not None and len(tokens) != len(maps):
        raise ValueError(f"tokens has {len(tokens)} entries for {len(maps)} maps; give one list per input")
    shape = maps[0].shape[:2]
    totals: dict[str, Tensor] = {}
    rows = 0
    for i, a in enumerate(maps):
        if a.dim() != 4 or a.shape[:2] != shape or a.shape[-1] != a.shape[-2]:
            raise ValueError(
                f"map {i} has shape {tuple(a.shape)}; every map must be (L, H, N, N) with "
                f"(L, H) = {tuple(shape)}"
            )
        for k, v in _row_sums(a, None if tokens is None else tokens[i]).items():
            totals[k] = totals[k] + v if k in totals else v
        rows += a.shape[-1]
    means = {k: v / rows for k, v in totals.items()}  # (L, H) each
    log_keys = means.pop("log_keys")
    means["broadness"] = torch.where(log_keys > 0, means["entropy"] / log_keys.clamp(min=1e-12), 0.0)
    out = []
    for layer in range(shape[0]):
        for head in range(shape[1]):
            stats = {k: float(v[layer, head]) for k, v in means.items()}
            role, score = _label(stats)
            out.append(HeadRole(layer, head, role, score, **stats))
    return out


def roles_table(rows: Sequence[HeadRole]) -> str:
    """A markdown table of the roles, one line per head."""
    cols = ["to_prev", "to_next", "to_self", "to_cls", "to_sep", "to_punct"]
    lines = [
        "| layer | head | role | score | entropy (nats) | broadness | offset | distance | "
        + " | ".join(c.removeprefix("to_") for c in cols)
        + " |",
        "|" + "---:|" * 2 + ":---|" + "---:|" * (5 + len(cols)),
    ]
    for r in rows:
        vals = [r.score, r.entropy, r.broadness, r.offset, r.distance, *(getattr(r, c) for c in cols)]
        lines.append(f"| {r.layer} | {r.head} | {r.role} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    return "\n".join(lines)


def roles_grid(rows: Sequence[HeadRole]) -> str:
    """A markdown layer x head grid of the role names, with a count of each role below."""
    L = 1 + max(r.layer for r in rows)
    H = 1 + max(r.head for r in rows)
    grid = [["" for _ in range(H)] for _ in range(L)]
    for r in rows:
        grid[r.layer][r.head] = ABBREV.get(r.role, r.role)
    lines = ["| layer | " + " | ".join(f"h{h}" for h in range(H)) + " |", "|---" * (H + 1) + "|"]
    lines += [f"| {layer} | " + " | ".join(grid[layer]) + " |" for layer in range(L)]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.role] = counts.get(r.role, 0) + 1
    lines.append("")
    lines.append(", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)
