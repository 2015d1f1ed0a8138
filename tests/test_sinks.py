"""Learned attention sinks (gpt-oss): every backend against the float64 ``reference``, forward and backward.

The reference writes the sink literally (one more score column, dropped before P V); the other backends
fold it into their log-sum-exp. Checked under the numerics rule of ``tests/numerics.py``: outputs, lse,
weights and the gradients of q, k, v, the sinks and a tensor bias, over masks (none, causal, sliding
window, key padding, documents, fully-masked rows), GQA and MQA, fp32 and bf16. Then the properties
(weights + p_sink = 1, sinks = -inf is no sink), the refusals, the module, and two outside oracles:
Hugging Face's eager gpt-oss attention function and a random-weight ``GptOssAttention`` layer.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import multihead as mh
from multihead import approx, variants
from multihead.backends import flex as flex_mod
from multihead.backends.registry import get as get_backend
from multihead.backends.tiled import backend as tiled_backend
from multihead.core.numerics import add_sink
from multihead.core.problem import make_problem
from multihead.heads import prune
from tests.numerics import TOL, allowed, max_err

HEADS = {"gqa": (4, 2), "mqa": (4, 1)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _masks(B: int, Nq: int, Nk: int) -> dict[str, mh.Mask | None]:
    g = torch.Generator().manual_seed(Nq * 31 + Nk)
    kp = torch.rand(B, Nk, generator=g) > 0.3
    kp[:, -1] = True
    docs = torch.sort(torch.randint(0, 3, (Nk,), generator=g)).values
    return {
        "none": None,
        "causal": mh.causal(),
        "window": mh.sliding_window(17),
        "key_padding": mh.key_padding(kp),
        "document": mh.document(docs) & mh.causal(),
        # every fifth query row sees no key at all: only its sink
        "empty_rows": mh.causal() & mh.custom(lambda b, h, q, k: (q % 5 != 2) & (k >= 0)),
    }


def _inputs(B, Hq, Hkv, Nq, Nk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype)
    sinks = 2.0 * torch.randn(Hq, generator=g)  # float32 logits, around the scores' size
    return q, k, v, sinks


def _run(backend, q, k, v, sinks, mask, bias=None, dout=None):
    """(out, lse, grads of q, k, v, sinks[, bias]) of one backend; fresh leaves for every call."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, sinks)]
    tb = None if bias is None else bias.detach().clone().requires_grad_(True)
    res = mh.attention(*leaves[:3], mask=mask, bias=tb, sinks=leaves[3], backend=backend, return_lse=True)
    assert isinstance(res, mh.AttentionOutput) and res.lse is not None
    wrt = leaves + ([] if tb is None else [tb])
    grads = torch.autograd.grad((res.out.double() * dout).sum(), wrt)
    return res.out.detach(), res.lse, list(grads)


def _flat(res) -> list[torch.Tensor]:
    """out, lse, then the gradients of one :func:`_run`."""
    return [res[0], res[1], *res[2]]


def _check_backends(backends, q, k, v, sinks, mask, bias=None, seed=4):
    """Each backend's out, lse and every gradient vs gold, within the numerics rule (matrix = base).

    The upstream gradient dO is representable in q's dtype, so gold and the backends differentiate the
    same loss: autograd rounds dO to the output's dtype, and the sinks' gradient (a sum over every row)
    would otherwise mostly measure that rounding, not the backend.
    """
    B, Hq, Nq, Dv = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    dout = torch.randn(B, Hq, Nq, Dv, generator=torch.Generator().manual_seed(seed)).to(q.dtype).double()
    d64 = [t.double() for t in (q, k, v, sinks)]
    gold = _run("reference", *d64, mask, None if bias is None else bias.double(), dout)
    bias_d = None if bias is None else bias.to(q.dtype)
    base = _run("matrix", q, k, v, sinks, mask, bias_d, dout)
    names = ["out", "lse", "dq", "dk", "dv", "dsinks", "dbias"]
    for name in backends:
        got = _run(name, q, k, v, sinks, mask, bias_d, dout)
        for i, (a, m, g) in enumerate(zip(_flat(got), _flat(base), _flat(gold), strict=True)):
            assert a.shape == g.shape, (name, names[i], a.shape, g.shape)
            err, lim = max_err(a, g), allowed(max_err(m, g), grad=i >= 2)
            assert err <= lim, f"{name} {names[i]}: err {err:.3e} > allowed {lim:.3e}"


