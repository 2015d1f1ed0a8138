"""Each approximation against its own float64 definition, its exact limit, and its causal form."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import multihead as mh
from multihead import approx as A
from tests.numerics import TOL, max_err

F64 = torch.float64
EXACT = 1e-9  # float64 identities that hold up to rounding of O(N) sums


def _qkv(B=2, Hq=4, Hkv=2, Nq=37, Nk=37, D=16, scale=1.0, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g, dtype=F64) * scale  # (B, Hq, Nq, D)
    k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=F64) * scale  # (B, Hkv, Nk, D)
    v = torch.randn(B, Hkv, Nk, D, generator=g, dtype=F64)  # (B, Hkv, Nk, D)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _gold(q, k, v, **kw):
    return mh.attention(q, k, v, backend="reference", **kw)


def _repeat(t, G):
    return t.repeat_interleave(G, dim=1)  # (B, Hkv*G, N, .): the plain GQA definition


# -- exact limits -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mask",
    [None, mh.causal(), mh.padding([37, 20]), mh.sliding_window(7)],
    ids=["none", "causal", "pad", "sw"],
)
def test_topk_with_k_at_least_n_is_exact(mask):
    q, k, v = _qkv()
    for kk in (37, 1000):
        assert max_err(A.TopK(kk)(q, k, v, mask=mask), _gold(q, k, v, mask=mask)) < EXACT


def test_topk_keeps_exactly_k_keys_per_row():
    q, k, v = _qkv(B=1, Hq=2, Hkv=2, Nq=9, Nk=9)
    s = q @ k.transpose(-1, -2) / 4.0  # (1, 2, 9, 9)
    top, idx = s.topk(3, dim=-1)
    w = torch.zeros_like(s).scatter(-1, idx, top.softmax(-1))
    assert max_err(A.TopK(3)(q, k, v), w @ v) < EXACT


@pytest.mark.parametrize(
    "mask", [None, mh.causal(), mh.document([0] * 20 + [1] * 17)], ids=["none", "causal", "doc"]
)
def test_threshold_zero_is_exact(mask):
    q, k, v = _qkv()
    assert max_err(A.Threshold(0.0)(q, k, v, mask=mask), _gold(q, k, v, mask=mask)) < EXACT


def test_threshold_drops_small_weights_and_renormalises():
    q, k, v = _qkv(Nq=11, Nk=11)
    a = (q @ _repeat(k, 2).transpose(-1, -2) / 4.0).softmax(-1)  # (B, Hq, 11, 11)
    keep = (a >= 0.05) | (a == a.amax(-1, keepdim=True))
    w = a * keep / (a * keep).sum(-1, keepdim=True)
    assert max_err(A.Threshold(0.05)(q, k, v), w @ _repeat(v, 2)) < EXACT


def test_threshold_above_every_weight_keeps_the_row_maximum():
    q, k, v = _qkv(Nq=5, Nk=5)
    out = A.Threshold(0.999)(q, k, v)
    s = q @ _repeat(k, 2).transpose(-1, -2)
    best = _repeat(v, 2).gather(2, s.argmax(-1, keepdim=True).expand(-1, -1, -1, 16))
    assert max_err(out, best) < EXACT


@pytest.mark.parametrize("landmarks", [37, 64])
def test_nystrom_with_a_landmark_per_position_is_exact(landmarks):
    q, k, v = _qkv()
    assert max_err(A.Nystrom(landmarks, pinv_iterations=None)(q, k, v), _gold(q, k, v)) < EXACT
    assert max_err(A.Nystrom(landmarks, pinv_iterations=30)(q, k, v), _gold(q, k, v)) < 1e-8


@pytest.mark.parametrize(("nq", "nk", "landmarks"), [(37, 37, 37), (37, 37, 50), (50, 37, 37), (20, 37, 40)])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (F64, 1e-10)], ids=["f32", "f64"])
def test_nystrom_default_is_exact_once_every_key_is_a_landmark(nq, nk, landmarks, dtype, tol):
    q, k, v = _qkv(Nq=nq, Nk=nk, scale=1.5, dtype=dtype)  # scale 1.5: a peaked, badly conditioned a2
    gold = _gold(*(t.to(F64) for t in (q, k, v)))
    out = A.Nystrom(landmarks)(q, k, v)  # the default 6 iterations would leave an error near 1e-2
    assert out.dtype == dtype
    assert max_err(out, gold) <= tol


def test_nystrom_exact_case_has_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv(B=1, Nq=9, Nk=9))
    A.Nystrom(9)(q, k, v).square().sum().backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    _gold(q2, k2, v2).square().sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert max_err(a.grad, b.grad) < 1e-6  # the pseudo-inverse's gradient sees cond(a2)


def test_nystrom_with_fewer_landmarks_than_keys_keeps_the_iterations():
    from multihead.approx.low_rank import _iterative_pinv

    q, k, v = _qkv(B=1, Hq=1, Hkv=1, Nq=12, Nk=12)
    s = 1 / 4.0
    ql, kl = q.view(1, 1, 3, 4, 16).mean(3), k.view(1, 1, 3, 4, 16).mean(3)  # (1, 1, 3, 16)
    f1 = (q @ kl.transpose(-1, -2) * s).softmax(-1)
    a2 = (ql @ kl.transpose(-1, -2) * s).softmax(-1)
    b3 = (ql @ k.transpose(-1, -2) * s).softmax(-1)
    want = f1 @ _iterative_pinv(a2, 6) @ b3 @ v
    assert max_err(A.Nystrom(3)(q, k, v), want) < EXACT
    q, k, v = _qkv(Nq=12, Nk=12)
    assert max_err(A.Nystrom(11)(q, k, v), _gold(q, k, v)) > 1e-6  # 11 < 12 keys: an approximation


def test_nystrom_with_key_padding_is_exact_on_real_rows():
    q, k, v = _qkv()
    mask = mh.padding([37, 20])
    out, gold = A.Nystrom(37, pinv_iterations=None)(q, k, v, mask=mask), _gold(q, k, v, mask=mask)
    assert max_err(out[0], gold[0]) < EXACT
    assert max_err(out[1, :, :20], gold[1, :, :20]) < EXACT


def test_nystrom_landmarks_are_segment_means_for_any_length():
    from multihead.approx.low_rank import _landmarks

    x = torch.arange(10, dtype=F64).view(1, 1, 10, 1)  # positions 0..9
    lm, present = _landmarks(x, None, 3)
    assert lm.flatten().tolist() == [1.5, 5.0, 8.0]  # segments {0..3}, {4..6}, {7..9}
    assert bool(present.all())


def test_nystrom_definition_with_few_landmarks():
    q, k, v = _qkv(B=1, Hq=1, Hkv=1, Nq=12, Nk=12)
    s = 1 / 4.0
    ql, kl = q.view(1, 1, 3, 4, 16).mean(3), k.view(1, 1, 3, 4, 16).mean(3)  # (1, 1, 3, 16)
    f1 = (q @ kl.transpose(-1, -2) * s).softmax(-1)
    a2 = (ql @ kl.transpose(-1, -2) * s).softmax(-1)
    b3 = (ql @ k.transpose(-1, -2) * s).softmax(-1)
    want = f1 @ torch.linalg.pinv(a2) @ b3 @ v
    assert max_err(A.Nystrom(3, pinv_iterations=None)(q, k, v), want) < EXACT


def test_linformer_with_identity_projections_is_exact():
    q, k, v = _qkv()
    lin = A.Linformer(37, 37)
    with torch.no_grad():
        lin.proj_k.copy_(torch.eye(37))
        lin.proj_v.copy_(torch.eye(37))
    assert max_err(lin(q, k, v), _gold(q, k, v)) < EXACT


def test_linformer_definition_and_shorter_sequences():
    q, k, v = _qkv(Nq=30, Nk=30)
    lin = A.Linformer(8, 64, seed=3)
    e, f = lin.proj_k[:, :30].double(), lin.proj_v[:, :30].double()
    want = _gold(q, e @ k, f @ v)
    assert max_err(lin(q, k, v), want) < EXACT


def test_lowrank_full_rank_is_exact_and_truncation_is_eckart_young():
    q, k, v = _qkv()
    for method in ("svd", "random"):
        assert (
            max_err(A.LowRank(37, method)(q, k, v, mask=mh.causal()), _gold(q, k, v, mask=mh.causal()))
            < EXACT
        )
    a = _gold(q, k, v, return_weights=True).weights  # (B, Hq, N, N)
    u, s, vh = torch.linalg.svd(a)
    want = (u[..., :5] * s[..., None, :5]) @ vh[..., :5, :] @ _repeat(v, 2)
    assert max_err(A.LowRank(5)(q, k, v), want) < EXACT
    u, w = A.LowRank(5, "random")._factors(a, 5)  # randomized range finder: close to the optimum
    best = s[..., 5:].square().sum(-1).sqrt()  # Eckart-Young: the Frobenius error of the best rank 5
    assert bool(((u @ w - a).square().sum((-2, -1)).sqrt() <= 1.05 * best).all())


def test_lowrank_clamp_is_exact_on_short_inputs():
    q, k, v = _qkv(Nq=6, Nk=6)
    assert max_err(A.LowRank(16, clamp=True)(q, k, v), _gold(q, k, v)) < EXACT


# -- linear attention against its quadratic form --------------------------------------------------------
def _quadratic(fq, fk, v, mask=None):
    sim = fq @ _repeat(fk, fq.shape[1] // fk.shape[1]).transpose(-1, -2)  # (B, Hq, Nq, Nk)
    if mask is not None:
        sim = sim * mask
    den = sim.sum(-1, keepdim=True)
    return (sim @ _repeat(v, fq.shape[1] // v.shape[1])) / torch.where(den > 0, den, torch.ones_like(den))


@pytest.mark.parametrize("nq", [37, 1, 5, 50, 130])
def test_linear_attention_against_its_quadratic_form(nq):
    q, k, v = _qkv(Nq=nq, Nk=37 if nq != 130 else 130)
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    lin = A.LinearAttention()
    lin.chunk = 16  # several chunks, the last one partial
    assert max_err(lin(q, k, v), _quadratic(fq, fk, v)) < EXACT
    causal = mh.causal().dense(2, 4, nq, k.shape[2])
    assert max_err(lin(q, k, v, mask=mh.causal()), _quadratic(fq, fk, v, causal)) < EXACT


def test_linear_attention_relu_and_key_padding():
    q, k, v = _qkv()
    keep = mh.padding([37, 11]).dense(2, 4, 37, 37)
    want = _quadratic(F.relu(q), F.relu(k), v, keep & mh.causal().dense(2, 4, 37, 37))
    out = A.LinearAttention("relu")(q, k, v, mask=mh.causal() & mh.padding([37, 11]))
    assert max_err(out, want) < EXACT


def test_performer_causal_form_equals_its_masked_quadratic_form():
    q, k, v = _qkv(scale=0.5)
    perf = A.Performer(64)
    fq = perf.features(q, _problem(q, k, v), True)
    fk = perf.features(k, _problem(q, k, v), False)
    causal = mh.causal().dense(2, 4, 37, 37)
    assert max_err(perf(q, k, v, mask=mh.causal()), _quadratic(fq, fk, v, causal)) < EXACT
    assert max_err(perf(q, k, v), _quadratic(fq, fk, v)) < EXACT


def _problem(q, k, v):
    from multihead.core.problem import make_problem

    return make_problem(q, k, v)


def test_performer_kernel_estimate_is_unbiased():
    """phi(q).phi(k) averaged over many independent features approaches exp(q.k * scale)."""
    q, k, _ = _qkv(B=1, Hq=1, Hkv=1, Nq=6, Nk=6, D=8, scale=0.5)
    perf = A.Performer(200_000, orthogonal=False, seed=1)
    w, s = perf.projection(8), 1 / math.sqrt(8)
    x, y = q[0, 0] * math.sqrt(s), k[0, 0] * math.sqrt(s)

    def phi(z):
        return torch.exp(z @ w.T - (z * z).sum(-1, keepdim=True) / 2) / math.sqrt(w.shape[0])

    exact = torch.exp(x @ y.T)
    assert ((phi(x) @ phi(y).T - exact) / exact).abs().max() < 0.05


@pytest.mark.parametrize("orthogonal", [True, False])
def test_performer_approaches_softmax_with_many_features(orthogonal):
    q, k, v = _qkv(scale=0.5, D=8)
    gold = _gold(q, k, v, mask=mh.causal())
    outs = [A.Performer(f, orthogonal=orthogonal)(q, k, v, mask=mh.causal()) for f in (16, 16384)]
    errs = [float((o - gold).abs().mean()) for o in outs]  # the error falls like 1 / sqrt(features)
    assert errs[1] < 0.01 and errs[1] < errs[0] / 5


def test_performer_features_are_fp32_for_half_inputs_and_finite():
    q, k, v = _qkv(dtype=torch.float16, scale=4.0)  # exp(q.k) far beyond fp16's range
    out = A.Performer(64)(q, k, v, mask=mh.causal())
    assert out.dtype == torch.float16 and bool(torch.isfinite(out).all())


# -- masks, empty rows, dtypes ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "approx",
    [A.TopK(4), A.Threshold(0.1), A.LinearAttention(), A.Performer(32), A.Nystrom(4), A.Linformer(4, 64)],
    ids=repr,
)
def test_rows_without_keys_are_zero(approx):
    q, k, v = _qkv()
    mask = mh.padding([37, 0])
    out = approx(q, k, v, mask=mask)
    assert bool(torch.isfinite(out).all())
    assert float(out[1].abs().max()) == 0.0


@pytest.mark.parametrize(
    "approx",
    [A.TopK(8), A.Threshold(0.01), A.LinearAttention(), A.Performer(32), A.Nystrom(8), A.LowRank(8)],
    ids=repr,
)
def test_float32_matches_float64_within_tolerance(approx):
    q, k, v = _qkv(scale=0.5)
    out32 = approx(q.float(), k.float(), v.float())
    assert out32.dtype == torch.float32
    assert max_err(out32, approx(q, k, v)) < 100 * TOL[torch.float32]


def test_local_masks():
    assert str(A.local(2).picture(5, 5)).splitlines()[1:] == [
        "# # . . .",
        "# # # . .",
        ". # # # .",
        ". . # # #",
        ". . . # #",
    ]
    pic = A.local_global(1, 1).picture(4, 4).splitlines()[1:]
    assert pic == ["# # # #", "# # . .", "# . # .", "# . . #"]
    q, k, v = _qkv()
    m = A.local_global(4, 2) & mh.causal()
    assert (
        max_err(A.SparseMask(A.local_global(4, 2))(q, k, v, mask=mh.causal()), _gold(q, k, v, mask=m)) < EXACT
    )
