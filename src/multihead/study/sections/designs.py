"""The study's designs section: every head design of :mod:`multihead.variants` trained on MQAR, side by side.

Each name of :data:`~multihead.variants.NAMES` replaces the self-attention of the same 2-layer
:class:`~multihead.TransformerLM` (:func:`multihead.train.trainer.build_model`), which is then trained
on fresh MQAR batches by :func:`multihead.train.trainer.train_mqar` with one config for all: the same
data, steps, seed and optimizer, so the designs differ only in their attention. The row of each design:
held-out accuracy, the final training loss, parameters, forward FLOPs of one sequence and the training
time.

Two tasks, both with 4 query heads (so that "gqa", 2 kv heads, differs from "mqa", 1):

    QUICK  seq_len 16, 2 pairs, vocab 64, 300 steps: enough for exact attention to get past MQAR's
           plateau, so the designs separate by how soon they learn it (seconds per design)
    FULL   seq_len 64, 4 pairs, vocab 256, 500 steps: a harder task, minutes in all. Zoology's size
           (seq_len 256, 16 pairs, vocab 8192) takes the trainer's recipe tens of CPU minutes per
           design: ``multihead train --attention NAME``. The full study runs QUICK first.

What the designs score, and how long Zoology's size trains: BENCHMARKS.md, "Head designs" and
BENCHMARKS.md, "MQAR (multi-query associative recall)".

Training runs on one intra-op thread: the model is small, and on a busy machine a second thread's
spin-waiting costs more than it gives.

The figures are :mod:`.designs_figures`; the language model's table, finding and notes
:mod:`.designs_text`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from ...cost.designs import DesignCost, design_costs
from ...train.text import TextConfig, train_text_lm
from ...train.trainer import TrainConfig, train_mqar
from ...variants import NAMES
from .designs_figures import design_style, dodge, error_floor, mqar_plot, text_plot
from .designs_text import TEXT_NOTE, decode_note, input_bytes_per_token, text_finding, text_table

if TYPE_CHECKING:  # study.py imports this module to register the section: import it at call time
    from ..context import Section, StudyContext, Table

__all__ = [
    "DESIGNS",
    "FULL",
    "QUICK",
    "decode_note",
    "decode_paths",
    "design_style",
    "designs",
    "dodge",
    "error_floor",
    "input_bytes_per_token",
    "kv_note",
]

#: The designs trained, in table order.
DESIGNS: tuple[str, ...] = NAMES
#: The quick study's task (seconds per design).
QUICK = TrainConfig(
    seq_len=16,
    n_pairs=2,
    vocab=64,
    n_heads=4,
    steps=300,
    batch=64,
    warmup=50,
    eval_examples=500,
    short_steps=0,
)
#: The full study's second task: 4x longer, 2x the pairs, 4x the vocabulary (Zoology's size, seq_len 256
#: with 16 pairs, is ``multihead train --attention NAME``: tens of CPU minutes per design).
FULL = TrainConfig(
    seq_len=64,
    n_pairs=4,
    vocab=256,
    n_heads=4,
    steps=500,
    batch=64,
    warmup=50,
    eval_examples=500,
    short_steps=0,
)
#: The final loss is the mean of the training loss over this many last steps (one batch is noisy).
LAST_STEPS = 10

_WHAT = {
    "mha": "multi-head attention (the baseline)",
    "gqa": "grouped-query: n_heads / 2 kv heads",
    "mqa": "multi-query: one kv head",
    "moh": "mixture of heads: top-k heads routed per token",
    "dcmha": "dynamic composition of head scores",
    "mohsa": "overlapping heads (neighbours' features)",
    "collab": "collaborative heads: shared W_Q / W_K",
    "talking": "talking heads: mixed logits and weights",
    "gated": "gated heads with an L0 penalty",
    "sinks": "MHA with a learned sink logit per head",
    "output_gated": "sigmoid gate on each head's output",
    "differential": "difference of two softmax maps",
    "mla": "latent attention: cache a low-rank latent",
}

#: The language-model task: bytes of the standard library's docstrings (see multihead.train.text).
TEXT_QUICK = TextConfig(seq_len=64, steps=100)
#: The full study's language model: windows of 128 bytes, 6x the steps.
TEXT_FULL = TextConfig(seq_len=128, steps=600)


def _train_all(
    base: TrainConfig, step: Callable[[str, float], None], done: float, share: float
) -> list[dict[str, Any]]:
    """Train ``base`` once per design of :data:`DESIGNS`; one JSON row each.

    ``step(what, fraction)`` reports progress from ``done`` to ``done + share`` of the section.
    """
    rows = []
    for i, name in enumerate(DESIGNS):
        step(f"training {name} (seq_len {base.seq_len})", done + share * i / len(DESIGNS))
        res = train_mqar(replace(base, attention=name))
        tail = res.losses[-LAST_STEPS:]
        rows.append(
            {
                "design": name,
                "accuracy": res.accuracy,
                "final_loss": sum(tail) / len(tail),
                "params": int(res.extra["params"]),
                "flops": int(res.extra["flops"]),
                "seconds": res.seconds,
            }
        )
    return rows


def _train_text(
    base: TextConfig, step: Callable[[str, float], None], done: float, share: float
) -> list[dict[str, Any]]:
    """Train the byte-level LM of ``base`` once per design of :data:`DESIGNS`; one JSON row each."""
    rows = []
    for i, name in enumerate(DESIGNS):
        step(f"language model: {name}", done + share * i / len(DESIGNS))
        res = train_text_lm(replace(base, attention=name))
        row = {"design": name, **{k: v for k, v in res.as_dict().items() if k not in ("losses", "config")}}
        if not row["decode_cached"]:  # it keeps each token's input instead, as the decode-cost table counts
            row["kv_bytes_per_token"] = input_bytes_per_token(base)
        rows.append(row)
    return rows


def decode_paths(cfg: TextConfig) -> dict[str, str | None]:
    """Per design: None where its decode steps run natively (one native call a token for every layer,
    :mod:`multihead.models.native_step`), else why they run the PyTorch layers (the model's own
    ``why_not_native_steps``), on an untrained copy of the language model's shape."""
    import torch

    from ...models.lm import TransformerLM
    from ...train.text import VOCAB
    from ...variants import swap

    rng = torch.random.get_rng_state()  # building draws weights: leave the study's random state as it was
    try:
        base = TransformerLM(VOCAB, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, max_len=2 * cfg.seq_len)
        models = {name: base if name == "mha" else swap(base, name) for name in DESIGNS}
    finally:
        torch.random.set_rng_state(rng)
    return {name: getattr(m, "why_not_native_steps", "not a TransformerLM") for name, m in models.items()}


