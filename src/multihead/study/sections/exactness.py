"""Study section: every backend against the float64 ``reference`` (gold), forward and gradient."""

from __future__ import annotations

import torch

from ...backends.auto import choose
from ...backends.decode import MAX_ROWS
from ...core.biases import Bias, alibi
from ...core.functional import attention, backends
from ...core.masks import Mask, causal, document, padding, sliding_window
from ...core.problem import make_problem
from ..context import Section, StudyContext, Table, dtype_name, one_thread


# -- section (a): exactness ----------------------------------------------------------------------------
def _cases(B: int, N: int, Hq: int) -> dict[str, tuple[Mask | None, Bias | None]]:
    """The mask/bias cases of the exactness section (mask, bias)."""
    docs = torch.arange(N) * 3 // N  # three packed documents
    return {
        "none": (None, None),
        "causal": (causal(), None),
        "sliding_window(64)": (sliding_window(64), None),
        "document+causal": (document(docs) & causal(), None),
        "padding": (padding([N - 37 * b for b in range(B)]), None),
        "alibi+causal": (causal(), alibi(Hq)),
    }


def _forward_backward(backend: str, q, k, v, dout, mask, bias) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and (dq, dk, dv) of one backend on leaf copies of q, k, v."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = attention(*leaves, mask=mask, bias=bias, backend=backend)
    assert isinstance(out, torch.Tensor)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), list(grads)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _ratio(err: float, base: float) -> float | None:
    return err / base if base > 0 else (0.0 if err == 0 else None)


#: Query rows of the decode-shaped cases (a decode step of a few rows against the whole cache).
DECODE_ROWS = 8


def _check_case(q, k, v, dout, mask, bias) -> dict[str, tuple[float, float]]:
    """(output error, max gradient error) of every backend at q's dtype against the float64 reference.

    The ``decode`` backend serves only calls of at most ``MAX_ROWS`` query rows: it is measured on the
    decode-shaped cases and left out of the others.
    """
    q64, k64, v64, dout64 = (t.double() for t in (q, k, v, dout))
    gold_out, gold_grads = _forward_backward("reference", q64, k64, v64, dout64, mask, bias)
    errs = {}
    for b in backends():
        if b == "decode" and q.shape[2] > MAX_ROWS:
            continue
        out, grads = _forward_backward(b, q, k, v, dout, mask, bias)
        errs[b] = (_err(out, gold_out), max(_err(g, h) for g, h in zip(grads, gold_grads)))
    return errs


def _rows(dtype: torch.dtype, case: str, auto: str, errs: dict[str, tuple[float, float]]) -> list[dict]:
    """One JSON row per backend; ratios are to the same-dtype ``matrix`` path's error."""
    base_out, base_grad = errs["matrix"]
    return [
        {
            "dtype": dtype_name(dtype),
            "case": case,
            "backend": b,
            "auto": auto,
            "out_err": out_err,
            "grad_err": grad_err,
            "matrix_out_err": base_out,
            "matrix_grad_err": base_grad,
            "out_ratio": _ratio(out_err, base_out),
            "grad_ratio": _ratio(grad_err, base_grad),
        }
        for b, (out_err, grad_err) in errs.items()
    ]


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}"


def _exactness_rows(ctx: StudyContext, B: int, Hq: int, Hkv: int, N: int, D: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    dtypes = [torch.float32] if ctx.quick else [torch.float32, torch.bfloat16]
    cases = _cases(B, N, Hq)
    for i, dtype in enumerate(dtypes):
        q = torch.randn(B, Hq, N, D, generator=g).to(dtype)  # (B, Hq, N, D)
        k, v = (torch.randn(B, Hkv, N, D, generator=g).to(dtype) for _ in range(2))  # (B, Hkv, N, D)
        dout = torch.randn(B, Hq, N, D, generator=g).to(dtype)  # (B, Hq, N, D)
        for j, (name, (mask, bias)) in enumerate(cases.items()):
            ctx.step(f"{name}, {dtype_name(dtype)}", (i * len(cases) + j) / (len(dtypes) * len(cases)))
            auto = choose(make_problem(q, k, v, mask=mask, bias=bias))[0]
            with one_thread():
                rows += _rows(dtype, name, auto, _check_case(q, k, v, dout, mask, bias))
        q8, dout8 = q[:, :, -DECODE_ROWS:], dout[:, :, -DECODE_ROWS:]  # (B, Hq, 8, D): the newest rows
        for m, mask in (("none", None), ("padding", cases["padding"][0])):
            name = f"decode ({DECODE_ROWS} rows), {m}"
            auto = choose(make_problem(q8, k, v, mask=mask))[0]
            with one_thread():
                rows += _rows(dtype, name, auto, _check_case(q8, k, v, dout8, mask, None))
    return rows


def _exactness_table(rows: list[dict]) -> Table:
    cells = [
        [
            r["dtype"],
            r["case"],
            r["auto"],
            r["backend"],
            f"{r['out_err']:.1e}",
            _fmt_ratio(r["out_ratio"]),
            f"{r['grad_err']:.1e}",
            _fmt_ratio(r["grad_ratio"]),
        ]
        for r in rows
    ]
    return Table(
        "max |error| against float64 reference; ratio = error / error of the same-dtype matrix path",
        ["dtype", "case", "auto", "backend", "out err", "out ratio", "grad err", "grad ratio"],
        cells,
        align="llllrrrr",
    )


def exactness(ctx: StudyContext) -> Section:
    """Every backend against the float64 reference, forward and gradient, masks and ALiBi.

    Workload: B=2, Hq=8, Hkv=2 (GQA), N=256, D=64, fp32; ``quick=False`` adds the same in bf16.
    """
    B, Hq, Hkv, N, D = 2, 8, 2, 256, 64
    rows = _exactness_rows(ctx, B, Hq, Hkv, N, D)
    workload = {
        "B": B,
        "Hq": Hq,
        "Hkv": Hkv,
        "N": N,
        "D": D,
        "cases": list(_cases(B, N, Hq)),
        "decode_cases": [f"decode ({DECODE_ROWS} rows), {m}" for m in ("none", "padding")],
    }
    note = (
        "The numerics rule of the tests (tests/numerics.py, after the FlashAttention and PyTorch test "
        "suites) bounds each backend's error by 2x (outputs) / 3x (gradients) the matrix path's error, "
        f"with a floor of 1e-5. The decode backend serves decode steps (at most {MAX_ROWS} query rows): it "
        f"is measured on the decode-shaped cases, {DECODE_ROWS} query rows against all {N} keys."
    )
    return Section(
        "exactness",
        "Exactness: every backend against the float64 reference",
        {"workload": workload, "rows": rows},
        [_exactness_table(rows)],
        [note],
    )