@pytest.fixture
def tiled_blocks(monkeypatch):
    """Small tiles (16 x 8) on the small problems here: full, partial and skipped tiles, bands, and rows
    that several pieces share all occur (the default 64 x 64 tiles run in the other tests)."""
    monkeypatch.setattr(tiled_backend.BACKEND, "block_q", 16)
    monkeypatch.setattr(tiled_backend.BACKEND, "block_k", 8)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("mask_name", list(_masks(2, 4, 4)))
def test_tiled_and_matrix_vs_reference(tiled_blocks, dtype, heads, mask_name):
    """Fused engine (no bias): out, lse, dq, dk, dv, dsinks within the rule."""
    Hq, Hkv = heads
    q, k, v, sinks = _inputs(2, Hq, Hkv, 37, 59, 16, dtype)
    _check_backends(["matrix", "tiled"], q, k, v, sinks, _masks(2, 37, 59)[mask_name])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("mask_name", ["causal", "key_padding", "empty_rows"])
def test_tensor_bias_gradient_with_sinks(tiled_blocks, dtype, mask_name):
    """A tensor bias that requires grad runs the loop engine: its gradient and the sinks' as well."""
    q, k, v, sinks = _inputs(2, 4, 2, 21, 29, 16, dtype, seed=1)
    bias = torch.randn(1, 4, 21, 29, generator=torch.Generator().manual_seed(2))
    _check_backends(["matrix", "tiled"], q, k, v, sinks, _masks(2, 21, 29)[mask_name], bias)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("nq", [1, 4])
@pytest.mark.parametrize("mask_name", ["none", "causal", "window", "empty_rows"])
def test_decode_vs_reference(dtype, nq, mask_name):
    """decode (1-16 rows against >= 128 keys) under autograd (the fused engine) and without it (its
    own split forward and the every-key fast path)."""
    q, k, v, sinks = _inputs(2, 4, 2, nq, 160, 16, dtype, seed=3)
    mask = _masks(2, nq, 160)[mask_name]
    assert get_backend("decode").why_not(make_problem(q, k, v, mask=mask, sinks=sinks)) is None
    _check_backends(["decode"], q, k, v, sinks, mask)
    with torch.no_grad():
        gold = mh.attention(q.double(), k.double(), v.double(), mask=mask, sinks=sinks.double(),
                            backend="reference", return_lse=True)  # fmt: skip
        base = mh.attention(q, k, v, mask=mask, sinks=sinks, backend="matrix", return_lse=True)
        got = mh.attention(q, k, v, mask=mask, sinks=sinks, backend="decode", return_lse=True)
    for a, m, g in ((got.out, base.out, gold.out), (got.lse, base.lse, gold.lse)):
        assert max_err(a, g) <= allowed(max_err(m, g))


def test_decode_split_over_the_cache_with_sinks():
    """A long cache cut into chunks merged by lse (plus a tail): the sink is merged exactly once."""
    q, k, v, sinks = _inputs(1, 2, 1, 1, 4099, 16, torch.float32, seed=5)
    with torch.no_grad():
        gold = mh.attention(q.double(), k.double(), v.double(), sinks=sinks.double(), backend="reference",
                            return_lse=True)  # fmt: skip
        for mask in (None, mh.sliding_window(3000)):
            got = mh.attention(q, k, v, mask=mask, sinks=sinks, backend="decode", return_lse=True)
            want = gold if mask is None else mh.attention(
                q.double(), k.double(), v.double(), mask=mask, sinks=sinks.double(), backend="reference",
                return_lse=True)  # fmt: skip
            assert max_err(got.out, want.out) < TOL[torch.float32]
            assert max_err(got.lse, want.lse) < TOL[torch.float32]


