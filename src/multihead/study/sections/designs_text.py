"""The language-model part of the study's designs section: the byte-level LM's table, its finding, and
the notes on decode speed and on the bytes a design without a KV cache keeps. Each reads the rows of
:func:`multihead.train.text.train_text_lm`, one per head design.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...cost.timing import TOO_SHORT
from ...train.text import TextConfig

if TYPE_CHECKING:  # study.py imports this module to register the section: import it at call time
    from ..context import Table

__all__ = ["TEXT_NOTE", "decode_note", "input_bytes_per_token", "text_finding", "text_table"]


def input_bytes_per_token(cfg: TextConfig) -> int:
    """Bytes a design without a KV cache keeps per token: its input to every layer (d_model fp32 numbers
    a layer), what it recomputes keys and values from; :func:`multihead.cost.design_costs` counts the same."""
    return cfg.n_layers * cfg.d_model * 4


def decode_note(rows: list[dict[str, Any]], paths: dict[str, str | None]) -> str:
    """Why the designs decode at such different speeds, from the table's own rates: which designs run
    native steps and which the PyTorch layers (with the reason), and each one's time against mha's."""
    native = [r["design"] for r in rows if paths.get(r["design"]) is None]
    eager: dict[str, list[str]] = {}
    for r in rows:
        why = paths.get(r["design"])
        if why is not None:
            reason = why.split(": ")[-1].replace("layer 0's attention", "its attention")
            if reason.endswith("not the textbook MultiHeadAttention"):  # one group, not one per class
                reason = "its attention is not the textbook MultiHeadAttention"
            eager.setdefault(reason, []).append(r["design"])
    line = "Decode tok/s: "
    if native:
        line += f"{', '.join(native)} decode with native steps (one native call a token for every layer); "
    line += "the others run their PyTorch layers a token at a time: " + "; ".join(
        f"{', '.join(names)} ({why})" for why, names in eager.items()
    )
    by = {r["design"]: r["decode_tok_s"] for r in rows}
    if by.get("mha"):
        slow = [
            f"{d} {by['mha'] / v:.1f}x" for d, v in by.items() if d != "mha" and v and by["mha"] / v > 1.5
        ]
        if slow:
            line += ". Time a token against mha's: " + ", ".join(slow)
    return line + "."


def text_table(rows: list[dict[str, Any]], cfg: TextConfig) -> Table:
    from ..context import Table

    def rate(tok_s: float | None) -> str:
        return TOO_SHORT if tok_s is None else f"{tok_s:,.0f}"

    def share(r: dict[str, Any]) -> str:
        return "n/a" if r["first_token_share"] is None else f"{100 * r['first_token_share']:.2f}%"

    cells = [
        [
            r["design"],
            f"{r['bits_per_byte']:.3f}",
            rate(r["decode_tok_s"]) + ("" if r["decode_cached"] else " (no cache)"),
            f"{r['kv_bytes_per_token']:,}" + ("" if r["decode_cached"] else " (inputs)"),
            share(r),
            f"{r['params']:,}",
            f"{r['seconds']:.1f}",
        ]
        for r in rows
    ]
    return Table(
        f"byte-level LM on standard-library docstrings: {cfg.steps} steps of {cfg.batch} x {cfg.seq_len} "
        f"bytes, d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads",
        [
            "design",
            "held-out bits/byte",
            "decode tok/s",
            "KV bytes/token",
            "on 1st token",
            "parameters",
            "train s",
        ],
        cells,
        align="lrrrrrr",
    )


def text_finding(rows: list[dict[str, Any]]) -> str:
    """One line on the language-model task, from its numbers."""
    ranked = sorted(rows, key=lambda r: r["bits_per_byte"])
    top = ", ".join(f"{r['design']} ({r['bits_per_byte']:.3f})" for r in ranked[:3])
    by = {r["design"]: r for r in rows}
    line = f"Language model: lowest held-out bits/byte {top}"
    if "mha" in by:
        line += f"; mha {by['mha']['bits_per_byte']:.3f}"
    shares = {n: by[n]["first_token_share"] for n in ("mha", "sinks", "output_gated") if n in by}
    if all(v is not None for v in shares.values()) and shares:
        line += "; weight on the first token " + ", ".join(f"{n} {100 * v:.2f}%" for n, v in shares.items())
    return line + "."


TEXT_NOTE = (
    "Language model: every design replaces the attention of the same byte-level TransformerLM (vocabulary "
    "256, no tokenizer) trained on the UTF-8 bytes of the standard library's docstrings (90% train, the "
    "last 10% held out) with the same batches and schedule. Decode tok/s: greedy KV-cached generation at "
    'batch 1 after a full window of prompt, one thread ("no cache": the design needs every key\'s input '
    "and recomputes the prefix each step). KV bytes/token: what one token adds to every "
    "layer's cache. On 1st token: mean attention weight on each window's first byte over layers, heads and "
    "the query rows past the first quarter - where a softmax that must sum to one parks unused mass "
    '(an "attention sink"); a learned sink logit or an output gate gives that mass somewhere else to go. '
    "n/a: the design forms its weights outside the attention call the recorder watches (talking heads and "
    "DCMHA mix them across heads, differential attention subtracts two maps)."
)
