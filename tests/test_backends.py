"""Every backend against the float64 ``reference`` over a dense grid, under the numerics rule of DESIGN.md.

Grid: MHA/GQA/MQA; head dims 16 and 59; lengths 1, 113, 1023; Nq != Nk both ways; every mask and bias
alone and combined; fp32 and bf16; the tiled kernel with its default blocks and with small blocks (so
partial, full and skipped tiles all occur).
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.backends.registry import get as get_backend
from multihead.backends.tiled import backend as tiled_backend
from multihead.core.problem import make_problem
from tests.numerics import allowed, max_err

FAST = ["matrix", "sdpa", "tiled"]

HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def _masks(B: int, Nq: int, Nk: int) -> dict[str, mh.Mask | None]:
    g = torch.Generator().manual_seed(Nq * 31 + Nk)
    lengths = torch.randint(1, Nk + 1, (B,), generator=g)
    kp = torch.rand(B, Nk, generator=g) > 0.3
    kp[:, -1] = True
    docs = torch.sort(torch.randint(0, 3, (Nk,), generator=g)).values
    return {
        "none": None,
        "causal": mh.causal(),
        "window": mh.sliding_window(17),
        "padding": mh.padding(lengths),
        "key_padding": mh.key_padding(kp),
        "document": mh.document(docs) & mh.causal(),
        "prefix_lm": mh.prefix_lm(min(5, Nk)),
        "custom": mh.custom(lambda b, h, q, k: (q + k + h) % 3 != 0),
        "combined": (mh.causal() & mh.padding(lengths)) | ~mh.sliding_window(3),
    }


def _biases(Hq: int, B: int, Nq: int, Nk: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(7)
    return {
        "none": None,
        "alibi": mh.alibi(Hq),
        "softcap": mh.softcap(2.0),
        "tensor": torch.randn(1, Hq, Nq, Nk, generator=g),
        "alibi+softcap": mh.alibi(Hq) + mh.softcap(5.0),
        "custom": mh.custom_bias(lambda b, h, q, k: -0.1 * (q - k).abs().float() * (h + 1)),
    }


@pytest.fixture(params=[(128, 128), (32, 16)], ids=["blocks128", "blocks32x16"])
def tiled_blocks(request, monkeypatch):
    bq, bk = request.param
    monkeypatch.setattr(tiled_backend.BACKEND, "block_q", bq)
    monkeypatch.setattr(tiled_backend.BACKEND, "block_k", bk)
    return request.param


def _inputs(B, Hq, Hkv, Nq, Nk, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Nk, Dv, generator=g).to(dtype)
    return q, k, v


def _cast_bias(bias, dtype):
    return bias.to(dtype) if isinstance(bias, torch.Tensor) else bias


@torch.no_grad()
def _check_forward(q, k, v, mask, bias, backends=FAST):
    """Each backend's error vs gold <= 2x the same-dtype matrix error (floor 1e-5)."""
    gold = mh.attention(
        q.double(),
        k.double(),
        v.double(),
        mask=mask,
        bias=_cast_bias(bias, torch.float64),
        backend="reference",
    )
    assert torch.isfinite(gold).all()
    b = _cast_bias(bias, q.dtype)
    base = max_err(mh.attention(q, k, v, mask=mask, bias=b, backend="matrix"), gold)
    for name in backends:
        p = make_problem(q, k, v, mask=mask, bias=b)
        if get_backend(name).why_not(p) is not None:
            continue  # e.g. sdpa has no soft-cap; covered by `auto` tests
        out = mh.attention(q, k, v, mask=mask, bias=b, backend=name)
        assert out.dtype == q.dtype and out.shape == gold.shape
        err = max_err(out, gold)
        assert err <= allowed(base), (
            f"{name}: err {err:.3e} > allowed {allowed(base):.3e} (matrix {base:.3e})"
        )