@pytest.mark.parametrize("backend", ["reference", "matrix", "tiled", "decode"])
def test_fully_masked_row_gives_zero_output_and_the_sink_as_lse(backend):
    q, k, v, sinks = _inputs(1, 4, 2, 3, 200, 8, torch.float32)
    allowed_ = torch.ones(1, 1, 3, 200, dtype=torch.bool)
    allowed_[..., 1, :] = False  # row 1 sees nothing
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    res = mh.attention(*leaves[:3], mask=allowed_, sinks=leaves[3], backend=backend, return_lse=True)
    assert torch.equal(res.out[:, :, 1], torch.zeros_like(res.out[:, :, 1]))
    assert torch.allclose(res.lse[0, :, 1].float(), sinks, atol=TOL[torch.float32])
    res.out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    assert torch.equal(leaves[0].grad[:, :, 1], torch.zeros_like(leaves[0].grad[:, :, 1]))


@pytest.mark.parametrize("backend", ["reference", "matrix", "tiled"])
@pytest.mark.parametrize("mask_name", ["causal", "empty_rows"])
def test_gradcheck_float64(backend, mask_name, monkeypatch):
    """torch.autograd.gradcheck of every input, the sinks and a tensor bias included (tiny tiles)."""
    monkeypatch.setattr(tiled_backend.BACKEND, "block_q", 4)
    monkeypatch.setattr(tiled_backend.BACKEND, "block_k", 3)
    q, k, v, sinks = _inputs(1, 2, 1, 7, 9, 3, torch.float64, seed=6)
    mask = _masks(1, 7, 9)[mask_name]
    bias = torch.randn(1, 2, 1, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    leaves = [t.double().requires_grad_(True) for t in (q, k, v, sinks)]

    def fused(q_, k_, v_, s_):  # no bias: tiled runs its fused engine
        return mh.attention(q_, k_, v_, mask=mask, sinks=s_, backend=backend)

    def loop(q_, k_, v_, s_, b_):  # a grad-requiring tensor bias: tiled runs its loop engine
        return mh.attention(q_, k_, v_, mask=mask, bias=b_, sinks=s_, backend=backend)

    assert torch.autograd.gradcheck(fused, leaves, fast_mode=True)
    assert torch.autograd.gradcheck(loop, [*leaves, bias.requires_grad_(True)], fast_mode=True)


def test_sink_gradient_formula_on_the_reference():
    """d sink_h = -sum_{b, i} p_sink(b, h, i) * (dO_i . O_i), against autograd through the literal
    sink column of the reference."""
    q, k, v, sinks = (t.double() for t in _inputs(2, 4, 2, 9, 11, 5, torch.float32, seed=8))
    s = sinks.clone().requires_grad_(True)
    res = mh.attention(q, k, v, mask=mh.causal(), sinks=s, backend="reference", return_lse=True)
    dout = torch.randn_like(res.out)
    (auto,) = torch.autograd.grad(res.out, s, dout)
    p_sink = torch.exp(sinks.view(1, -1, 1) - res.lse)  # (B, Hq, Nq)
    formula = -(p_sink * (dout * res.out).sum(-1)).sum(dim=(0, 2))
    assert max_err(auto, formula) < TOL[torch.float64]


def test_weights_are_the_sinked_probabilities():
    q, k, v, sinks = _inputs(2, 4, 2, 13, 21, 8, torch.float32, seed=9)
    for mask in (None, mh.causal(), _masks(2, 13, 21)["empty_rows"]):
        gold = mh.attention(q.double(), k.double(), v.double(), mask=mask, sinks=sinks.double(),
                            backend="reference", return_weights=True)  # fmt: skip
        got = mh.attention(q, k, v, mask=mask, sinks=sinks, backend="matrix", return_weights=True)
        assert max_err(got.weights, gold.weights) < TOL[torch.float32]
        assert bool((gold.weights.sum(-1) < 1).all())  # the sink always takes some mass


@settings(max_examples=40, deadline=None)
@given(
    G=st.sampled_from([1, 2, 4]),
    Hkv=st.sampled_from([1, 2]),
    Nq=st.integers(1, 9),
    Nk=st.integers(1, 9),
    causal=st.booleans(),
    sinks=st.lists(st.floats(-8.0, 8.0) | st.just(float("-inf")), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_weights_and_sink_sum_to_one(G, Hkv, Nq, Nk, causal, sinks, seed):
    """Every row: sum_j p_j + p_sink = 1, with p_sink = exp(sink_h - lse) (an empty row with a sink: all
    of it on the sink; an empty row without one: nothing, lse = -inf)."""
    Hq = G * Hkv
    q, k, v, _ = _inputs(2, Hq, Hkv, Nq, Nk, 4, torch.float64, seed=seed)
    s = torch.tensor((sinks * 2)[:Hq], dtype=torch.float64)
    drop = torch.rand(2, 1, Nq, Nk, generator=torch.Generator().manual_seed(seed)) > 0.6
    mask = drop & (mh.causal().dense(2, 1, Nq, Nk) if causal else True)
    for backend in ("reference", "matrix"):
        res = mh.attention(q, k, v, mask=mask, sinks=s, backend=backend, return_weights=True, return_lse=True)
        p_sink = torch.where(
            torch.isinf(res.lse), torch.zeros_like(res.lse), torch.exp(s.view(1, -1, 1) - res.lse)
        )
        total = res.weights.sum(-1) + p_sink  # (B, Hq, Nq)
        empty = ~mask.expand(2, Hq, Nq, Nk).any(-1) & torch.isinf(s).view(1, -1, 1)  # no key, no sink
        assert torch.allclose(total[~empty], torch.ones_like(total[~empty]), atol=1e-12)
        assert bool((total[empty] == 0).all()) and bool((res.out.sum(-1)[empty] == 0).all())


@pytest.mark.parametrize("backend", ["reference", "matrix", "tiled", "decode"])
def test_sinks_of_minus_infinity_are_no_sinks(backend):
    q, k, v, _ = _inputs(2, 4, 2, 3, 150, 8, torch.float32, seed=10)
    none = torch.full((4,), float("-inf"))
    for mask in (None, mh.causal(), _masks(2, 3, 150)["empty_rows"]):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, none)]
        a = mh.attention(*leaves[:3], mask=mask, sinks=leaves[3], backend=backend, return_lse=True)
        b = mh.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
        assert max_err(a.out, b.out) == 0.0
        assert torch.equal(a.lse, b.lse)  # -inf on empty rows in both
        a.out.square().sum().backward()
        assert torch.equal(leaves[3].grad, torch.zeros(4))
        assert all(torch.isfinite(t.grad).all() for t in leaves[:3])


def test_add_sink_is_differentiable_like_the_reference():
    """The merge flex uses on its returned lse: an lse-returning path without sinks + add_sink equals the
    reference with sinks, gradients of q, k, v and the sinks included."""
    q, k, v, sinks = (t.double() for t in _inputs(1, 4, 2, 6, 10, 4, torch.float32, seed=11))
    mask = _masks(1, 6, 10)["empty_rows"]
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    res = mh.attention(*leaves[:3], mask=mask, backend="matrix", return_lse=True)
    out, lse = add_sink(res.out, res.lse, leaves[3])
    gold = mh.attention(*leaves[:3], mask=mask, sinks=leaves[3], backend="reference", return_lse=True)
    assert max_err(out, gold.out) < TOL[torch.float64] and max_err(lse, gold.lse) < TOL[torch.float64]
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(gold.out, leaves, dout)):
        assert max_err(a, b) < TOL[torch.float64]


