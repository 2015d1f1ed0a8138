"""The rows of ``multihead bench decode``: which contestants there are (:data:`ROWS`, in print order) and
each row's figures, every one checked against what it can be (:func:`multihead.bench.timing.check_figure`):
the decode rate, the bandwidth limit, the fraction between them and the ratios to transformers' rows.
:mod:`multihead.bench.decode` measures them and re-exports these names.
"""

from __future__ import annotations

from typing import Any

import torch

from . import timing

__all__ = ["ACTIVATIONS", "FLOATS", "INT8_NATIVE", "ROWS", "fraction", "refusal_fixes", "row"]

#: (row name, implementation, dtype) in print order; int8 rows have no transformers peer of their dtype
ROWS: tuple[tuple[str, str, str], ...] = (
    ("HF fp32", "transformers", "fp32"),
    ("multihead fp32", "multihead", "fp32"),
    ("multihead fp32 prepacked", "multihead", "fp32"),
    ("multihead fp32 native", "multihead", "fp32"),
    ("HF bf16", "transformers", "bf16"),
    ("multihead bf16", "multihead", "bf16"),
    ("multihead bf16 prepacked", "multihead", "bf16"),
    ("multihead bf16 native", "multihead", "bf16"),
    ("HF fp16", "transformers", "fp16"),
    ("multihead fp16", "multihead", "fp16"),
    ("multihead fp16 native", "multihead", "fp16"),
    ("multihead int8 (fp32 activations)", "multihead", "int8"),
    ("multihead int8 (bf16 activations)", "multihead", "int8+bf16"),
    ("multihead int8 native per-channel", "multihead", "int8"),
    ("multihead int8 native group 64", "multihead", "int8"),
    ("multihead int8 native group 32", "multihead", "int8"),
)
#: the native int8 rows' group sizes (None: one scale per output channel)
INT8_NATIVE = {
    "multihead int8 native per-channel": None,
    "multihead int8 native group 64": 64,
    "multihead int8 native group 32": 32,
}

FLOATS = ("fp32", "bf16", "fp16")  # the float dtypes with a transformers row
ACTIVATIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}  # a row's activations; fp32 otherwise


def row(name: str, impl: str, dtype: str, nbytes: int, steps: dict[str, timing.Timing], new: int,
         bandwidth: float, rounds: int = 3) -> dict[str, Any]:  # fmt: skip
    """One row of the report (see :func:`multihead.bench.decode.run`); every figure checked
    (:func:`timing.check_figure`)."""
    step = steps[name]
    limit = bandwidth / nbytes
    fixes = refusal_fixes(new, rounds)
    rate = timing.rate_figure(step, new - 1, fix=fixes["rate"])
    limit_fig = timing.check_figure(
        limit, at_least=rate.value, at_least_what="a rate measured against it", fix=fixes["limit"]
    )
    if limit_fig.ok:  # a limit that holds: no spread may reach above it
        rate = timing.rate_figure(
            step, new - 1, limit=limit, limit_what="the bandwidth limit", fix=fixes["rate"]
        )
    tok_s = rate.value
    peer = f"HF {dtype}"

    def vs(other: str) -> timing.Comparison | None:
        return timing.compare(steps[other], step) if other in steps else None  # their time / ours

    same, fp32 = vs(peer), vs("HF fp32")
    return {
        "name": name,
        "impl": impl,
        "dtype": dtype,
        "bytes_per_token": nbytes,
        "tok_s": tok_s,
        "tok_s_spread": None if rate.low is None else [rate.low, rate.high],
        "why_no_rate": None if rate.ok else rate.text(),
        "limit_tok_s": limit,
        "why_no_limit": None if limit_fig.ok else limit_fig.text(),
        "fraction_of_limit": fraction(tok_s, limit),
        "vs_hf_fp32": None if fp32 is None else fp32.ratio,
        "vs_hf_fp32_within_noise": None if fp32 is None else fp32.same,
        "vs_hf_same_dtype": None if same is None else same.ratio,
        "vs_hf_same_dtype_within_noise": None if same is None else same.same,
    }


def refusal_fixes(new: int, rounds: int) -> dict[str, str]:
    """What to pass for a figure that is refused, per figure: the options of ``multihead bench decode``."""
    more = f"--rounds {2 * rounds}"
    return {
        "rate": f"pass --new-tokens {4 * new} (more steps a timed call) or {more}",
        "limit": f"the probe ran under load: run on an idle machine, or pass {more} (its fastest of more "
        "samples counts)",
    }


def fraction(rate: float | None, limit: float | None, refusal: str = timing.ABOVE) -> float | str | None:
    """rate / limit, or the refusal text where it would pass 100% (see :func:`timing.limit_text`)."""
    text = timing.limit_text(rate, limit, refusal)
    return timing.fraction_of_limit(rate, limit) if text[-1] == "%" else (None if text == "-" else text)
