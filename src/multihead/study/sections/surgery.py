"""The heads section's surgery part: KV-cache bytes per token against human-judged quality.

all-MiniLM-L6-v2 changed three ways, each at two sizes, and scored by :func:`multihead.eval.human_judged`
(Lee Pearson, WordSim-353 Spearman, polarity probe accuracy) before and after a short
:func:`multihead.heads.recover` (distillation of the original into the changed copy):

    GQA       ``to_gqa(model, K, "aligned")``: every layer's 12 kv heads merged into K (Procrustes-aligned)
    MLA       ``to_mla(model, r)``: keys and values rebuilt from one latent of r numbers (calibrated on
              to_mla's default 256 docstrings in :data:`FULL`, on the study's calibration texts in QUICK)
    pruning   a fraction of the 72 heads removed least important first (``prune``; Michel et al.'s scores)

The sizes fix the work: :data:`QUICK` (the study's default run: a few recovery steps of short batches, for
each method's smallest KV cache only; most of its time is the 10 human-judged scorings) and :data:`FULL`
(tens of steps of full batches for every variant, minutes). Recovery runs a fixed number of optimizer
steps with a fixed seed, so a run repeats. The score of a changed model is read as the lowest over the
three sets of its ratio to the original's score ("lowest % of original").

Shape legend: L layers, H heads per layer.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...eval import SETS, data_dir, human_judged
from ...heads.access import layers_of
from ...heads.gqa import kv_cache_bytes_per_token, to_gqa
from ...heads.mla import to_mla
from ...heads.pruning import prune
from ...heads.recover import recover

if TYPE_CHECKING:
    from ...pretrained import SentenceEncoder
    from ..context import Table

__all__ = [
    "FULL",
    "QUICK",
    "SurgerySizes",
    "equal_bytes_pairs",
    "eval_unavailable",
    "plot_surgery",
    "recovery_effect",
    "surgery_notes",
    "surgery_rows",
    "surgery_table",
]

#: The human-judged sets, in table order.
METRICS = tuple(SETS)


@dataclass(frozen=True)
class SurgerySizes:
    """Which variants are built and how long each is recovered."""

    n_kv: tuple[int, ...]  # GQA: kv heads per layer after the aligned merge
    ranks: tuple[int, ...]  # MLA: latent width r per token and layer
    fractions: tuple[float, ...]  # pruning: of the L * H heads, least important first
    recover_steps: int  # optimizer steps of recover per recovered variant; 0: no recovery
    recover_smallest: bool  # recover only each method's smallest KV cache (True) or every variant
    recover_texts: int  # docstrings recover draws its batches from
    batch_size: int
    max_tokens: int
    lr: float | None  # None: recover's default (2e-5 for an encoder)
    seed: int = 0  # recover's split and batch order
    holdout: int = 64  # recover's held-out inputs (its default)
    mla_calibration: str = "auto"  # "auto": to_mla's default (256 docstrings); "given": the calibration texts
    bootstrap: int = 200  # resamples of each score's 95% interval


# recover as a user calls it (mixed lengths, its lr and schedule, the held-out stop); the quick run holds
# out fewer inputs so that its few steps are not spent on checks, and calibrates MLA on the study's own
# calibration texts instead of to_mla's 256 docstrings (seconds of the default run); FULL uses the defaults
QUICK = SurgerySizes(
    (6, 2), (256, 128), (1 / 6, 1 / 3), 6, True, 96, 8, 64, None, holdout=16, mla_calibration="given"
)
FULL = SurgerySizes((6, 2), (256, 128), (1 / 6, 1 / 3), 30, False, 600, 16, 128, None)


def eval_unavailable() -> str | None:
    """Why the human-judged sets cannot be read (gensim, the ``eval`` extra, missing or trimmed), or None."""
    try:
        data_dir()
    except (ImportError, ValueError) as e:
        return str(e)
    return None


# -- measurements --------------------------------------------------------------------------------------
def _fraction_label(fraction: float) -> str:
    for den in range(1, 13):
        num = round(fraction * den)
        if num and abs(num / den - fraction) < 1e-9:
            return f"{num}/{den}"
    return f"{fraction:.2f}"


def _variants(
    model: SentenceEncoder, scores: torch.Tensor, calibration: list[str], sizes: SurgerySizes
) -> Iterator[tuple[str, str, str, Callable[[], torch.nn.Module], bool]]:
    """(name, method, size, build, recover it) per variant; each build returns a changed copy (the model is
    kept). With ``recover_smallest`` only each method's smallest KV cache is recovered."""

    def recovered(smallest: bool) -> bool:
        return bool(sizes.recover_steps) and (smallest or not sizes.recover_smallest)

    for k in sizes.n_kv:

        def merged(k: int = k) -> torch.nn.Module:
            return to_gqa(copy.deepcopy(model), k, "aligned", calibration=calibration)

        yield f"GQA-{k} aligned", "GQA", f"{k} kv", merged, recovered(k == min(sizes.n_kv))
    for r in sizes.ranks:

        def latent(r: int = r) -> torch.nn.Module:
            return to_mla(model, r, calibration="auto" if sizes.mla_calibration == "auto" else calibration)

        yield f"MLA r={r} calibrated", "MLA", f"r={r}", latent, recovered(r == min(sizes.ranks))
    L, H = scores.shape
    ascending = [divmod(int(i), H) for i in scores.flatten().argsort()]  # (layer, head), least important 1st
    for fraction in sizes.fractions:

        def pruned(n: int = round(fraction * L * H)) -> torch.nn.Module:
            drop: dict[int, list[int]] = {}
            for layer, head in ascending[:n]:
                drop.setdefault(layer, []).append(head)
            return prune(copy.deepcopy(model), drop)

        label, last = _fraction_label(fraction), fraction == max(sizes.fractions)
        yield f"pruned {label} by importance", "pruning", f"-{label}", pruned, recovered(last)