def test_flex_with_sinks(monkeypatch):
    """On CPU compiled flex returns no lse, so sinks are refused with that reason; the adapter's sink
    merge runs on flex's eager implementation (which returns the lse on CPU)."""
    q, k, v, sinks = _inputs(1, 4, 2, 21, 21, 8, torch.float32, seed=12)
    reason = flex_mod.BACKEND._cannot(make_problem(q, k, v, sinks=sinks))
    assert reason is not None and "sinks" in reason and "log-sum-exp" in reason
    why = flex_mod.BACKEND.unusable()
    if why is not None:
        print(f"skipping the flex run: {why}")
        pytest.skip(why)
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex_mod, "_compiled", lambda: flex_attention)  # eager: no compile
    monkeypatch.setattr(flex_mod, "returns_lse", lambda device: True)
    mask = _masks(1, 21, 21)["empty_rows"]
    got = flex_mod.BACKEND.run(make_problem(q, k, v, mask=mask, sinks=sinks, return_lse=True))
    gold = mh.attention(q.double(), k.double(), v.double(), mask=mask, sinks=sinks.double(),
                        backend="reference", return_lse=True)  # fmt: skip
    assert max_err(got.out, gold.out) < TOL[torch.float32] and max_err(got.lse, gold.lse) < TOL[torch.float32]


