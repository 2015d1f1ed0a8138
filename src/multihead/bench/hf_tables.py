"""The tables of ``multihead bench hf``: prefill (time, speed and memory against "sdpa", the output's
difference) and decode (tokens/s against "sdpa"), from the document :func:`multihead.bench.hf.run`
returns; every ratio whose spreads overlap reads "same within noise", every time goes through
:func:`multihead.bench.timing.check_figure`.
"""

from __future__ import annotations

import json
import math
from typing import Any

from . import timing
from .hf_worker import FLOOR

__all__ = ["num_text", "seconds_text", "tables", "to_json", "vs_text"]


def num_text(x: float | None, fmt: str) -> str:
    """``x`` formatted with ``fmt``, or "-" for None or NaN."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def vs_text(row: dict[str, Any], key: str, same: str) -> str:
    """A ratio against sdpa: "1.23x", or "same within noise" where the spreads overlap (never a gain)."""
    if row["impl"] != "sdpa" and row.get(same) and row[key] is not None:
        return timing.SAME
    return num_text(row[key], ".2f") + "x"


def tables(doc: dict[str, Any]) -> list[Any]:
    """The prefill table and the decode table as ``rich`` tables (a note under a row that did not run)."""
    from rich.table import Table

    s = doc["setup"]
    pre = Table(
        title="prefill: multihead inside a Hugging Face model vs transformers' own attention",
        caption=f"{s['model']}; torch {s['torch']}, transformers {s['transformers']}, {s['threads']} "
        f"thread(s), median of >= {s['repeats']} interleaved rounds (more while under 0.2 s), "
        "peak = resident set above the loaded model",
    )
    for col in ("N", "impl", "prefill s", "speed vs sdpa", "peak extra MiB", "memory vs sdpa", "max |diff|"):
        pre.add_column(col, justify="left" if col == "impl" else "right")
    for r in doc["prefill"]:
        if r["seconds"] is None:
            pre.add_row(str(r["n"]), r["impl"], r["note"] or "did not run", "", "", "", "")
            continue
        pre.add_row(
            str(r["n"]),
            "floor (no attention)" if r["impl"] == FLOOR else r["impl"],
            seconds_text(r),
            vs_text(r, "speed_vs_sdpa", "speed_within_noise"),
            num_text(r["peak_mib"], ".0f"),
            num_text(r["memory_vs_sdpa"], ".2f"),
            num_text(r["max_abs_diff"], ".1e"),
        )
    out = [pre]
    d = doc["decode"]
    if d is not None:
        dec = Table(
            title=f"decode: generate {d['new_tokens']} tokens after a {d['prompt']}-token prompt",
            caption=f"greedy, dynamic cache; tokens identical: {'yes' if d['tokens_identical'] else 'NO'}",
        )
        for col in ("impl", "tok/s", "vs sdpa", "runs tok/s"):
            dec.add_column(col, justify="left" if col == "impl" else "right")
        for r in d["rows"]:
            runs = " ".join(f"{x:.1f}" for x in r["all_tok_s"])
            if r["tok_s"] is None:
                dec.add_row(r["impl"], r["note"] or "did not run", "", "")
            else:
                dec.add_row(
                    r["impl"],
                    num_text(r["tok_s"], ".1f"),
                    vs_text(r, "vs_sdpa", "vs_sdpa_within_noise"),
                    runs,
                )
        out.append(dec)
    return out


def seconds_text(r: dict[str, Any]) -> str:
    """A prefill's seconds, checked (:func:`multihead.bench.timing.check_figure`): "n/a (why; what to
    pass)" for a spread wider than 10x."""
    low, high = r.get("seconds_spread") or (None, None)
    fix = "pass a larger `multihead bench hf --repeats`, or run on an idle machine"
    return timing.check_figure(r["seconds"], low, high, fix=fix).text(".3f")


def to_json(doc: dict[str, Any]) -> str:
    """The results as indented JSON."""
    return json.dumps(doc, indent=1)
