"""The report of ``multihead bench decode``: the table (:func:`render`), the lines under it
(:func:`summary_lines`) and the JSON (:func:`to_json`) of the document :func:`multihead.bench.decode.run`
returns.
"""

from __future__ import annotations

import json
import math
from typing import Any

from . import timing
from .decode_rows import FLOATS
from .tokens import parting_text

__all__ = ["render", "summary_lines", "to_json"]


def to_json(doc: dict[str, Any]) -> str:
    """The report as indented JSON."""
    return json.dumps(doc, indent=2)


def _ratio(x: float | None, same: bool | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return timing.SAME if same else f"{x:.2f}x"


def _rate(r: dict[str, Any]) -> str:
    """A checked rate with its spread, or the refusal of :func:`multihead.bench.decode_rows.row` ("n/a (why;
    what to pass)")."""
    if r["tok_s"] is None:
        return r["why_no_rate"] or timing.TOO_SHORT
    lo, hi = r["tok_s_spread"]
    return f"{r['tok_s']:.1f} ({lo:.0f}-{hi:.0f})"


def _frac(x: float | str | None) -> str:
    return "-" if x is None else x if isinstance(x, str) else f"{x:.0%}"


def render(doc: dict[str, Any]) -> Any:
    """The report as a rich Table (title: the workload and the measured read bandwidth)."""
    from rich.table import Table

    title = (
        f"{doc['preset']} decode: prompt {doc['prompt_len']}, {doc['new_tokens']} new tokens, "
        f"{doc['threads']} torch thread(s), the median of >= {doc['rounds']} interleaved sample(s) a "
        "call (spread: the rates its quartiles allow); read bandwidth (the probe's fastest sample) "
        f"{doc['read_bandwidth_GBps']:.1f} GB/s from memory, more from the caches for a small step"
    )
    table = Table(title=title)
    cols = ("contestant", "MB/token", "tok/s", "bandwidth limit", "of limit")
    for col in (*cols, "vs HF fp32", "vs HF same"):
        table.add_column(col, justify="left" if col == "contestant" else "right", no_wrap=col == "contestant")
    for r in doc["rows"]:
        limit = r.get("why_no_limit") or f"{r['limit_tok_s']:.1f}"
        differs = doc.get(f"tokens_identical_{r['dtype']}") is False
        table.add_row(
            r["name"] + (" (*)" if differs else ""),
            f"{r['bytes_per_token'] / 1e6:.1f}",
            _rate(r),
            limit,
            _frac(r["fraction_of_limit"]),
            _ratio(r["vs_hf_fp32"], r["vs_hf_fp32_within_noise"]),
            _ratio(r["vs_hf_same_dtype"], r["vs_hf_same_dtype_within_noise"]),
        )
    return table


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """The lines printed under the table: the token check (where the tokens part, and the logit margin
    there), or why transformers' rows are missing; the kernel of the prepacked and native rows and
    whether their tokens equal plain multihead's."""
    yes = {True: "yes", False: "no", None: "-"}
    packed = [
        f"bf16 prepacked: {doc['bf16_prepacked']}; greedy 8 tokens identical to multihead bf16: "
        f"{'yes' if doc['tokens_identical_prepacked'] else 'NO'}; fp32 prepacked's to multihead fp32: "
        f"{yes[doc['tokens_identical_fp32_prepacked']]}",
        f"native: {doc['native']}; greedy 8 tokens identical to multihead fp32: "
        f"{yes[doc['tokens_identical_native_fp32']]}, to multihead bf16: "
        f"{yes[doc['tokens_identical_native_bf16']]}, to multihead fp16: "
        f"{yes[doc['tokens_identical_native_fp16']]}",
    ]
    for k, v in doc.get("int8_native", {}).items():
        where = (
            "greedy 8 tokens identical"
            if v["first_difference"] is None
            else f"greedy tokens part at step {v['first_difference']} (fp32 margin there {v['margin']:.3g})"
        )
        packed.append(
            f"{k} vs multihead fp32, decode steps: logit error {v['logit_error']:.2%} of the range, {where}"
        )
    short = [f"{r['name']}: {r['why_no_rate']}" for r in doc["rows"] if r["tok_s"] is None]
    if doc["skipped"]:
        return [doc["skipped"], *packed, *short]
    lines = [f"greedy 8 tokens identical to transformers {doc['transformers']}:"]
    lines += [f"  {d}: {parting_text(doc[f'tokens_part_{d}'])}" for d in FLOATS]
    if any(doc[f"tokens_identical_{d}"] is False for d in FLOATS):
        lines.append(
            "(*) transformers does not reproduce these tokens: its rows time the same weights, not the "
            "same output"
        )
    return [*lines, *packed, *short]