# -- refusals ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sinks", "match"),
    [
        ([0.0, 0.0, 0.0, 0.0], "sinks must be a float tensor of shape \\(Hq,\\) = \\(4,\\).*got list"),
        (torch.zeros(2), "sinks must have shape \\(Hq,\\) = \\(4,\\).*got \\(2,\\)"),
        (torch.zeros(1, 4), "sinks must have shape \\(Hq,\\) = \\(4,\\).*got \\(1, 4\\)"),
        (torch.zeros(4, dtype=torch.long), "sinks must be a floating tensor.*torch.int64.*sinks.float\\(\\)"),
        (torch.zeros(4, device="meta"), "sinks is on meta but q is on cpu.*sinks.to\\(q.device\\)"),
    ],
    ids=["list", "Hkv-shaped", "2-d", "int", "device"],
)
def test_invalid_sinks_raise_value_errors(sinks, match):
    q, k, v, _ = _inputs(1, 4, 2, 3, 5, 8, torch.float32)
    with pytest.raises(ValueError, match=match):
        mh.attention(q, k, v, sinks=sinks)
    with pytest.raises(ValueError, match=match):
        mh.explain(q, k, v, sinks=sinks)


def test_sdpa_refuses_sinks_and_auto_falls_back():
    q, k, v, sinks = _inputs(1, 4, 2, 20, 20, 8, torch.float32)
    with pytest.raises(ValueError, match=r"backend 'sdpa' cannot apply sinks.*backend='auto'"):
        mh.attention(q, k, v, sinks=sinks, backend="sdpa")
    text = mh.explain(q, k, v, mask=mh.causal(), sinks=sinks)
    assert "not sdpa: SDPA has no sink term" in text and "auto -> tiled" in text, text
    assert "auto -> decode" in mh.explain(q[:, :, :1], *_inputs(1, 4, 2, 1, 300, 8, torch.float32)[1:3],
                                          sinks=sinks)  # fmt: skip
    # what auto picks is exact
    out = mh.attention(q, k, v, mask=mh.causal(), sinks=sinks)
    gold = mh.attention(q.double(), k.double(), v.double(), mask=mh.causal(), sinks=sinks.double(),
                        backend="reference")  # fmt: skip
    assert max_err(out, gold) < TOL[torch.float32]


def test_approximations_refuse_sinks():
    q, k, v, sinks = _inputs(1, 4, 2, 20, 20, 8, torch.float32)
    for a in (approx.TopK(4), approx.Nystrom(4)):
        with pytest.raises(ValueError, match=r"has no attention-sink term.*pass sinks=None"):
            mh.attention(q, k, v, sinks=sinks, backend=a)
    model = mh.MultiHeadAttention(32, 4, sinks=True)
    with pytest.raises(ValueError, match="cannot serve attention with learned sinks"):
        approx.apply(model, approx.TopK(4))


