"""Bad input gets a ValueError that names the argument, the values and the fix (DESIGN.md, STYLE.md).

Every case goes through both public entries, ``mh.attention`` and ``mh.explain``. The ``match`` patterns
check that the message carries the offending values, not just that some error was raised. The end of
the file checks the empty-row convention: a query row with no allowed key gives zeros, zero gradients
and lse = -inf, for every registered backend.

Shape legend: B batch, Hq / Hkv query / kv heads, Nq queries, Nk keys, D head dim.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import multihead as mh
from tests.numerics import TOL

ENTRIES = [pytest.param(mh.attention, id="attention"), pytest.param(mh.explain, id="explain")]


def qkv(B=2, Hq=4, Hkv=2, Nq=4, Nk=5, D=8, Dv=None, dtype=torch.float32):
    q = torch.randn(B, Hq, Nq, D, dtype=dtype)
    k = torch.randn(B, Hkv, Nk, D, dtype=dtype)
    v = torch.randn(B, Hkv, Nk, D if Dv is None else Dv, dtype=dtype)
    return q, k, v


def esc(*parts: object) -> str:
    """A regex matching the parts in order, with anything between them."""
    return ".*".join(re.escape(str(p)) for p in parts)


# -- q, k, v -------------------------------------------------------------------------------------------------
def _retype(t, dtype):
    return t.to(dtype) if dtype.is_floating_point else (t * 10).to(dtype)


QKV_CASES = {
    "q rank 3": (lambda q, k, v: (q[0], k, v), esc("q must have 4 dims", "got 3 dims (4, 4, 8)")),
    "k rank 5": (lambda q, k, v: (q, k[None], v), esc("k must have 4 dims", "got 5 dims (1, 2, 2, 5, 8)")),
    "v rank 2": (lambda q, k, v: (q, k, v[0, 0]), esc("v must have 4 dims", "(5, 8)")),
    "dtype mismatch": (
        lambda q, k, v: (q, k.double(), v),
        esc("dtypes differ", "torch.float32, torch.float64, torch.float32"),
    ),
    "half vs bf16": (
        lambda q, k, v: (q.half(), k.half(), v.bfloat16()),
        esc("dtypes differ", "torch.float16, torch.float16, torch.bfloat16"),
    ),
    "int q": (lambda q, k, v: (_retype(q, torch.int64), k, v), esc("q must be float", "got torch.int64")),
    "int all": (
        lambda q, k, v: tuple(_retype(t, torch.int32) for t in (q, k, v)),
        esc("q must be float", "torch.int32"),
    ),
    "bool v": (lambda q, k, v: (q, k, v > 0), esc("v must be float", "torch.bool")),
    "Hq not divisible by Hkv": (
        lambda q, k, v: (q[:, :3], k, v),
        esc("Hq (3) must be divisible by kv heads Hkv (2)"),
    ),
    "Hkv k vs v": (lambda q, k, v: (q, k, v[:, :1]), esc("k has 2 heads but v has 1")),
    "head dim mismatch": (lambda q, k, v: (q, k[..., :5], v), esc("q has D=8, k has D=5")),
    "Nk mismatch": (lambda q, k, v: (q, k, v[:, :, :3]), esc("k has Nk=5", "v has 3")),
    "batch mismatch q": (lambda q, k, v: (q[:1], k, v), esc("batch sizes differ", "q 1, k 2, v 2")),
    "batch mismatch v": (lambda q, k, v: (q, k, torch.cat([v, v])), esc("q 2, k 2, v 4")),
    "Nk zero": (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), esc("Nk=0")),
    "D zero": (lambda q, k, v: (q[..., :0], k[..., :0], v), esc("D=0")),
    "not a tensor": (lambda q, k, v: (q.tolist(), k, v), esc("q must be a torch.Tensor, got list")),
}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", list(QKV_CASES))
def test_bad_qkv(entry, case):
    make, pattern = QKV_CASES[case]
    with pytest.raises(ValueError, match=pattern):
        entry(*make(*qkv()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device mismatch needs a CUDA device; none here")
@pytest.mark.parametrize("entry", ENTRIES)
def test_device_mismatch(entry):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=esc("different devices", "cpu", "cuda")):
        entry(q, k.cuda(), v)


# -- masks ---------------------------------------------------------------------------------------------------
# qkv(): B=2, Hq=4, Hkv=2, Nq=4, Nk=5 -> target (B, Hq, Nq, Nk) = (2, 4, 4, 5)
TARGET = "(B, Hq, Nq, Nk)=(2, 4, 4, 5)"
MASK_CASES = {
    "bool tensor wrong Nk": (lambda: torch.ones(4, 6, dtype=torch.bool), esc("mask of shape (4, 6)", TARGET)),
    "bool tensor wrong B": (
        lambda: torch.ones(3, 1, 1, 5, dtype=torch.bool),
        esc("mask of shape (3, 1, 1, 5)", TARGET),
    ),
    "bool tensor wrong H": (lambda: torch.ones(2, 4, 5, dtype=torch.bool), esc("(2, 4, 5)", TARGET)),
    "bool tensor kv heads": (
        lambda: torch.ones(1, 2, 4, 5, dtype=torch.bool),
        esc("mask of shape (1, 2, 4, 5)", TARGET),
    ),
    "bool tensor 5 dims": (lambda: torch.ones(1, 2, 4, 4, 5, dtype=torch.bool), esc("5 dims", TARGET)),
    "float tensor mask": (lambda: torch.zeros(4, 5), esc("must be bool", "got torch.float32", "bias=")),
    "int tensor mask": (lambda: torch.ones(4, 5, dtype=torch.int64), esc("must be bool", "torch.int64")),
    "string mask": (lambda: "causal", esc("mask must be a multihead Mask or a bool tensor, got str")),
    "padding too few": (
        lambda: mh.padding([3]),
        esc("padding lengths has 1 entries but the batch size is 2"),
    ),
    "padding too many": (lambda: mh.padding([1, 2, 3]), esc("has 3 entries", "batch size is 2")),
    "padding > Nk": (lambda: mh.padding([3, 9]), esc("padding lengths [3, 9] exceed", "Nk=5")),
    "padding in a composition": (
        lambda: mh.causal() & ~mh.padding([6, 1]),
        esc("padding lengths [6, 1] exceed", "Nk=5"),
    ),
    "document wrong length": (lambda: mh.document([0, 0, 1, 1]), esc("shape (1, 4)", "B=2, Nk=5")),
    "document wrong batch": (lambda: mh.document(torch.zeros(3, 5, dtype=torch.long)), esc("(3, 5)", "B=2")),
    "key_padding wrong Nk": (
        lambda: mh.key_padding(torch.ones(2, 4, dtype=torch.bool)),
        esc("key_padding mask has shape (2, 4)", "(B, Nk) = (2, 5)"),
    ),
    "key_padding wrong B": (
        lambda: mh.key_padding(torch.ones(1, 5, dtype=torch.bool)),
        esc("(1, 5)", "(2, 5)"),
    ),
}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", list(MASK_CASES))
def test_bad_mask(entry, case):
    make, pattern = MASK_CASES[case]
    with pytest.raises(ValueError, match=pattern):
        entry(*qkv(), mask=make())


CONSTRUCTOR_CASES = {
    "sliding_window(0)": (
        lambda: mh.sliding_window(0),
        esc("sliding_window size must be an int >= 1, got 0"),
    ),
    "sliding_window(-3)": (lambda: mh.sliding_window(-3), esc("got -3")),
    "sliding_window(2.5)": (lambda: mh.sliding_window(2.5), esc("got 2.5")),
    "padding negative": (lambda: mh.padding([2, -1]), esc("padding lengths must be >= 0, got [2, -1]")),
    "padding float": (lambda: mh.padding([2.0, 3.0]), esc("1-D integer tensor", "torch.float32")),
    "padding 2-D": (lambda: mh.padding([[2, 3]]), esc("shape (1, 2)")),
    "document float ids": (lambda: mh.document([0.0, 1.0]), esc("integer tensor", "torch.float32")),
    "document 3-D ids": (lambda: mh.document(torch.zeros(1, 1, 4, dtype=torch.long)), esc("shape (1, 1, 4)")),
    "key_padding float": (
        lambda: mh.key_padding(torch.ones(2, 5)),
        esc("bool tensor of shape (B, Nk)", "got (2, 5) of dtype torch.float32", ".bool()"),
    ),
    "key_padding 1-D": (lambda: mh.key_padding(torch.ones(5, dtype=torch.bool)), esc("got (5,)")),
    "key_padding list": (lambda: mh.key_padding([[True, False]]), esc("(B, Nk)", "got list")),
    "prefix_lm(-1)": (lambda: mh.prefix_lm(-1), esc("prefix_lm length must be an int >= 0, got -1")),
    "custom not callable": (lambda: mh.custom(3), esc("callable", "got int")),
    "alibi(0)": (lambda: mh.alibi(0), esc("alibi n_heads must be an int >= 1, got 0")),
    "alibi(True)": (lambda: mh.alibi(True), esc("got True")),
    "alibi(4.0)": (lambda: mh.alibi(4.0), esc("got 4.0")),
    "softcap(0)": (lambda: mh.softcap(0), esc("cap must be a finite number > 0, got 0")),
    "softcap(-1.5)": (lambda: mh.softcap(-1.5), esc("got -1.5")),
    "softcap(inf)": (lambda: mh.softcap(math.inf), esc("got inf")),
    "softcap(nan)": (lambda: mh.softcap(math.nan), esc("got nan")),
    "custom_bias not callable": (lambda: mh.custom_bias("x"), esc("callable", "got str")),
    "sliding_window(10**30)": (
        lambda: mh.sliding_window(10**30),
        esc("sliding_window size must be at most 2**62", "got 1000000000000000000000000000000"),
    ),
    "prefix_lm(2**63)": (lambda: mh.prefix_lm(2**63), esc("prefix_lm length must be at most 2**62")),
    "alibi(10**30)": (lambda: mh.alibi(10**30), esc("alibi n_heads must be at most 65536")),
    "padding past int64": (
        lambda: mh.padding([10**30]),
        esc("padding lengths must be a tensor or a list of ints that fit in int64"),
    ),
    "document ids past int64": (
        lambda: mh.document([0, 2**64]),
        esc("document ids must be a tensor or a list"),
    ),
    "ragged padding": (lambda: mh.padding([[1], [1, 2]]), esc("padding lengths must be a tensor or a list")),
}


@pytest.mark.parametrize("case", list(CONSTRUCTOR_CASES))
def test_bad_constructor_arguments(case):
    make, pattern = CONSTRUCTOR_CASES[case]
    with pytest.raises(ValueError, match=pattern):
        make()


# -- biases --------------------------------------------------------------------------------------------------
BIAS_CASES = {
    "tensor wrong Nq": (lambda: torch.zeros(3, 5), esc("bias of shape (3, 5)", TARGET)),
    "tensor wrong B": (lambda: torch.zeros(3, 4, 4, 5), esc("bias of shape (3, 4, 4, 5)", TARGET)),
    "tensor kv heads": (lambda: torch.zeros(2, 1, 1), esc("bias of shape (2, 1, 1)", TARGET)),
    "tensor 5 dims": (lambda: torch.zeros(1, 1, 1, 4, 5), esc("5 dims", "(1, 1, 1, 4, 5)", TARGET)),
    "bool tensor as bias": (
        lambda: torch.ones(4, 5, dtype=torch.bool),
        esc("bias must be floating point, got torch.bool", "mask="),
    ),
    "int tensor as bias": (lambda: torch.ones(4, 5, dtype=torch.int32), esc("torch.int32")),
    "number as bias": (lambda: 1.0, esc("bias must be a multihead Bias or a float tensor, got float")),
    "alibi head count": (lambda: mh.alibi(2), esc("alibi was built for 2 heads", "Hq=4", "mh.alibi(4)")),
    "alibi in a chain": (lambda: mh.softcap(3.0) + mh.alibi(8), esc("built for 8 heads", "Hq=4")),
    "bad tensor in a chain": (lambda: mh.alibi(4) + torch.zeros(7), esc("bias of shape (7,)", TARGET)),
}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", list(BIAS_CASES))
def test_bad_bias(entry, case):
    make, pattern = BIAS_CASES[case]
    with pytest.raises(ValueError, match=pattern):
        entry(*qkv(), bias=make())


# -- other arguments -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("backend", ["fast", "Matrix", "", None])
def test_unknown_backend_lists_valid_ones(entry, backend):
    valid = ", ".join(["auto", *mh.backends()])
    with pytest.raises(ValueError, match=esc(f"unknown backend {backend!r}", valid)):
        entry(*qkv(), backend=backend)
    for name in ("reference", "matrix", "sdpa", "tiled"):
        assert name in mh.backends()


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, math.nan, math.inf])
def test_dropout_outside_unit_interval(entry, p):
    with pytest.raises(ValueError, match=esc(f"dropout_p must be in [0, 1), got {p!r}")):
        entry(*qkv(), dropout_p=p)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf, "0.5"])
def test_scale_must_be_finite(entry, scale):
    with pytest.raises(ValueError, match=esc(f"scale must be a finite number, got {scale!r}")):
        entry(*qkv(), scale=scale)


@pytest.mark.parametrize("backend", ["sdpa", "tiled"])
def test_return_weights_needs_a_dense_backend(backend):
    with pytest.raises(ValueError, match=esc(f"backend '{backend}' cannot return", "weights", "matrix")):
        mh.attention(*qkv(), backend=backend, return_weights=True)


def test_return_lse_with_sdpa():
    with pytest.raises(ValueError, match=esc("backend 'sdpa' cannot return weights or lse")):
        mh.attention(*qkv(), backend="sdpa", return_lse=True)


def test_non_additive_bias_with_sdpa():
    with pytest.raises(ValueError, match=esc("backend 'sdpa' cannot apply softcap(2.0)", "'tiled'")):
        mh.attention(*qkv(), backend="sdpa", bias=mh.softcap(2.0))


@pytest.mark.parametrize("backend", ["reference", "matrix", "sdpa", "tiled"])
def test_custom_fn_returning_wrong_dtype(backend):
    def int_mask(b, h, q, k):
        return (k <= q).long()

    def bool_bias(b, h, q, k):
        return k <= q

    with pytest.raises(
        ValueError, match=esc("custom mask fn 'int_mask' must return a bool tensor, got torch.int64")
    ):
        mh.attention(*qkv(), mask=mh.custom(int_mask), backend=backend)
    with pytest.raises(ValueError, match=esc("custom_bias fn 'bool_bias' must return a float", "torch.bool")):
        mh.attention(*qkv(), bias=mh.custom_bias(bool_bias), backend=backend)


def test_valid_edge_arguments_are_accepted():
    q, k, v = qkv(Dv=3)  # Dv != D is allowed
    assert mh.attention(q, k, v, scale=0.0, backend="matrix").shape == (2, 4, 4, 3)
    assert mh.attention(q, k, v, dropout_p=0.0).shape == (2, 4, 4, 3)
    assert mh.attention(q, k, v, mask=mh.padding([0, 5]), bias=torch.zeros(5)).shape == (2, 4, 4, 3)
    assert "auto ->" in mh.explain(q, k, v, mask=mh.sliding_window(1), bias=mh.alibi(4))


# -- empty rows: zeros, zero gradients, lse = -inf -------------------------------------------------------
EMPTY_CASES = {
    # (Nq, Nk, mask, which (b, q) rows are empty); heads are all alike
    "padding with a 0 length": (4, 5, mh.padding([0, 3]), lambda b, i: b == 0),
    "causal Nq > Nk": (7, 3, mh.causal(), lambda b, i: i < 4),
    "document Nq > Nk": (5, 3, mh.document([0, 1, 1]), lambda b, i: i < 2),
    "window & key_padding": (
        4,
        4,
        mh.sliding_window(2) & mh.key_padding(torch.tensor([[True, False, False, True], [True] * 4])),
        lambda b, i: b == 0 and i == 2,
    ),
}


def _empty_rows(Nq, is_empty):
    return torch.tensor([[is_empty(b, i) for i in range(Nq)] for b in range(2)])  # (B, Nq)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend", mh.backends())
@pytest.mark.parametrize("case", list(EMPTY_CASES))
def test_empty_rows_give_zeros_and_zero_gradients(case, backend, dtype):
    if backend == "triton":
        pytest.skip(
            "triton takes no float64 and no bias gradient; test_triton_backend.py checks its empty rows"
        )
    Nq, Nk, mask, is_empty = EMPTY_CASES[case]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, Nq, 8, dtype=dtype, generator=g).requires_grad_(True)
    k = torch.randn(2, 2, Nk, 8, dtype=dtype, generator=g).requires_grad_(True)
    v = torch.randn(2, 2, Nk, 8, dtype=dtype, generator=g).requires_grad_(True)
    bias = torch.randn(2, 4, Nq, Nk, dtype=dtype, generator=g).requires_grad_(True)
    empty = _empty_rows(Nq, is_empty)[:, None, :]  # (B, 1, Nq)
    assert bool(empty.any()) and not bool(empty.all())
    for b in (None, bias):
        out = mh.attention(q, k, v, mask=mask, bias=b, backend=backend)
        (out * torch.randn(out.shape, dtype=dtype, generator=g)).sum().backward()
        grads = {"q": q.grad, "k": k.grad, "v": v.grad, "bias": bias.grad if b is not None else None}
        assert torch.isfinite(out).all(), backend
        assert bool((out[empty.expand(2, 4, Nq)] == 0).all())
        assert bool(out[~empty.expand(2, 4, Nq)].abs().sum() > 0)
        for name, grad in grads.items():
            if grad is not None:
                assert torch.isfinite(grad).all(), (backend, name)
        assert bool((q.grad[empty.expand(2, 4, Nq)] == 0).all())
        if b is not None:
            assert bool((bias.grad[empty.expand(2, 4, Nq)] == 0).all())
        for t in (q, k, v, bias):
            t.grad = None


@pytest.mark.parametrize("backend", mh.backends())
@pytest.mark.parametrize("case", list(EMPTY_CASES))
def test_empty_rows_lse_is_minus_inf(case, backend):
    if backend == "triton":
        pytest.skip(
            "triton takes no float64 and no bias gradient; test_triton_backend.py checks its empty rows"
        )
    Nq, Nk, mask, is_empty = EMPTY_CASES[case]
    q, k, v = qkv(Nq=Nq, Nk=Nk, dtype=torch.float64)
    try:
        res = mh.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
    except ValueError as e:  # a backend that cannot return the lse must say so
        assert "lse" in str(e), e
        return
    empty = _empty_rows(Nq, is_empty)[:, None, :].expand(2, 4, Nq)  # (B, Hq, Nq)
    assert res.lse.shape == (2, 4, Nq)
    assert bool((res.lse[empty] == -math.inf).all()), backend
    assert bool(torch.isfinite(res.lse[~empty]).all()), backend
    assert bool((res.out[empty] == 0).all())
    # lse of the rows with keys: log of the sum of exp(scores) over the allowed keys (computed here)
    allowed = mask.dense(2, 4, Nq, Nk)
    s = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) / math.sqrt(8)
    want = torch.logsumexp(s.masked_fill(~allowed, -math.inf), dim=-1)
    assert torch.allclose(res.lse[~empty], want[~empty], atol=TOL[torch.float64], rtol=0)
