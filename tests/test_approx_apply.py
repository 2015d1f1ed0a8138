"""Approximations in models (apply, low_rank_ffn), their gradients, and their bad parameters."""

from __future__ import annotations

import re

import pytest
import torch

import multihead as mh
from multihead import approx as A
from multihead.core.problem import make_problem
from tests.numerics import TOL, max_err

F64 = torch.float64


def _small_lm(**kw):
    torch.manual_seed(0)
    return mh.TransformerLM(64, 32, 2, 4, 64, n_kv_heads=2, **kw).double().eval()


def _qkv(Nq=9, Nk=9, D=4):
    """Small float64 leaves with GQA (2 query heads, 1 kv head)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, Nq, D, generator=g, dtype=F64, requires_grad=True)  # (B, Hq, Nq, D)
    k = torch.randn(1, 1, Nk, D, generator=g, dtype=F64, requires_grad=True)  # (B, Hkv, Nk, D): GQA
    v = torch.randn(1, 1, Nk, D, generator=g, dtype=F64, requires_grad=True)
    return q, k, v


# -- gradients --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("approx", "mask"),
    [
        (A.TopK(4), mh.causal()),
        (A.Threshold(0.05), None),
        (A.Nystrom(3), None),
        (A.Linformer(4, 16), mh.padding([7])),
        (A.LowRank(3), None),
        (A.LinearAttention(), mh.causal()),
        (A.Performer(8), mh.causal()),
        (A.Performer(8), None),
        (A.SparseMask(A.local(3)), None),
    ],
    ids=lambda x: repr(x).replace(" ", ""),
)
def test_gradcheck(approx, mask):
    q, k, v = _qkv(Nq=7, Nk=7, D=3)
    approx.chunk = 3  # several chunks, the last one partial, in the causal linear forms
    assert torch.autograd.gradcheck(lambda q, k, v: approx(q, k, v, mask=mask), (q, k, v), fast_mode=True)


def test_learned_linformer_projections_get_gradients():
    q, k, v = _qkv()
    lin = A.Linformer(4, 16, learned=True).double()
    lin(q, k, v).sum().backward()
    assert lin.proj_k.grad is not None and float(lin.proj_k.grad.abs().sum()) > 0


# -- apply ------------------------------------------------------------------------------------------------
def test_apply_with_an_exact_limit_reproduces_the_model_and_leaves_it_untouched():
    lm = _small_lm()
    ids = torch.randint(0, 64, (2, 12))
    approx_lm = A.apply(lm, A.TopK(1000))
    assert max_err(approx_lm(ids), lm(ids)) < TOL[F64]
    assert set(approx_lm.state_dict()) == set(lm.state_dict())
    assert all(type(m) is mh.MultiHeadAttention for m in lm.modules() if isinstance(m, mh.MultiHeadAttention))
    assert sum(getattr(m, "approx", None) is not None for m in approx_lm.modules()) == 2


def test_apply_decodes_through_the_kv_cache_like_a_full_forward():
    lm = A.apply(_small_lm(), A.Performer(16))
    ids = torch.randint(0, 64, (1, 10))
    full = lm(ids)
    cache = lm.make_cache(1, 10)
    steps = [lm(ids[:, :6], cache=cache)] + [lm(ids[:, i : i + 1], cache=cache) for i in range(6, 10)]
    assert max_err(torch.cat(steps, dim=1), full) < 1e-10


def test_apply_to_an_encoder_with_key_padding():
    torch.manual_seed(0)
    enc = mh.Encoder(2, 32, 4, 64).double().eval()
    x = torch.randn(2, 9, 32, dtype=F64)
    mask = mh.padding([9, 5])
    exact = enc(x, mask=mask)
    approx = A.apply(enc, A.Nystrom(16, pinv_iterations=None))(x, mask=mask)
    assert max_err(approx[0], exact[0]) < 1e-9
    assert max_err(approx[1, :5], exact[1, :5]) < 1e-9


def test_apply_gives_each_layer_its_own_learned_projections():
    lm = A.apply(_small_lm(), A.Linformer(4, 64, learned=True))
    projs = [m.approx.proj_k for m in lm.modules() if getattr(m, "approx", None) is not None]
    assert len(projs) == 2 and projs[0] is not projs[1]
    assert "layers.0.self_attn.approx.proj_k" in lm.state_dict()


def test_apply_rejects_what_is_not_an_approximation_or_has_no_attention():
    with pytest.raises(ValueError, match=r"approx must be a multihead\.approx approximation"):
        A.apply(_small_lm(), lambda q, k, v: q)
    with pytest.raises(ValueError, match=r"contains no multihead\.MultiHeadAttention"):
        A.apply(torch.nn.Linear(2, 2), A.TopK(2))


def test_low_rank_ffn_full_rank_is_exact_and_counts_weights():
    lm = _small_lm()
    ids = torch.randint(0, 64, (2, 12))
    assert max_err(A.low_rank_ffn(lm, 32)(ids), lm(ids)) < 1e-10
    small = A.low_rank_ffn(lm, 4)
    lr = [m for m in small.modules() if isinstance(m, A.LowRankLinear)]
    assert len(lr) == 6 and all(m.rank == 4 for m in lr)  # 2 layers x SwiGLU w1, w2, w3
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in lm.parameters())
    with pytest.raises(ValueError, match=r"rank=33 exceeds min\(in, out\)=32"):
        A.low_rank_ffn(lm, 33)


# -- bad parameters ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: A.TopK(0), r"TopK k must be an int >= 1, got 0"),
        (lambda: A.TopK(2.5), r"TopK k must be an int >= 1, got 2.5"),
        (lambda: A.Threshold(1.0), r"tau must be a weight in \[0, 1\), got 1.0"),
        (lambda: A.Threshold(-0.1), r"tau must be a weight in \[0, 1\)"),
        (lambda: A.Nystrom(0), r"Nystrom landmarks must be an int >= 1, got 0"),
        (lambda: A.Nystrom(4, pinv_iterations=0), r"pinv_iterations must be an int >= 1"),
        (lambda: A.Linformer(0, 16), r"Linformer k must be an int >= 1"),
        (lambda: A.Linformer(4, 0), r"Linformer max_len must be an int >= 1"),
        (lambda: A.LowRank(0), r"LowRank rank must be an int >= 1"),
        (lambda: A.LowRank(2, "qr"), r"method must be 'svd' or 'random', got 'qr'"),
        (lambda: A.LinearAttention("tanh"), r"feature_map must be 'elu' or 'relu', got 'tanh'"),
        (lambda: A.Performer(0), r"Performer features must be an int >= 1"),
        (lambda: A.local(0), r"local window must be an int >= 1"),
        (lambda: A.local_global(4, -1), r"local_global n_global must be an int >= 0"),
        (lambda: A.low_rank_ffn(_small_lm(), 0), r"low_rank_ffn rank must be an int >= 1"),
    ],
)
def test_bad_parameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    ("approx", "kwargs", "match"),
    [
        (A.LowRank(10), {}, r"LowRank rank=10 exceeds min\(Nq, Nk\)=9"),
        (A.LowRank(4), {"dropout_p": 0.5}, r"LowRank has no attention weights to drop"),
        (A.Linformer(4, 8), {}, r"Linformer\(max_len=8\) got Nk=9 keys; build it with max_len >= 9"),
        (A.Nystrom(4), {"mask": mh.causal()}, r"Nystrom mixes every position .* no causal form"),
        (A.Linformer(4, 16), {"mask": mh.causal()}, r"Linformer mixes every position"),
        (A.Performer(8), {"mask": mh.sliding_window(3)}, r"cannot apply mask sliding_window\(3\)"),
        (A.Nystrom(4), {"bias": mh.alibi(2)}, r"Nystrom cannot add a bias"),
        (A.LinearAttention(), {"dropout_p": 0.1}, r"no attention weights to drop \(dropout_p=0.1\)"),
        (A.LinearAttention(), {"scale": 0.3}, r"has no temperature, got scale=0.3"),
        (A.TopK(2), {"dropout_p": 1.0}, r"dropout_p must be in \[0, 1\)"),
    ],
)
def test_what_an_approximation_cannot_apply_raises(approx, kwargs, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        approx(q, k, v, **kwargs)


def test_bad_tensors_raise_like_the_core():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="must have 4 dims"):
        A.TopK(2)(q[0], k, v)
    with pytest.raises(ValueError, match=r"query heads Hq \(2\) must be divisible by kv heads Hkv \(3\)"):
        A.Performer(4)(q, k.expand(1, 3, 9, 4), v.expand(1, 3, 9, 4))


# -- an approximation is a backend: mh.attention, explain, MultiHeadAttention --------------------------------
def test_attention_takes_an_approximation_as_its_backend():
    q, k, v = _qkv()
    ap = A.Nystrom(3)
    got = mh.attention(q, k, v, backend=ap, scale=0.3)
    assert torch.equal(got, ap(q, k, v, scale=0.3))
    exact = mh.attention(q, k, v, backend=A.TopK(9), mask=mh.causal())  # k >= N: exact
    assert max_err(exact, mh.attention(q, k, v, mask=mh.causal(), backend="reference")) <= TOL[F64]


def test_an_approximation_is_a_backend_object_that_is_never_registered_nor_picked_by_auto():
    ap = A.TopK(64)
    assert (ap.name, A.Linformer(4, 32, learned=True).name, A.SparseMask(A.local(3)).name) == (
        "TopK(64)",
        "Linformer(4, 32, learned=True)",
        "SparseMask(local(3))",
    )
    assert isinstance(ap.summary, str) and ap.summary
    assert ap.name not in mh.backends()
    from multihead.backends import auto

    assert not any(name.startswith("TopK") for name in auto.AUTO_ORDER)
    p = make_problem(*_qkv(), mask=mh.causal())
    assert ap.why_not(p) is None and A.Nystrom(3).why_not(p) is not None
    out = ap.run(p)
    assert out.weights is None and out.lse is None and out.out.shape == (1, 2, 9, 4)


def test_the_call_is_validated_once(monkeypatch):
    import multihead.core.functional as functional

    calls = []
    real = functional.make_problem
    monkeypatch.setattr(functional, "make_problem", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = _qkv()
    mh.attention(q, k, v, mask=mh.causal(), backend=A.TopK(3))
    A.Threshold(0.1)(q, k, v, mask=mh.causal())
    assert len(calls) == 2


@pytest.mark.parametrize("extra", ["return_weights", "return_lse"])
def test_an_approximation_refuses_weights_and_lse(extra):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"TopK\(2\) approximates the output only .*{extra}=True"):
        mh.attention(q, k, v, backend=A.TopK(2), **{extra: True})


@pytest.mark.parametrize("bad", ["topk", torch.nn.Linear(2, 2), 3, None])
def test_a_bad_backend_names_backend_the_value_and_the_choices(bad):
    q, k, v = _qkv()
    choices = r"valid backends are: auto, reference.*or a backend object"
    for call in (mh.attention, mh.explain):
        with pytest.raises(ValueError, match=rf"unknown backend .*{choices}"):
            call(q, k, v, backend=bad)
    with pytest.raises(ValueError, match=rf"unknown backend {re.escape(repr(bad))}"):
        mh.MultiHeadAttention(16, 4, backend=bad)


def test_approx_is_no_longer_an_argument():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="approx"):
        mh.attention(q, k, v, approx=A.TopK(2))
    with pytest.raises(TypeError, match="approx"):
        mh.explain(q, k, v, approx=A.TopK(2))
    with pytest.raises(TypeError, match="approx"):
        mh.MultiHeadAttention(16, 4, approx=A.TopK(2))


def test_explain_describes_an_approximation_instead_of_the_exact_backends():
    q, k, v = _qkv()
    text = mh.explain(q, k, v, backend=A.TopK(4))
    assert "approximation TopK(4): each query keeps its k largest scores" in text
    assert "serves this call" in text
    assert "not tiled" not in text and "auto ->" not in text
    text = mh.explain(q, k, v, mask=mh.causal(), backend=A.Nystrom(3))
    assert "cannot serve this call: Nystrom mixes every position" in text
    assert "return_weights=True" in mh.explain(q, k, v, return_weights=True, backend=A.TopK(4))


def test_module_backend_object_is_a_registered_submodule_that_trains():
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(16, 4, backend=A.Linformer(4, 32, learned=True))
    assert isinstance(m.backend, A.Linformer) and m.backend is m.approx
    assert "approx.proj_k" in dict(m.named_parameters()) and "approx.proj_k" in m.state_dict()
    assert "backend=Linformer(4, 32, learned=True)" in repr(m)
    x = torch.randn(2, 32, 16)
    m(x).sum().backward()
    assert m.approx.proj_k.grad is not None and float(m.approx.proj_k.grad.abs().sum()) > 0
    ref = mh.MultiHeadAttention(16, 4)
    ref.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("approx.")})
    assert not torch.allclose(m(x), ref(x))  # the approximation is used
    m2 = mh.MultiHeadAttention(16, 4, backend=A.Linformer(4, 32, learned=True))
    m2.load_state_dict(m.state_dict())  # saved and loaded with the module
    assert torch.equal(m2.approx.proj_k, m.approx.proj_k)
    m.backend = "auto"  # back to exact: the approximation and its parameters leave the module
    assert m.approx is None and "approx.proj_k" not in m.state_dict()
    assert torch.equal(m(x), ref(x))


def test_module_backend_assignment_goes_through_validation():
    m = mh.MultiHeadAttention(16, 4)
    m.backend = A.TopK(2)  # an nn.Module: kept as the submodule approx, not as a child named backend
    assert m.backend is m.approx and "backend" not in dict(m.named_children())
    m.backend = "matrix"
    assert m.backend == "matrix" and m.approx is None
    with pytest.raises(ValueError, match="unknown backend 'flash9'"):
        m.backend = "flash9"
