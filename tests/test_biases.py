"""Biases and score modifiers: ALiBi against the paper's slopes, soft-capping, user functions and tensors,
chaining left to right, and gradients into a tensor bias through every backend.

Expected values are computed here in float64 from the formulas, not with the library's code.
Shape legend: B batch, H (query) heads, Nq queries, Nk keys, D head dim.
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from multihead.core.biases import as_bias
from multihead.core.masks import MaskContext
from tests.numerics import TOL

F64 = torch.float64
ATOL = TOL[F64]
DENSE_BACKENDS = ("reference", "matrix", "tiled")  # every kind of modifier
ADDITIVE_BACKENDS = (*DENSE_BACKENDS, "sdpa")  # sdpa takes additive biases only


def press_get_slopes(n: int) -> list[float]:
    """ALiBi slopes exactly as in Press et al.'s reference code (attention_with_linear_biases)."""

    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + press_get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


def qkv(B=2, Hq=4, Hkv=None, Nq=5, Nk=7, D=8, *, seed=0, scale_q=1.0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    Hkv = Hq if Hkv is None else Hkv
    q = torch.randn(B, Hq, Nq, D, dtype=F64, generator=g) * scale_q
    k = torch.randn(B, Hkv, Nk, D, dtype=F64, generator=g)
    v = torch.randn(B, Hkv, Nk, D, dtype=F64, generator=g)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def manual(q, k, v, modify, allowed=None, scale=None):
    """softmax(modify(q k^T * scale)) v in float64, GQA by repeating kv heads; zeros on empty rows."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = modify((q @ k.transpose(-1, -2)) * scale)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v


def max_err(a, b):
    return (a - b).abs().max().item()


# -- ALiBi ---------------------------------------------------------------------------------------------
def test_alibi_slopes_for_8_heads_are_powers_of_one_half():
    want = torch.tensor([2.0**-i for i in range(1, 9)], dtype=F64)
    got = mh.alibi_slopes(8)
    assert got.dtype == F64 and got.shape == (8,)
    assert torch.equal(got, want)


@pytest.mark.parametrize("n", range(1, 34))
def test_alibi_slopes_match_press_reference(n):
    want = torch.tensor(press_get_slopes(n), dtype=F64)
    got = mh.alibi_slopes(n)
    assert got.shape == (n,)
    assert torch.allclose(got, want, rtol=1e-14, atol=0), (got, want)


def test_alibi_slopes_non_powers_of_two_interleave():
    # 6 heads: the 4 slopes of n=4 (1/4, 1/16, 1/64, 1/256), then every other slope of n=8 (1/2, 1/8)
    assert mh.alibi_slopes(6).tolist() == [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]
    s12 = mh.alibi_slopes(12).tolist()
    assert s12[:8] == [2.0**-i for i in range(1, 9)]
    assert s12[8:] == pytest.approx([2.0 ** (-(2 * i + 1) / 2) for i in range(4)], rel=1e-15)


@pytest.mark.parametrize(("Nq", "Nk"), [(5, 5), (2, 7), (7, 3)])
@pytest.mark.parametrize("H", [8, 6, 12])
def test_alibi_values_bottom_right(H, Nq, Nk):
    slopes = press_get_slopes(H)
    off = Nk - Nq
    want = torch.tensor(
        [[[-slopes[h] * abs(i + off - j) for j in range(Nk)] for i in range(Nq)] for h in range(H)], dtype=F64
    )
    got = mh.alibi(H).natural(MaskContext(2, H, Nq, Nk), dtype=F64)
    assert got.shape[-3:] == (H, Nq, Nk)
    assert max_err(got.expand(2, H, Nq, Nk), want.expand(2, H, Nq, Nk)) <= ATOL


@pytest.mark.parametrize("backend", ADDITIVE_BACKENDS)
@pytest.mark.parametrize(("Hq", "Hkv", "Nq", "Nk"), [(6, 6, 5, 5), (12, 4, 3, 9), (8, 1, 9, 4)])
def test_alibi_in_attention_matches_manual(backend, Hq, Hkv, Nq, Nk):
    q, k, v = qkv(Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk)
    slopes = torch.tensor(press_get_slopes(Hq), dtype=F64).view(1, Hq, 1, 1)
    dist = (torch.arange(Nq).view(-1, 1) + (Nk - Nq) - torch.arange(Nk).view(1, -1)).abs().to(F64)
    want = manual(q, k, v, lambda s: s - slopes * dist, allowed=torch.ones(Nq, Nk).tril(Nk - Nq).bool())
    got = mh.attention(q, k, v, bias=mh.alibi(Hq), mask=mh.causal(), backend=backend)
    assert max_err(got, want) <= ATOL, (backend, max_err(got, want))


# -- soft-capping ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cap", [0.5, 5.0, 30.0])
def test_softcap_through_matrix_matches_manual(cap):
    q, k, v = qkv(scale_q=8.0)  # scores well beyond the cap
    want = manual(q, k, v, lambda s: cap * torch.tanh(s / cap))
    got = mh.attention(q, k, v, bias=mh.softcap(cap), backend="matrix")
    assert max_err(got, want) <= ATOL
    # the cap changes the result (the test is not vacuous), and every dense backend agrees
    assert max_err(got, manual(q, k, v, lambda s: s)) > 1e-3
    for backend in DENSE_BACKENDS:
        out = mh.attention(q, k, v, bias=mh.softcap(cap), backend=backend)
        assert max_err(out, want) <= ATOL, backend


def test_softcap_bounds_the_scores():
    # With a tiny cap every score lies in (-cap, cap), so weights are within exp(+-2 cap) of uniform.
    q, k, v = qkv(Nq=4, Nk=6, scale_q=50.0)
    cap = 0.1
    w = mh.attention(q, k, v, bias=mh.softcap(cap), backend="matrix", return_weights=True).weights
    assert float(w.max()) <= math.exp(2 * cap) / 6 + ATOL
    assert float(w.min()) >= math.exp(-2 * cap) / 6 - ATOL


# -- custom and tensor biases ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ADDITIVE_BACKENDS)
def test_custom_bias_uses_raw_indices(backend):
    B, H, Nq, Nk = 2, 3, 3, 6

    def fn(b, h, q, k):
        return 0.25 * (q - k).double() * (h + 1) + 0.5 * b

    q, k, v = qkv(B=B, Hq=H, Nq=Nq, Nk=Nk)
    table = torch.tensor(
        [
            [[[0.25 * (i - j) * (h + 1) + 0.5 * b for j in range(Nk)] for i in range(Nq)] for h in range(H)]
            for b in range(B)
        ],
        dtype=F64,
    )
    want = manual(q, k, v, lambda s: s + table)
    got = mh.attention(q, k, v, bias=mh.custom_bias(fn), backend=backend)
    assert max_err(got, want) <= ATOL


TENSOR_SHAPES = [(5, 7), (7,), (), (1, 4, 5, 7), (2, 1, 1, 7), (2, 4, 5, 7), (4, 1, 1), (2, 1, 5, 1)]


@pytest.mark.parametrize("backend", ADDITIVE_BACKENDS)
@pytest.mark.parametrize("shape", TENSOR_SHAPES, ids=str)
def test_tensor_bias_broadcasts(backend, shape):
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=5, Nk=7)
    t = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(7))
    want = manual(q, k, v, lambda s: s + t)  # torch broadcasting is the outside reference
    got = mh.attention(q, k, v, bias=t, backend=backend)
    assert max_err(got, want) <= ATOL


def test_float32_tensor_bias_with_float64_inputs():
    q, k, v = qkv()
    t = torch.randn(5, 7)
    want = manual(q, k, v, lambda s: s + t.double())
    for backend in ADDITIVE_BACKENDS:
        assert max_err(mh.attention(q, k, v, bias=t, backend=backend), want) <= ATOL, backend


# -- chaining ---------------------------------------------------------------------------------------------
def _bias_table(H, Nq, Nk):
    return torch.linspace(-3, 3, H * Nq * Nk, dtype=F64).view(1, H, Nq, Nk)


@pytest.mark.parametrize("backend", DENSE_BACKENDS)
def test_chain_applies_left_to_right(backend):
    H, Nq, Nk, cap = 4, 5, 7, 2.0
    q, k, v = qkv(Hq=H, Nq=Nq, Nk=Nk, scale_q=3.0)
    t = _bias_table(H, Nq, Nk)
    custom = mh.custom_bias(lambda b, h, qi, ki: t[0][h, qi, ki])

    def capped(s):
        return cap * torch.tanh(s / cap)

    cases = {
        "bias then cap": (custom + mh.softcap(cap), lambda s: capped(s + t)),
        "cap then bias": (mh.softcap(cap) + custom, lambda s: capped(s) + t),
        "cap then tensor": (mh.softcap(cap) + t, lambda s: capped(s) + t),
        "bias, cap, bias": (custom + mh.softcap(cap) + t, lambda s: capped(s + t) + t),
        "cap twice": (
            mh.softcap(cap) + mh.softcap(cap / 2),
            lambda s: capped(s).div(cap / 2).tanh() * cap / 2,
        ),
    }
    outs = {}
    for name, (bias, fn) in cases.items():
        outs[name] = got = mh.attention(q, k, v, bias=bias, backend=backend)
        assert max_err(got, manual(q, k, v, fn)) <= ATOL, name
    assert max_err(outs["bias then cap"], outs["cap then bias"]) > 1e-3  # order matters


def test_chain_is_associative_and_prints_in_order():
    H = 4
    q, k, v = qkv(Hq=H)
    a, b, c = mh.alibi(H), mh.softcap(3.0), mh.custom_bias(lambda *i: i[2].double() * 0.1)
    left = mh.attention(q, k, v, bias=(a + b) + c, backend="matrix")
    right = mh.attention(q, k, v, bias=a + (b + c), backend="matrix")
    assert max_err(left, right) <= ATOL
    assert repr(a + b) == "alibi(4) + softcap(3.0)"
    assert repr(b + a) == "softcap(3.0) + alibi(4)"
    assert (a + b).is_additive is False and (a + c).is_additive is True


def test_additive_chain_sums_through_sdpa():
    H = 4
    q, k, v = qkv(Hq=H, Nq=4, Nk=6)
    t = torch.randn(4, 6, dtype=F64)
    dist = (torch.arange(4).view(-1, 1) + 2 - torch.arange(6)).abs().to(F64)
    slopes = torch.tensor(press_get_slopes(H), dtype=F64).view(1, H, 1, 1)
    want = manual(q, k, v, lambda s: s - slopes * dist + t)
    for backend in ADDITIVE_BACKENDS:
        got = mh.attention(q, k, v, bias=mh.alibi(H) + t, backend=backend)
        assert max_err(got, want) <= ATOL, backend


# -- gradients into a tensor bias ------------------------------------------------------------------------
def _grads(backend, q, k, v, bias_fn, mask, tensors):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = mh.attention(q, k, v, bias=bias_fn(*leaves), mask=mask, backend=backend)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)  # a non-uniform upstream grad
    (out * w).sum().backward()
    return [out, q.grad, k.grad, v.grad, *(t.grad for t in leaves)]


# Nq, Nk > 128 so the tiled kernel accumulates bias gradients over several tiles.
GRAD_SHAPES = [(2, 4, 130, 150), (1, 4, 130, 150), (2, 1, 1, 150), (130, 150), (4, 1, 1), (2, 1, 130, 1)]


@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=str)
def test_tensor_bias_gradients_agree_across_backends(shape):
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=130, Nk=150, D=8, seed=1)
    t = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(2))
    gold = _grads("reference", q, k, v, lambda x: x, mh.causal(), [t])
    assert gold[-1].shape == t.shape and float(gold[-1].abs().max()) > 0
    for backend in ("matrix", "tiled", "sdpa"):
        got = _grads(backend, q, k, v, lambda x: x, mh.causal(), [t])
        for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), got, gold):
            assert max_err(a, b) <= ATOL, (backend, name, max_err(a, b))


@pytest.mark.parametrize(
    ("bias_fn", "backends"),
    [
        pytest.param(lambda t, u: mh.alibi(4) + t + mh.softcap(4.0), DENSE_BACKENDS, id="alibi+t+softcap"),
        pytest.param(lambda t, u: mh.softcap(2.0) + t + u, DENSE_BACKENDS, id="softcap+t+u"),
        pytest.param(lambda t, u: as_bias(t) + u, ADDITIVE_BACKENDS, id="t+u"),
        pytest.param(lambda t, u: mh.alibi(4) + u, ADDITIVE_BACKENDS, id="alibi+u"),
    ],
)
def test_chained_tensor_bias_gradients_agree(bias_fn, backends):
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=130, Nk=140, D=8, seed=3, scale_q=2.0)
    g = torch.Generator().manual_seed(4)
    t = torch.randn(1, 4, 130, 140, dtype=F64, generator=g)
    u = torch.randn(2, 1, 1, 140, dtype=F64, generator=g)
    mask = mh.sliding_window(100)
    gold = _grads("reference", q, k, v, bias_fn, mask, [t, u])
    for backend in backends:
        got = _grads(backend, q, k, v, bias_fn, mask, [t, u])
        for label, a, b in zip(("out", "dq", "dk", "dv", "dt", "du"), got, gold):
            if a is None or b is None:
                assert a is None and b is None, (backend, label)
                continue
            assert max_err(a, b) <= ATOL, (backend, label, max_err(a, b))


@pytest.mark.parametrize("backend", DENSE_BACKENDS)
def test_tensor_bias_gradcheck(backend):
    # An outside check of the backward: finite differences on a tiny float64 problem.
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=3, Nk=4, D=3, seed=5)
    t = torch.randn(2, 3, 4, dtype=F64, requires_grad=True)
    u = torch.randn(4, dtype=F64, requires_grad=True)

    def f(t, u):
        return mh.attention(q, k, v, bias=mh.softcap(1.5) + t + u, mask=mh.causal(), backend=backend)

    assert torch.autograd.gradcheck(f, (t, u))


@pytest.mark.parametrize(
    "backend",
    [
        *(b for b in ADDITIVE_BACKENDS if b != "tiled"),
        pytest.param(
            "tiled",
            marks=pytest.mark.xfail(
                strict=True,
                reason="tiled routes gradients only to tensor biases, not to a custom_bias closure",
            ),
        ),
    ],
)
def test_gradients_flow_into_tensors_read_by_a_custom_bias(backend):
    q, k, v = qkv(B=1, Hq=2, Nq=3, Nk=4, D=4, seed=6)
    table = torch.randn(2, 3, 4, dtype=F64, generator=torch.Generator().manual_seed(8))
    gold = _grads("reference", q, k, v, lambda t: t, None, [table])[-1]
    got = _grads(
        backend, q, k, v, lambda t: mh.custom_bias(lambda b, h, qi, ki: t[h, qi, ki]), None, [table]
    )[-1]
    assert got is not None and max_err(got, gold) <= ATOL