def kv_note(rows: list[dict[str, Any]], cfg: TextConfig, costs: list[DesignCost]) -> str:
    """Why the two tables' KV bytes/token differ, from their own numbers: each counts its own model."""
    lm = {r["design"]: r["kv_bytes_per_token"] for r in rows}
    cost = {c.design: c.kv_bytes_per_token for c in costs}
    d, _ = COST_SHAPE
    line = (
        f"KV bytes/token count what one token leaves in the caches of each table's own model: the language "
        f"model's {cfg.n_layers} layers at d_model {cfg.d_model}"
    )
    if "mha" in lm:
        line += f" (mha {lm['mha']:,})"
    line += f", the decode-cost table's one attention sub-layer at d_model {d}"
    if "mha" in cost:
        line += f" (mha {cost['mha']:,})"
    inputs = sorted(
        {r["design"] for r in rows if not r["decode_cached"]} | {c.design for c in costs if not c.cached}
    )
    if inputs:
        line += (
            f". {', '.join(inputs)} cache no keys or values: both tables count the input each layer keeps "
            f"instead ({cfg.d_model} and {d} fp32 numbers a layer), marked (inputs)"
        )
    return line + "."


#: (d_model, n_heads) and cached tokens of the decode-cost table.
COST_SHAPE = (512, 8)
COST_CONTEXT = 1024


