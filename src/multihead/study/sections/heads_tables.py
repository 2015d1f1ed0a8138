"""The tables of the study's heads section: the layer x head grids (roles, importance), the heads per
role, the pruning rows and the MHA -> GQA rows, each from the rows :mod:`.heads` measures.

Shape legend: L layers, H heads per layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...heads.labels import ABBREV, HeadRole

if TYPE_CHECKING:  # study.py imports the section: import the context at call time
    from ..context import Table

__all__ = ["MEANING", "gqa_table", "grid_table", "pruning_table", "role_tables"]

#: What each role means (labels.py decides them; DOMINANT and BROAD are its thresholds).
MEANING = {
    "previous": "attends to the token before",
    "next": "attends to the token after",
    "self": "attends to itself",
    "[CLS]": "attends to [CLS]",
    "[SEP]": "attends to [SEP] (a no-op: Clark et al.)",
    "punctuation": "attends to punctuation",
    "broad": "spreads its attention (high entropy)",
    "mixed": "no single pattern (often the syntactic heads)",
}


def grid_table(title: str, cells: list[list[str]]) -> Table:
    """A layer x head grid (one row per layer)."""
    from ..context import Table

    H = len(cells[0])
    rows = [[str(layer), *row] for layer, row in enumerate(cells)]
    return Table(title, ["layer", *(f"h{h}" for h in range(H))], rows, align="r" * (H + 1))


def role_tables(table: list[HeadRole], n_texts: int) -> list[Table]:
    from ..context import Table

    L, H = 1 + max(r.layer for r in table), 1 + max(r.head for r in table)
    cells = [["" for _ in range(H)] for _ in range(L)]
    counts: dict[str, int] = {}
    for r in table:
        cells[r.layer][r.head] = ABBREV.get(r.role, r.role)
        counts[r.role] = counts.get(r.role, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    return [
        grid_table(f"role of each head ({n_texts} texts; Clark et al.'s statistics)", cells),
        Table(
            "heads per role",
            ["role", "heads", "meaning"],
            [[role, str(n), MEANING.get(role, "")] for role, n in ranked],
            align="lrl",
        ),
    ]


def pruning_table(rows: list[dict[str, Any]]) -> Table:
    from ..context import Table

    cells = [
        [
            str(r["removed"]),
            f"{r['fraction']:.2f}",
            r["order"],
            f"{r['mean_cos']:.4f}",
            f"{r['min_cos']:.4f}",
            f"{r['attention_params']:.2f}",
            " ".join(map(str, r["heads_left"])),
        ]
        for r in rows
    ]
    return Table(
        "pruning: heads removed least important first (random order for comparison), no retraining",
        [
            "heads removed",
            "fraction",
            "order",
            "mean cos",
            "min cos",
            "attention params",
            "heads left per layer",
        ],
        cells,
        align="rrlrrrl",
    )


def gqa_table(rows: list[dict[str, Any]]) -> Table:
    from ..context import Table

    cells = [
        [
            str(r["n_kv"]),
            r["method"],
            f"{r['mean_cos']:.4f}",
            f"{r['min_cos']:.4f}",
            f"{r['kv_bytes']:,}",
            f"{r['saved']:.0%}",
        ]
        for r in rows
    ]
    return Table(
        "MHA -> GQA: kv heads per layer, merged by mean or Procrustes-aligned mean (no retraining)",
        ["kv heads", "method", "mean cos", "min cos", "KV bytes/token (fp32)", "KV saved"],
        cells,
        align="rlrrrr",
    )