SHAPES = [(1, 1), (1, 113), (113, 113), (113, 37), (37, 113)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("nq_nk", SHAPES, ids=[f"{a}x{b}" for a, b in SHAPES])
@pytest.mark.parametrize("mask_name", list(_masks(2, 4, 4)))
def test_masks_grid(tiled_blocks, dtype, heads, nq_nk, mask_name):
    Hq, Hkv = heads
    Nq, Nk = nq_nk
    D = 59 if Hkv == 2 else 16
    q, k, v = _inputs(2, Hq, Hkv, Nq, Nk, D, D + 5, dtype)
    _check_forward(q, k, v, _masks(2, Nq, Nk)[mask_name], None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("nq_nk", [(113, 113), (37, 113), (1, 113)], ids=["113x113", "37x113", "1x113"])
@pytest.mark.parametrize("mask_name", ["none", "causal", "document", "padding"])
@pytest.mark.parametrize("bias_name", [b for b in _biases(4, 2, 1, 1) if b != "none"])
def test_bias_grid(tiled_blocks, dtype, nq_nk, mask_name, bias_name):
    Nq, Nk = nq_nk
    q, k, v = _inputs(2, 4, 2, Nq, Nk, 32, 32, dtype, seed=1)
    _check_forward(q, k, v, _masks(2, Nq, Nk)[mask_name], _biases(4, 2, Nq, Nk)[bias_name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask_name", ["none", "causal", "window", "document"])
def test_long_1023(dtype, mask_name):
    q, k, v = _inputs(1, 4, 1, 1023, 1023, 59, 59, dtype, seed=2)
    _check_forward(q, k, v, _masks(1, 1023, 1023)[mask_name], None)


def _grads(q, k, v, mask, bias, backend, dout):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    tb = bias.detach().requires_grad_(True) if isinstance(bias, torch.Tensor) else None
    out = mh.attention(q, k, v, mask=mask, bias=tb if tb is not None else bias, backend=backend)
    wrt = [q, k, v] + ([tb] if tb is not None else [])
    return torch.autograd.grad((out.double() * dout).sum(), wrt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize(
    "case",
    [
        ("causal", "none"),
        ("window", "alibi"),
        ("document", "softcap"),
        ("padding", "tensor"),
        ("none", "alibi+softcap"),
        ("combined", "none"),
    ],
    ids=lambda c: f"{c[0]}-{c[1]}",
)
def test_gradients_grid(tiled_blocks, dtype, heads, case):
    """Gradients of every backend vs gold: <= 3x the same-dtype matrix error (floor 1e-5)."""
    Hq, Hkv = heads
    Nq, Nk = 67, 113
    q, k, v = _inputs(2, Hq, Hkv, Nq, Nk, 24, 24, dtype, seed=3)
    mask = _masks(2, Nq, Nk)[case[0]]
    bias = _biases(Hq, 2, Nq, Nk)[case[1]]
    dout = torch.randn(2, Hq, Nq, 24, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    gold = _grads(
        q.double(), k.double(), v.double(), mask, _cast_bias(bias, torch.float64), "reference", dout
    )
    b = _cast_bias(bias, dtype)
    base = _grads(q, k, v, mask, b, "matrix", dout)
    for name in FAST:
        if get_backend(name).why_not(make_problem(q, k, v, mask=mask, bias=b)):
            continue
        got = _grads(q, k, v, mask, b, name, dout)
        for i, (g_got, g_base, g_gold) in enumerate(zip(got, base, gold)):
            err, lim = max_err(g_got, g_gold), allowed(max_err(g_base, g_gold), grad=True)
            assert err <= lim, f"{name} grad #{i}: err {err:.3e} > allowed {lim:.3e}"


GRADCHECK_CASES = [
    ("causal", None),
    ("window", "alibi"),
    ("padding", "softcap"),
    ("document", "tensor"),
    ("combined", "alibi+softcap"),
]


@pytest.mark.parametrize("backend", ["reference", *FAST])
@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_gradcheck_float64(backend, case, monkeypatch):
    monkeypatch.setattr(tiled_backend.BACKEND, "block_q", 4)
    monkeypatch.setattr(tiled_backend.BACKEND, "block_k", 3)
    B, Hq, Hkv, Nq, Nk, D = 1, 2, 1, 5, 9, 3
    q, k, v = (t.requires_grad_(True) for t in _inputs(B, Hq, Hkv, Nq, Nk, D, D, torch.float64, seed=5))
    mask = _masks(B, Nq, Nk)[case[0]]
    bias = None if case[1] is None else _biases(Hq, B, Nq, Nk)[case[1]]
    inputs = [q, k, v]
    if isinstance(bias, torch.Tensor):
        bias = bias.double().requires_grad_(True)
        inputs.append(bias)
    p = make_problem(q, k, v, mask=mask, bias=bias)
    if backend != "reference" and get_backend(backend).why_not(p):
        pytest.skip(f"{backend} does not serve this case: {get_backend(backend).why_not(p)}")

    def fn(*xs):
        b = xs[3] if len(xs) > 3 else bias
        return mh.attention(xs[0], xs[1], xs[2], mask=mask, bias=b, backend=backend)

    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["matrix", "tiled"])
def test_gradcheck_with_dropout(backend, monkeypatch):
    """Dropout masks replay exactly under a fixed seed, so the backward can be checked numerically."""
    monkeypatch.setattr(tiled_backend.BACKEND, "block_q", 4)
    monkeypatch.setattr(tiled_backend.BACKEND, "block_k", 3)
    q, k, v = (t.requires_grad_(True) for t in _inputs(1, 2, 2, 6, 7, 3, 3, torch.float64, seed=6))

    def fn(q, k, v):
        torch.manual_seed(123)
        return mh.attention(q, k, v, mask=mh.causal(), dropout_p=0.3, backend=backend)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["reference", "matrix", "sdpa", "tiled"])
def test_dropout_is_unbiased(backend):
    """E[dropout attention] = attention: the mean over many draws approaches the exact output."""
    torch.manual_seed(0)
    q, k, v = _inputs(1, 2, 2, 8, 16, 8, 8, torch.float64, seed=7)
    exact = mh.attention(q, k, v, mask=mh.causal(), backend="reference")
    draws = torch.stack(
        [mh.attention(q, k, v, mask=mh.causal(), dropout_p=0.25, backend=backend) for _ in range(2000)]
    )
    assert not torch.equal(draws[0], draws[1])
    assert max_err(draws.mean(0), exact) < 0.08


@pytest.mark.parametrize("backend", ["reference", "matrix", "tiled"])
@pytest.mark.parametrize("mask_name", ["causal", "padding", "window"])
def test_lse(backend, mask_name):
    q, k, v = _inputs(2, 4, 2, 37, 113, 16, 16, torch.float32, seed=8)
    mask = _masks(2, 37, 113)[mask_name]
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double().repeat_interleave(2, dim=1)) / 4.0
    s = s.masked_fill(~mask.dense(2, 4, 37, 113), float("-inf"))
    res = mh.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
    assert res.lse is not None and res.lse.shape == (2, 4, 37)
    assert max_err(res.lse, torch.logsumexp(s, dim=-1)) < 1e-4


def test_return_weights_match_reference():
    q, k, v = _inputs(2, 4, 1, 13, 21, 8, 8, torch.float32, seed=9)
    mask = mh.sliding_window(5)
    ref = mh.attention(q, k, v, mask=mask, backend="reference", return_weights=True)
    got = mh.attention(q, k, v, mask=mask, return_weights=True)  # auto -> matrix
    assert got.weights is not None and got.weights.shape == (2, 4, 13, 21)
    assert max_err(got.weights, ref.weights) < 1e-6
    rows = got.weights.sum(-1)
    assert torch.allclose(rows, torch.ones_like(rows))


def test_no_repeat_gqa_equals_repeated_mha():
    """GQA through every backend equals MHA with K/V repeated per group (HF repeat_kv order)."""
    q, k, v = _inputs(2, 6, 2, 19, 23, 8, 8, torch.float64, seed=10)
    k_rep, v_rep = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    for name in mh.backends():
        if name == "triton":  # float64 is not a kernel dtype; test_triton_backend.py checks its GQA
            continue
        rows = q[:, :, -8:] if name == "decode" else q  # decode serves decode steps: at most 16 query rows
        a = mh.attention(rows, k, v, mask=mh.causal(), backend=name)
        b = mh.attention(rows, k_rep, v_rep, mask=mh.causal(), backend="reference")
        assert max_err(a, b) < 1e-12, name


def test_sdpa_matches_torch_directly():
    """Our sdpa adapter and a direct torch call agree where their semantics coincide (Nq == Nk causal)."""
    q, k, v = _inputs(2, 4, 4, 31, 31, 16, 16, torch.float32, seed=11)
    ours = mh.attention(q, k, v, mask=mh.causal(), backend="sdpa")
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(ours, theirs)


def test_bottom_right_causal_differs_from_torch_top_left():
    """For Nq < Nk our causal is bottom-right; torch's is_causal is top-left - we never pass it there."""
    q, k, v = _inputs(1, 2, 2, 3, 8, 16, 16, torch.float64, seed=12)
    ours = mh.attention(q, k, v, mask=mh.causal(), backend="sdpa")
    bottom_right = torch.ones(3, 8, dtype=torch.bool).tril(diagonal=8 - 3)
    expect = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bottom_right)
    assert max_err(ours, expect) < 1e-12