def _cost_table(costs: list[DesignCost]) -> Table:
    from ..context import Table

    cells = [
        [
            c.design,
            f"{c.flops / 1e6:,.2f}",
            f"{c.bytes / 2**20:,.2f}",
            f"{c.kv_bytes_per_token:,}" + ("" if c.cached else " (inputs)"),
            f"{c.intensity:,.2f}",
            f"{c.params:,}",
        ]
        for c in costs
    ]
    d, h = COST_SHAPE
    return Table(
        f"one decode step of the attention sub-layer (mh.cost.design_costs): d_model {d}, {h} heads, "
        f"batch 1, {COST_CONTEXT} cached tokens, fp32",
        ["design", "MFLOP", "MiB read", "KV bytes/token", "FLOP/byte", "parameters"],
        cells,
        align="lrrrrr",
    )


def _table(rows: list[dict[str, Any]], cfg: TrainConfig) -> Table:
    from ..context import Table

    cells = [
        [
            r["design"],
            _WHAT.get(r["design"], ""),
            f"{100 * r['accuracy']:.1f}%",
            f"{r['final_loss']:.3f}",
            f"{r['params']:,}",
            f"{r['flops'] / 1e6:,.1f}",
            f"{r['seconds']:.2f}",
        ]
        for r in rows
    ]
    return Table(
        f"MQAR, seq_len {cfg.seq_len}, {cfg.n_pairs} pairs, vocab {cfg.vocab}: {cfg.steps} steps of batch "
        f"{cfg.batch}, d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads",
        ["design", "what", "accuracy", "final loss", "parameters", "forward MFLOP", "train s"],
        cells,
        align="llrrrrr",
    )


def _finding(rows: list[dict[str, Any]], cfg: TrainConfig) -> str:
    """One line on a task's outcome, from its numbers."""
    task = f"seq_len {cfg.seq_len}, {cfg.n_pairs} pairs, {cfg.steps} steps"
    best = max(rows, key=lambda r: r["accuracy"])
    if best["accuracy"] < 2 / cfg.n_pairs:  # nobody beats twice a random pick among the pairs' values
        low = sorted(rows, key=lambda r: r["final_loss"])[:3]
        return (
            f"{task}: no design left the plateau (best accuracy {100 * best['accuracy']:.1f}%); lowest "
            "final loss " + ", ".join(f"{r['design']} ({r['final_loss']:.2f})" for r in low) + "."
        )
    ranked = sorted(rows, key=lambda r: -r["accuracy"])
    mha = next((r for r in rows if r["design"] == "mha"), None)
    vs = "" if mha is None else f"; exact multi-head attention {100 * mha['accuracy']:.1f}%"
    top = ", ".join(f"{r['design']} ({100 * r['accuracy']:.1f}%)" for r in ranked[:3])
    return f"{task}: most accurate {top}{vs}."


def _notes(tasks: list[tuple[TrainConfig, list[dict[str, Any]]]]) -> list[str]:
    cfg = tasks[0][0]
    return [
        f"Every design replaces the self-attention of the same {cfg.n_layers}-layer TransformerLM (d_model "
        f"{cfg.d_model}, {cfg.n_heads} query heads, LLaMA blocks: pre-RMSNorm, SwiGLU, rotary) and trains on "
        f"the same fresh MQAR batches with AdamW (peak lr {cfg.lr:g}, warm-up, cosine decay), seed "
        f"{cfg.seed}. Accuracy: the fraction of the held-out examples' queried keys whose value the model "
        "names; naming one of the example's values at random scores about 1 / pairs (the dotted line).",
        f"Final loss: cross-entropy at the query positions plus the design's auxiliary loss (MoH's load "
        f"balance, GatedHeads' L0 penalty), mean of the last {LAST_STEPS} steps. Forward MFLOP: matmul "
        "FLOPs of one sequence (torch's FlopCounterMode, attention on the matrix backend). Train s: wall "
        "time on one thread.",
        "MQAR is learned through a plateau and a sudden drop (an induction head forms): at a fixed step "
        "budget a table ranks how soon each design gets there, not what it reaches in the end, and a design "
        "near the drop can land either side of it with another seed. Zoology's size (seq_len 256, 16 "
        'pairs) needs thousands of steps (BENCHMARKS.md, "MQAR (multi-query associative recall)"); '
        "`multihead train --attention NAME --steps N` trains longer.",
        *(_finding(rows, c) for c, rows in tasks),
    ]