def _row(
    name: str, method: str, size: str, stage: str, model: Any, base: dict[str, float] | None, bootstrap: int,
    **extra: Any,
) -> dict[str, Any]:  # fmt: skip
    """One row: the model's human-judged scores with their bootstrap 95% intervals (``<set>_ci``, None
    without resamples), their lowest ratio to ``base`` (%) and its KV bytes."""
    got = human_judged(model, bootstrap=bootstrap)
    scores = {m: float(got[m]["score"]) for m in METRICS}
    intervals = {
        f"{m}_ci": None if got[m]["low"] is None else (got[m]["low"], got[m]["high"]) for m in METRICS
    }
    ref = scores if base is None else base
    lowest = min(100.0 * scores[m] / ref[m] for m in METRICS)
    return {
        "model": name,
        "method": method,
        "size": size,
        "stage": stage,
        "kv_bytes": kv_cache_bytes_per_token(model, torch.float32),
        **scores,
        **intervals,
        "lowest_pct": lowest,
        "recover_steps": 0,
        **extra,
    }


def surgery_rows(
    model: SentenceEncoder,
    scores: torch.Tensor,
    calibration: list[str],
    texts: list[str],
    sizes: SurgerySizes,
    step: Callable[[str, float], None] = lambda what, done: None,
) -> list[dict[str, Any]]:
    """The original, then per variant a "before" row and (with recovery steps) an "after" row.

    Args:
        model: all-MiniLM-L6-v2 (not changed).
        scores: (L, H) head importance; pruning removes the lowest first.
        calibration: texts for the aligned GQA merge (and for MLA with ``mla_calibration="given"``; by
            default MLA takes to_mla's own calibration).
        texts: recover's training texts (disjoint from ``calibration``).
        sizes: the variants and the recovery budget (see :class:`SurgerySizes`).
        step: ``step(what, done)``, done the fraction of this part finished.

    Returns:
        rows with model, method, size, stage ("original" / "before" / "after"), kv_bytes (fp32, every layer),
        one score per set of :data:`multihead.eval.SETS`, lowest_pct (the lowest ratio to the original's
        score, in %), recover_steps and recover_s.

    Raises:
        ImportError: gensim (the human-judged data) is missing; check :func:`eval_unavailable` first.
    """
    step("human-judged scores of the original", 0.0)
    kv_heads = getattr(layers_of(model)[0].self_attn, "n_kv_heads", 0)
    rows = [_row("original MiniLM", "original", f"{kv_heads} kv", "original", model, None, sizes.bootstrap)]
    base = {m: rows[0][m] for m in METRICS}
    variants = list(_variants(model, scores, calibration, sizes))
    for i, (name, method, size, build, recovered) in enumerate(variants):
        step(f"{name}: convert and score", i / len(variants))
        student = build()
        rows.append(_row(name, method, size, "before", student, base, sizes.bootstrap))
        if recovered:
            step(f"{name}: recover {sizes.recover_steps} steps", (i + 0.4) / len(variants))
            start = time.perf_counter()
            recover(  # the library's recipe: mixed lengths, its lr and schedule, the held-out stop
                student, model, texts, steps=sizes.recover_steps, lr=sizes.lr, batch_size=sizes.batch_size,
                max_tokens=sizes.max_tokens, seed=sizes.seed, holdout=sizes.holdout, progress=False,
            )  # fmt: skip
            secs = time.perf_counter() - start
            after = f"{name} + recover"
            extra = {"recover_steps": sizes.recover_steps, "recover_s": secs}
            rows.append(_row(after, method, size, "after", student, base, sizes.bootstrap, **extra))
        del student
    step("done", 1.0)
    return rows


