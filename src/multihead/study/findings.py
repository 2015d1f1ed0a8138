"""The report's key findings: the most important measured results, each read off its section's data.

Every finding is computed from the numbers of the section it links to (never written by hand), so the box
at the top of the report says what this run measured. A finding whose section did not run (``--only``),
was skipped, or lacks the numbers is left out.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from .context import Section
from .sections.surgery import equal_bytes_pairs, recovery_effect

__all__ = ["FINDINGS", "key_findings"]

Finding = Callable[[dict[str, Any]], str | None]


def _exactness(d: dict[str, Any]) -> str | None:
    rows = [
        r for r in d["rows"] if r["backend"] not in ("reference", "matrix") and r["out_ratio"] is not None
    ]
    worst = max(rows, key=lambda r: r["out_ratio"])
    return (
        f"Every backend stays within {worst['out_ratio']:.2f}x the output error of the plain matrix path "
        f"against the float64 reference (worst: {worst['backend']}, {worst['case']}, {worst['dtype']}; "
        "the tests allow 2x)."
    )


def _performance(d: dict[str, Any]) -> str | None:
    """auto against SDPA, read off the verdicts the performance table shows (noise is no gain or loss)."""
    from ..bench.suite import verdicts

    auto = [r for r in d["results"] if r.get("method") == "auto" and r.get("ms") is not None]
    sdpa = [v for r in auto for v in verdicts(r) if v.peer == "sdpa"]
    if not sdpa:
        return None
    ratios = [v.ratio for v in sdpa]
    med = statistics.median(ratios)
    same = sum(v.same for v in sdpa)
    noise = f"; {same} of them the same within noise" if same else ""
    return (
        f"auto takes {med:.2f}x the time of PyTorch SDPA (median over {len(ratios)} cases, ratio < 1 = "
        f"faster; best {min(ratios):.2f}x, worst {max(ratios):.2f}x{noise})."
    )


def _kv_cache(d: dict[str, Any]) -> str | None:
    rows = {r["name"]: r for r in d["rows"] if r["model"].startswith("LLaMA")}
    mha, mqa = rows["MHA"], rows["MQA"]
    return (
        f"KV cache of {mha['model']}: {mha['mib']:,.0f} MiB per sequence with MHA, "
        f"{mqa['mib']:,.0f} MiB with "
        f"MQA ({mha['mib'] / mqa['mib']:.0f}x smaller)."
    )


def _minilm(d: dict[str, Any]) -> str | None:
    rates = d["docs_per_s"]
    gold = d["vs_gold"]["min_cosine"]
    line = f"all-MiniLM-L6-v2 through multihead: min cosine {gold:.6f} to the float64 oracle"
    st = d.get("vs_sentence_transformers")
    if st is not None:
        line += f" and {st['min_cosine']:.6f} to sentence-transformers"
    if "sentence-transformers" in rates:
        ours = max(v for k, v in rates.items() if k.startswith("multihead") and v is not None)
        line += f"; {ours / rates['sentence-transformers']:.2f}x its encoding speed"
    return line + "."


def _designs(d: dict[str, Any]) -> str | None:
    lm = d["text_lm"]["rows"]
    best = min(lm, key=lambda r: r["bits_per_byte"])
    by = {r["design"]: r for r in lm}
    line = "Head designs: lowest held-out bits/byte on the docstrings LM is "
    line += f"{best['design']} ({best['bits_per_byte']:.3f}"
    if "mha" in by:
        line += f" vs mha {by['mha']['bits_per_byte']:.3f}"
    line += ")"
    if "mla" in by and "mha" in by:
        ratio = by["mha"]["kv_bytes_per_token"] / by["mla"]["kv_bytes_per_token"]
        line += f"; latent attention caches {ratio:.1f}x fewer bytes per token than MHA"
    return line + "."


def _heads(d: dict[str, Any]) -> str | None:
    """MLA against GQA at equal KV bytes per token (the surgery part of the heads section), when measured."""
    pairs = equal_bytes_pairs(d["surgery"]["rows"])
    if not pairs:
        return None
    mla, gqa = pairs[0]
    full = next(r["kv_bytes"] for r in d["surgery"]["rows"] if r["method"] == "original")
    diff = mla["lowest_pct"] - gqa["lowest_pct"]
    verb = "more than" if diff > 0 else "less than" if diff < 0 else "as much as"
    when = "without recovery"
    if mla["stage"] == "after":
        moved, _ = recovery_effect(d["surgery"]["rows"], mla)
        steps = f"{mla['recover_steps']} recovery steps"
        when = (
            f"after {steps}"
            if moved
            else f"the same before and after its {steps} (they changed no score shown)"
        )
    return (
        f"At equal KV cache ({mla['kv_bytes']:,} bytes per token, {full / mla['kv_bytes']:.0f}x below MHA), "
        f"{mla['model'].split(' + ')[0]} keeps {mla['lowest_pct']:.1f}% of MiniLM's human-judged score "
        f"(the lowest of Lee, WordSim-353 and polarity, as % of the original), {verb} "
        f"{gqa['model'].split(' + ')[0]} ({gqa['lowest_pct']:.1f}%), {when}."
    )


#: (section key, finding) in the order the box lists them.
FINDINGS: list[tuple[str, Finding]] = [
    ("exactness", _exactness),
    ("performance", _performance),
    ("minilm", _minilm),
    ("designs", _designs),
    ("kv_cache", _kv_cache),
    ("heads", _heads),
]


def key_findings(sections: list[Section], limit: int = 6) -> list[tuple[str, str]]:
    """Up to ``limit`` (section key, finding) pairs measured by the sections of this run."""
    data = {s.key: s.data for s in sections}
    out = []
    for key, finding in FINDINGS:
        if key not in data or "skipped" in data[key]:
            continue
        try:
            text = finding(data[key])
        except (KeyError, ValueError, ZeroDivisionError, TypeError):
            text = None  # the section ran without these numbers (a smaller workload)
        if text:
            out.append((key, text))
    return out[:limit]