def designs(ctx: StudyContext) -> Section:
    """Every head design of multihead.variants trained on MQAR: accuracy, loss, params, FLOPs.

    Quick: the :data:`QUICK` task (seconds per design); full: :data:`QUICK`, then :data:`FULL` (a
    harder task, longer per design).
    """
    from ..context import Section, one_thread

    configs = [QUICK] if ctx.quick else [QUICK, FULL]
    text_cfg = TEXT_QUICK if ctx.quick else TEXT_FULL
    # share of the section's time per task, by tokens trained (the full task dominates)
    work = [c.steps * c.batch * c.seq_len for c in configs]
    work.append(text_cfg.steps * text_cfg.batch * text_cfg.seq_len)
    tasks, done = [], 0.0
    with one_thread():
        for cfg, w in zip(configs, work):
            share = w / sum(work)
            tasks.append((cfg, _train_all(cfg, ctx.step, done, share)))
            done += share
        text_rows = _train_text(text_cfg, ctx.step, done, work[-1] / sum(work))
    figures = []
    for cfg, rows in tasks:
        figures += ctx.figure(
            f"designs-mqar-{cfg.seq_len}",
            f"MQAR (seq_len {cfg.seq_len}, {cfg.n_pairs} pairs, {cfg.steps} steps): held-out error "
            "against parameters, one point per head design (lower is better; accuracy in the legend). "
            f"An error of 0 (100% accuracy) cannot sit on a log axis: it is drawn on the dashed line at "
            f"{error_floor(cfg):.4g}%, half of one queried key's share of the {cfg.eval_examples} held-out "
            "examples. Designs with equal parameter counts are spread sideways.",
            partial(mqar_plot, rows, cfg),
            size=(7.5, 3.8),
        )
    figures += ctx.figure(
        "designs-text-lm",
        "Byte-level language model on standard-library docstrings: held-out bits per byte against the "
        "KV-cache bytes one token costs, one point per head design; designs with the same KV bytes are "
        "spread sideways around it (the legend gives each value) so that none hides another.",
        partial(text_plot, text_rows),
        size=(7.5, 3.8),
    )
    ctx.step("decode cost of each design", 0.99)
    costs = design_costs(*COST_SHAPE, context=COST_CONTEXT, names=DESIGNS)
    data = {
        "tasks": [{"config": asdict(cfg), "rows": rows} for cfg, rows in tasks],
        "text_lm": {"config": asdict(text_cfg), "rows": text_rows},
        "decode_cost": {
            "d_model": COST_SHAPE[0],
            "n_heads": COST_SHAPE[1],
            "context": COST_CONTEXT,
            "rows": [c.as_dict() for c in costs],
        },
    }
    tables = [_table(rows, cfg) for cfg, rows in tasks] + [
        text_table(text_rows, text_cfg),
        _cost_table(costs),
    ]
    notes = [
        *_notes(tasks), TEXT_NOTE, text_finding(text_rows), decode_note(text_rows, decode_paths(text_cfg)),
        _COST_NOTE, kv_note(text_rows, text_cfg, costs),
    ]  # fmt: skip
    return Section(
        "designs", "Head designs on MQAR and on a small language model", data, tables, notes, figures
    )


_COST_NOTE = (
    "Decode cost: matmul FLOPs counted on one real decode step of each design's attention sub-layer (the "
    "attention on the matrix backend), and the bytes it must read at least (its weights once, plus the "
    "cache). Every cached design sits far below a CPU's ridge of 5-20 FLOP/byte: decoding is bound by "
    'memory, so KV bytes per token decide its speed at long context. "(inputs)": the design cannot use a '
    "KV cache and recomputes keys and values from every token's input at each step (its FLOPs are the "
    "whole recompute)."
)