def equal_bytes_pairs(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(MLA row, GQA row) pairs of the same stage and the same KV bytes per token, latest stage first."""
    order = {"after": 0, "before": 1}
    mla = [r for r in rows if r["method"] == "MLA"]
    gqa = [r for r in rows if r["method"] == "GQA"]
    pairs = [(m, g) for m in mla for g in gqa if m["stage"] == g["stage"] and m["kv_bytes"] == g["kv_bytes"]]
    return sorted(pairs, key=lambda p: (order.get(p[0]["stage"], 2), p[0]["kv_bytes"]))


def _shown(row: dict[str, Any]) -> tuple[str, ...]:
    """A row's scores as the table prints them (3 decimals a set, the lowest % to 1 decimal)."""
    return (*(f"{row[m]:.3f}" for m in METRICS if m in row), f"{row['lowest_pct']:.1f}")


def recovery_effect(rows: list[dict[str, Any]], after: dict[str, Any]) -> tuple[bool, str]:
    """What recovery did to a variant, as the table shows it: (whether any printed score moved, a
    phrase). The notes and the key finding both say it from here, so neither credits a recovery that
    moved nothing the table prints.
    """
    name = after["model"].removesuffix(" + recover")
    before = next((r for r in rows if r["model"] == name and r["stage"] == "before"), None)
    steps = f"{after['recover_steps']} recovery steps"
    if before is None:
        return True, f"after {steps}"
    if _shown(before) == _shown(after):
        return (
            False,
            f"{steps} changed no score the table shows ({after['lowest_pct']:.1f}% before and after)",
        )
    return True, f"after {steps} (lowest {before['lowest_pct']:.1f}% before them)"


# -- the table, the figure, the notes --------------------------------------------------------------------
def _with_interval(row: dict[str, Any], metric: str) -> str:
    """'0.656 [0.612, 0.695]': a score and its bootstrap 95% interval (the score alone without one)."""
    ci = row.get(f"{metric}_ci")
    return f"{row[metric]:.3f}" if ci is None else f"{row[metric]:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def surgery_table(rows: list[dict[str, Any]]) -> Table:
    from ..context import Table

    cells = [
        [
            r["model"],
            f"{r['kv_bytes']:,}",
            *(_with_interval(r, m) for m in METRICS),
            f"{r['lowest_pct']:.1f}%",
            r["stage"] if r["stage"] != "original" else "-",
            str(r["recover_steps"]),
        ]
        for r in rows
    ]
    return Table(
        "head surgery vs human-judged quality: KV bytes per token (fp32, all layers) and scores [bootstrap "
        "95% interval], before and after recovery (distillation from the original)",
        [
            "model",
            "KV bytes/token",
            "Lee r",
            "WordSim rho",
            "polarity acc",
            "lowest % of original",
            "recovery",
            "recovery steps",
        ],
        cells,
        align="lrrrrrlr",
    )


_STYLE = {"original": ("k", "*"), "GQA": ("C0", "o"), "MLA": ("C1", "s"), "pruning": ("C2", "^")}


def plot_surgery(rows: list[dict[str, Any]], ax: Any) -> None:
    """Lowest % of the original's score vs KV bytes per token (log x); an arrow from before to after."""
    for method, (color, marker) in _STYLE.items():
        mine = [r for r in rows if r["method"] == method]
        before = [r for r in mine if r["stage"] in ("before", "original")]
        after = [r for r in mine if r["stage"] == "after"]
        ax.scatter(
            [r["kv_bytes"] for r in before], [r["lowest_pct"] for r in before], marker=marker, s=46,
            facecolors="none" if method != "original" else color, edgecolors=color,
            label=method if method == "original" else f"{method}, before recovery",
        )  # fmt: skip
        if after:
            ax.scatter(
                [r["kv_bytes"] for r in after], [r["lowest_pct"] for r in after], marker=marker, s=46,
                color=color, label=f"{method}, after recovery",
            )  # fmt: skip
        start = {r["model"]: r for r in before}
        for a in after:
            b = start[a["model"].removesuffix(" + recover")]
            ax.annotate(
                "", xy=(a["kv_bytes"], a["lowest_pct"]), xytext=(b["kv_bytes"], b["lowest_pct"]),
                arrowprops={"arrowstyle": "->", "color": color, "lw": 1.0},
            )  # fmt: skip
        for b in before:
            ax.annotate(b["size"], (b["kv_bytes"], b["lowest_pct"]), fontsize=7, xytext=(5, -10),
                        textcoords="offset points", color=color)  # fmt: skip
    ax.axhline(100.0, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ticks = sorted({r["kv_bytes"] for r in rows})
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("KV cache bytes per token (fp32, all 6 layers; log scale)")
    ax.set_ylabel("lowest % of the original's score")
    ax.legend(fontsize=7)


def surgery_notes(rows: list[dict[str, Any]], sizes: SurgerySizes, seconds: float) -> list[str]:
    """What the table measured, and the MLA-GQA comparison at equal KV bytes when the run has one."""
    which = "each method's smallest cache" if sizes.recover_smallest else "every variant"
    notes = [
        f"Human-judged scores (`mh.eval.human_judged`, [percentile bootstrap 95% interval] over "
        f"{sizes.bootstrap} resamples): Lee et al. (2005) Pearson over 1225 "
        "document pairs, WordSim-353 Spearman, 5-fold logistic probe accuracy on 200 Pang-Lee polarity "
        "sentences; lowest % of original = the lowest of the three ratios to the original's score. Two "
        "rows whose intervals overlap are not told apart by these sets. "
        f"Recovery ({which}): `mh.heads.recover` with the library's recipe (docstrings cut into mixed "
        f"lengths, lr {'2e-5' if sizes.lr is None else f'{sizes.lr:g}'} warmed up then cosine-decayed, "
        f"the best of its held-out checks on {sizes.holdout} inputs), {sizes.recover_steps} AdamW steps of "
        f"{sizes.batch_size} texts of at most {sizes.max_tokens} tokens, training what the surgery "
        f"changed; this part took {seconds:.0f} s. Longer runs: "
        "`python benchmarks/surgery_quality.py --recipe`.",
    ]
    pairs = equal_bytes_pairs(rows)
    if pairs:
        m, g = pairs[0]
        verb = "more than" if m["lowest_pct"] > g["lowest_pct"] else "less than"
        if m["lowest_pct"] == g["lowest_pct"]:
            verb = "as much as"
        stage = "without recovery"
        if m["stage"] == "after":
            moved, effect = recovery_effect(rows, m)
            stage = effect if moved else f"the same before and after: its {effect}"
        mla, gqa = m["model"].split(" + ")[0], g["model"].split(" + ")[0]
        notes.append(
            f"At {m['kv_bytes']:,} KV bytes per token, {mla} keeps {m['lowest_pct']:.1f}% of the original's "
            f"score (lowest of the three), {verb} {gqa} ({g['lowest_pct']:.1f}%), {stage}."
        )
    effects = [f"{r['model'].removesuffix(' + recover')}: {recovery_effect(rows, r)[1]}" for r in rows
               if r["stage"] == "after"]  # fmt: skip
    if effects:
        notes.append("What recovery did, row by row: " + "; ".join(effects) + ".")
    return notes