# -- the module ----------------------------------------------------------------------------------------


def test_module_learns_sinks():
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(32, 4, 2, sinks=True)
    assert isinstance(m.sinks, nn.Parameter) and m.sinks.shape == (4,) and not m.sinks.any()
    assert "sinks" in m.state_dict() and "sinks=True" in repr(m)
    assert mh.MultiHeadAttention(32, 4).sinks is None
    x = torch.randn(2, 7, 32)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        m(x, mask=mh.causal()).square().mean().backward()
        assert m.sinks.grad is not None and m.sinks.grad.abs().sum() > 0
        opt.step()
    assert m.sinks.detach().abs().sum() > 0
    # the sinks change the output: a very large sink takes every head's mass
    with torch.no_grad():
        m.sinks.fill_(60.0)
        y = m(x, mask=mh.causal())
    assert torch.allclose(y, m.o_proj.bias.expand_as(y), atol=1e-6)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_kv_cached_decode_equals_full_forward(n_kv_heads):
    torch.manual_seed(1)
    m = mh.MultiHeadAttention(32, 4, n_kv_heads, rotary=mh.RotaryEmbedding(8), sinks=True).eval()
    nn.init.normal_(m.sinks, std=2.0)
    x = torch.randn(2, 150, 32)
    full = m(x, mask=mh.causal())
    cache = mh.KVCache(2, n_kv_heads, 8, 160)
    steps = [m(x[:, :140], cache=cache, mask=mh.causal())]  # prefill, then one token at a time
    steps += [m(x[:, i : i + 1], cache=cache, mask=mh.causal()) for i in range(140, 150)]
    assert max_err(torch.cat(steps, dim=1), full) < TOL[torch.float32]


def test_sinks_on_the_module_are_checked():
    with pytest.raises(ValueError, match="sinks must be True or False"):
        mh.MultiHeadAttention(32, 4, sinks=1)  # type: ignore[arg-type]

    class OwnWeights(mh.MultiHeadAttention):
        def attend(self, q, k, v, **kw):
            return super().attend(q, k, v, **kw)

    with pytest.raises(ValueError, match=r"OwnWeights overrides attend.*sinks=False"):
        OwnWeights(32, 4, sinks=True)
    assert OwnWeights(32, 4).sinks is None


def test_variants_still_construct_and_say_whether_they_take_sinks():
    for name in variants.NAMES:
        plain = variants.build(name, 32, 4)
        if name == "sinks":  # the design is MHA with sinks=True
            assert plain.sinks.shape == (4,)
            continue
        assert getattr(plain, "sinks", None) is None
        if name in ("mha", "gqa", "mqa"):
            assert variants.build(name, 32, 4, sinks=True).sinks.shape == (4,)
        else:
            with pytest.raises(ValueError, match="got unknown arguments \\['sinks'\\]"):
                variants.build(name, 32, 4, sinks=True)


def test_pruning_keeps_the_sinks_of_the_kept_heads():
    torch.manual_seed(2)
    layer = mh.TransformerLayer(32, 4, 64, n_kv_heads=2)
    layer.self_attn = mh.MultiHeadAttention(32, 4, 2, sinks=True)
    nn.init.normal_(layer.self_attn.sinks, std=2.0)
    x = torch.randn(2, 9, 32)
    want = layer.self_attn(x, mask=mh.causal(), head_mask=torch.tensor([1.0, 0.0, 1.0, 1.0]))
    pruned = prune(copy.deepcopy(layer), {0: [1]})
    attn = pruned.self_attn
    assert attn.n_heads == 3 and attn.sinks is not None
    assert torch.equal(attn.sinks.detach(), layer.self_attn.sinks.detach()[[0, 2, 3]])
    assert max_err(attn(x, mask=mh.causal()), want) < TOL[torch.float32]


