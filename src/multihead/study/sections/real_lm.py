"""The study's real-LM section: what precision, approximation and head-surgery choices cost SmolLM2-135M.

SmolLM2-135M-Instruct (the packaged GGUF file, ``mh.pretrained.smollm2()``) scored on held-out English
Wikipedia by :mod:`multihead.bench.real_lm`: perplexity with a bootstrap interval, greedy tokens equal to
the fp32 model's, KV bytes per token. Quick: five rows on three short articles (context 256). Full: the
precision, approximation and raw surgery rows on eight articles, and the 4x-smaller MLA cache after three
minutes of ``mh.heads.recover``. The complete table with recovery for every surgery (eight minutes each) is
``benchmarks/real_lm.py`` (docs/real-lm.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...bench import real_lm as costs

if TYPE_CHECKING:  # study.py imports this module: import its classes at call time, not here
    from ..context import Section, StudyContext

__all__ = ["FULL", "FULL_ROWS", "QUICK", "QUICK_ROWS", "real_lm"]

QUICK = costs.Settings(
    texts=3,
    chars=1000,
    context=256,
    stride=128,
    prompts=2,
    new_tokens=12,
    calibration=(2, 256),
    bootstrap=300,
)
QUICK_ROWS = ("fp32", "kv-int8", "window-64", "sinks-window-64", "gqa-1")
FULL = costs.Settings(recover_minutes=3.0)
FULL_ROWS = (
    "fp32", "bf16", "fp16", "int8-channel", "int8-g32", "kv-int8", "window-64", "window-256",
    "sinks-window-64", "sinks-window-256", "topk-16", "topk-64", "performer-64", "gqa-1", "mla-48",
    "mla-48-disjoint", "mla-80", "prune-group", "mla-48+rec",
)  # fmt: skip


def _verdict(rows: list[dict]) -> str:
    """Which row costs least and which most, as multiples of fp32's perplexity."""
    fp32, others = rows[0], rows[1:]
    if not others:
        return ""
    ratio = {r["what"]: r["perplexity"] / fp32["perplexity"] for r in others}
    best, worst = min(ratio, key=ratio.__getitem__), max(ratio, key=ratio.__getitem__)
    return (
        f"Cheapest here: {best} ({ratio[best]:.3f}x fp32's perplexity); dearest: {worst} "
        f"({ratio[worst]:.3g}x)."
    )


def real_lm(ctx: StudyContext) -> Section:
    """The cost table on the real LM, or a note saying what to install."""
    from ..context import Section, Table

    title = "A real language model: what each choice costs SmolLM2-135M"
    try:
        from ...pretrained.gguf import smollm2

        base = smollm2()
    except ImportError as e:
        note = f"Skipped: {e}"
        return Section("real_lm", title, {"skipped": str(e)}, [], [note])
    names, settings = (QUICK_ROWS, QUICK) if ctx.quick else (FULL_ROWS, FULL)
    done: list[str] = []

    def step(line: str) -> None:
        done.append(line)
        ctx.step(line.split(":")[0], len(done) / len(names))

    rows = costs.measure(list(names), settings, base=base, log=step)
    fp32 = rows[0]
    cells = []
    for r in rows:
        kv = r["kv_bytes_per_token"]
        rec = f" ({r['recover_steps']} steps)" if r.get("recover_steps") is not None else ""
        cells.append([
            r["what"] + rec, f"{r['perplexity']:.2f}", f"[{r['low']:.2f}, {r['high']:.2f}]",
            f"{r['perplexity'] / fp32['perplexity']:.3f}", f"{100 * r['greedy_same']:.0f}%", f"{kv:,}",
            f"{fp32['kv_bytes_per_token'] / kv:.1f}x",
        ])  # fmt: skip
    table = Table(
        "SmolLM2-135M-Instruct on held-out Wikipedia",
        [
            "choice",
            "perplexity",
            "95% interval",
            "vs fp32",
            "greedy = fp32",
            "KV bytes / token",
            "KV smaller",
        ],
        cells,
        align="lrrrrrr",
    )
    notes = [
        f"{fp32['tokens']} tokens of {settings.texts} held-out Wikipedia articles scored by a sliding window "
        f"(context {settings.context}, stride {settings.stride}); the interval is a percentile bootstrap "
        f"over windows; greedy agreement over {settings.prompts} prompts x {settings.new_tokens} tokens.",
        _verdict(rows),
    ]
    return Section("real_lm", title, {"rows": rows}, [table], notes)