# -- outside oracles: Hugging Face gpt-oss -------------------------------------------------------------


def _hf_gpt_oss():
    pytest.importorskip("transformers", reason="transformers is the outside oracle for gpt-oss sinks")
    return pytest.importorskip(
        "transformers.models.gpt_oss.modeling_gpt_oss", reason="this transformers has no gpt-oss"
    )


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask_name", ["none", "causal", "window"])
def test_hf_eager_gpt_oss_attention(heads, mask_name):
    """transformers' eager_attention_forward of gpt-oss (sinks concatenated as a logit column) vs
    mh.attention(sinks=...): outputs and weights, float64."""
    hf = _hf_gpt_oss()
    Hq, Hkv = heads
    q, k, v, sinks = (t.double() for t in _inputs(2, Hq, Hkv, 19, 19, 8, torch.float32, seed=13))
    mask = {"none": None, "causal": mh.causal(), "window": mh.sliding_window(5)}[mask_name]
    additive = None
    if mask is not None:
        allowed_ = mask.dense(2, Hq, 19, 19)
        additive = torch.zeros(2, 1, 19, 19, dtype=torch.float64).masked_fill(~allowed_[:, :1], float("-inf"))
    module = nn.Module()
    module.sinks = nn.Parameter(sinks.clone())
    module.num_key_value_groups = Hq // Hkv
    module.eval()
    hf_out, hf_w = hf.eager_attention_forward(module, q, k, v, additive, scaling=8**-0.5)
    hf_out = hf_out.transpose(1, 2)  # HF returns (B, N, H, D)
    for backend in ("reference", "matrix", "tiled"):
        got = mh.attention(q, k, v, mask=mask, sinks=sinks, backend=backend)
        assert max_err(got, hf_out) < TOL[torch.float64], backend
    w = mh.attention(q, k, v, mask=mask, sinks=sinks, backend="matrix", return_weights=True).weights
    assert max_err(w, hf_w) < TOL[torch.float64]


def test_hf_gpt_oss_attention_layer_parity():
    """A random-weight GptOssAttention layer (rotary, GQA, biases, sinks) and MultiHeadAttention(sinks=
    True) with its weights: the same output, and the same after a few cached decode steps."""
    hf = _hf_gpt_oss()
    from transformers import GptOssConfig

    cfg = GptOssConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, layer_types=["full_attention"],
        vocab_size=16, intermediate_size=16, num_local_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(3)
    layer = hf.GptOssAttention(cfg, 0).double().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
        layer.sinks.normal_(0.0, 2.0)
    rope = hf.GptOssRotaryEmbedding(cfg).double()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    pos = torch.arange(12).expand(2, 12)
    causal = torch.full((12, 12), float("-inf"), dtype=torch.float64).triu(1).expand(2, 1, 12, 12)
    with torch.no_grad():
        want, _ = layer(x, position_embeddings=rope(x, pos), attention_mask=causal)
    m = mh.MultiHeadAttention(32, 4, 2, head_dim=8, rotary=mh.RotaryEmbedding(8, base=10000.0), sinks=True)
    m.load_state_dict(layer.state_dict())  # q/k/v_proj fused by the loading hook; "sinks" as is
    m = m.double().eval()
    with torch.no_grad():
        got = m(x, mask=mh.causal())
        cache = mh.KVCache(2, 2, 8, 12, dtype=torch.float64)
        steps = [m(x[:, :9], cache=cache, mask=mh.causal())]
        steps += [m(x[:, i : i + 1], cache=cache, mask=mh.causal()) for i in range(9, 12)]
    # float32 tolerance: transformers computes the rotary angles in float32 (cos/sin then cast)
    assert max_err(got, want) < TOL[torch.float32]
    assert max_err(torch.cat(steps, dim=1), want) < TOL[torch.float32]
    assert max_err(torch.cat(steps, dim=1), got) < TOL[torch.float64]
