"""DifferentialAttention (Ye et al., 2025): the differential heads against a float64 loop over heads, every
backend against the float64 gold (outputs and gradients), KV-cached decode, lambda and its init."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import multihead as mh
from multihead import variants as V
from multihead.core.masks import MaskContext, index_grid
from multihead.variants.differential import default_lambda_init
from tests.numerics import TOL, allowed, max_err

F64 = torch.float64
B, N, M, d, H = 2, 7, 5, 32, 4
D = d // H
BACKENDS = ("reference", "matrix", "sdpa", "tiled")


def randomize(m: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    """Every parameter N(0, std^2), float64."""
    g = torch.Generator().manual_seed(seed)
    m.double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * std)
    return m


def inputs(seed: int = 1, n: int = N):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, n, d, generator=g, dtype=F64), torch.randn(B, M, d, generator=g, dtype=F64)


def lin(t, w, b, rows=slice(None)):
    out = t @ w[rows].T
    return out if b is None else out + b[rows]


def reference(m, x, ctx=None, mask=None, bias=None, head_mask=None):
    """One differential head i at a time: query heads i and i + H/2, kv heads j and j + Hkv/2 (j = i // G),
    V = V_j (+) V_{j + Hkv/2}; (1 - lambda_init) RMSNorm(hm_i A1 V - lambda hm_{i+H/2} A2 V); W^O."""
    src = x if ctx is None else ctx
    w, b, Hkv = m.qkv_proj.weight, m.qkv_proj.bias, m.n_kv_heads
    G, L = H // Hkv, src.shape[1]
    allowed_ = None if mask is None else mask.dense(B, H, x.shape[1], L)
    hm = torch.ones(H, dtype=F64) if head_mask is None else head_mask

    def q_(i):
        return lin(x, w, b, slice(i * D, (i + 1) * D))

    def k_(j):
        return lin(src, w, b, slice((H + j) * D, (H + j + 1) * D))

    def v_(j):
        return lin(src, w, b, slice((H + Hkv + j) * D, (H + Hkv + j + 1) * D))

    def weights(i, j):
        s = q_(i) @ k_(j).transpose(-1, -2) / math.sqrt(D)
        if bias is not None:
            s = s + bias[:, i]
        if allowed_ is not None:
            s = s.masked_fill(~allowed_[:, i], -math.inf)
        return torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)

    lam = (
        math.exp(float(m.lambda_q1.detach() @ m.lambda_k1.detach()))
        - math.exp(float(m.lambda_q2.detach() @ m.lambda_k2.detach()))
        + m.lambda_init
    )
    heads = []
    for i in range(H // 2):
        j = i // G
        value = torch.cat([v_(j), v_(j + Hkv // 2)], dim=-1)  # (B, L, 2D)
        o = hm[i] * weights(i, j) @ value - lam * hm[i + H // 2] * weights(i + H // 2, j + Hkv // 2) @ value
        o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + m.norm_eps)
        if m.norm_weight is not None:
            o = o * m.norm_weight
        heads.append((1 - m.lambda_init) * o)
    return lin(torch.cat(heads, dim=-1), m.o_proj.weight, m.o_proj.bias)


MASKS = {
    "none": None,
    "causal": mh.causal(),
    "per-head": mh.custom(lambda b, h, q, k: (k <= q) | (h == 3)),  # head 3 (a second map) sees all
    "empty-row": mh.causal() & mh.custom(lambda b, h, q, k: q != 2),  # query 2 sees nothing: zeros
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("n_kv", [H, 2])
def test_matches_a_float64_loop_over_heads(n_kv, mask):
    m = randomize(V.DifferentialAttention(d, H, n_kv, layer_idx=2)).eval()
    x, ctx = inputs()
    hm = torch.tensor([1.0, 0.5, 0.0, 2.0], dtype=F64)
    got = m(x, mask=MASKS[mask], head_mask=hm)
    assert max_err(got, reference(m, x, mask=MASKS[mask], head_mask=hm)) < TOL[F64]
    assert max_err(m(x, ctx), reference(m, x, ctx)) < TOL[F64]  # cross-attention


def test_per_head_biases_and_a_learned_norm_scale():
    m = randomize(V.DifferentialAttention(d, H, 2, norm_affine=True, lambda_init=0.5), seed=2).eval()
    x, _ = inputs(seed=3)
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(B, H, N, N, generator=g, dtype=F64)
    assert max_err(m(x, bias=bias, mask=mh.causal()), reference(m, x, mask=mh.causal(), bias=bias)) < TOL[F64]
    alibi = mh.alibi(H)  # a bias object over the four query heads
    dense = alibi.values(*index_grid(MaskContext(B, H, N, N)), MaskContext(B, H, N, N)).expand(B, H, N, N)
    assert max_err(m(x, bias=alibi), reference(m, x, bias=dense)) < TOL[F64]


def test_every_backend_follows_the_float64_gold():
    """float32 on each backend: outputs within 2x, gradients within 3x the plain matrix path's error. The
    gradient of a lambda vector sums over every output entry, so its float32 error is that of the
    summation order, whichever backend: it is held to float32's relative tolerance instead."""
    m64 = randomize(V.DifferentialAttention(d, H, 2, rotary=mh.RotaryEmbedding(D)), seed=5).eval()
    x64, _ = inputs(seed=6, n=33)

    def run(m, x):
        x = x.clone().requires_grad_(True)
        y = m(x, mask=mh.causal())
        y.pow(2).sum().backward()
        return y.detach(), x.grad, m.qkv_proj.weight.grad, m.lambda_q2.grad

    m64.backend = "reference"
    gold = run(m64, x64)
    errs = {}
    for name in BACKENDS:
        m32 = copy.deepcopy(m64).float()
        m32.zero_grad()
        m32.backend = name
        errs[name] = [max_err(a, b) for a, b in zip(run(m32, x64.float()), gold)]
    base = errs["matrix"]
    for name, (out, gx, gw, glam) in errs.items():
        assert out <= allowed(base[0]), (name, errs)
        assert gx <= allowed(base[1], grad=True) and gw <= allowed(base[2], grad=True), (name, errs)
        assert glam <= TOL[torch.float32] * gold[3].abs().max().item(), (name, errs)


@pytest.mark.parametrize("n_kv", [H, 2])
def test_kv_cached_decode_equals_the_full_pass(n_kv):
    m = randomize(V.DifferentialAttention(d, H, n_kv, rotary=mh.RotaryEmbedding(D)), seed=7).eval()
    x, _ = inputs(seed=8)
    full = m(x, mask=mh.causal())
    cache = mh.KVCache(B, n_kv, D, N, dtype=F64)
    steps = [m(x[:, :3], mask=mh.causal(), cache=cache)]
    steps += [m(x[:, t : t + 1], mask=mh.causal(), cache=cache) for t in range(3, N)]
    assert cache.length == N
    assert max_err(torch.cat(steps, dim=1), full) < TOL[F64]


def test_lambda_and_its_initial_value():
    assert default_lambda_init(0) == pytest.approx(0.2)  # 0.8 - 0.6: the first layer
    assert default_lambda_init(1) == pytest.approx(0.8 - 0.6 * math.exp(-0.3))
    assert default_lambda_init(40) == pytest.approx(0.8, abs=1e-5)
    m = V.DifferentialAttention(d, H, layer_idx=3)
    assert m.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.9))
    assert V.DifferentialAttention(d, H, layer_idx=3, lambda_init=0.25).lambda_init == 0.25
    with torch.no_grad():
        m.lambda_q1.fill_(0.1)
        m.lambda_k1.fill_(0.2)
        m.lambda_q2.zero_()
    want = math.exp(0.02 * D) - 1.0 + m.lambda_init
    assert float(m.lambda_full().detach()) == pytest.approx(want, rel=1e-6)
    assert not V.DifferentialAttention(d, H, lambda_std=0.0).lambda_k1.detach().any()
    big = V.DifferentialAttention(512, 2)  # D = 256 entries per vector, N(0, 0.1)
    assert 0.07 < float(big.lambda_q1.detach().std()) < 0.13


def test_gradients_reach_every_parameter_and_the_input():
    m = randomize(V.build("differential", d, H, n_kv_heads=2, norm_affine=True), seed=9).train()
    x, _ = inputs(seed=10)
    x.requires_grad_(True)
    m(x, mask=mh.causal()).pow(2).mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_an_empty_row_gives_zeros_and_finite_gradients():
    m = randomize(V.DifferentialAttention(d, H, 2, bias=False), seed=11)
    x, _ = inputs(seed=12)
    x.requires_grad_(True)
    y = m(x, mask=MASKS["empty-row"])
    assert torch.equal(y[:, 2], torch.zeros_like(y[:, 2]))  # no bias: W^O of zero heads
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: V.DifferentialAttention(d, 2, 1), r"needs an even n_heads and n_kv_heads .* n_kv_heads=1"),
        (lambda: V.DifferentialAttention(24, 3), r"needs an even n_heads and n_kv_heads .* n_heads=3"),
        (lambda: V.DifferentialAttention(d, H, layer_idx=-1), r"layer_idx must be an int >= 0, got -1"),
        (lambda: V.DifferentialAttention(d, H, lambda_init=math.nan), r"lambda_init must be a finite number"),
        (lambda: V.DifferentialAttention(d, H, lambda_std=-1.0), r"lambda_std must be a number in \[0.0"),
        (lambda: V.DifferentialAttention(d, H, norm_eps=0.0), r"norm_eps must be > 0, got 0.0"),
        (lambda: V.build("differential", d, H, n_kv_heads=1), r"n_kv_heads=1"),
    ],
)
def test_bad_arguments_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_auto_sends_long_maps_with_wide_values_past_torchs_cpu_sdpa():
    """A differential head's values are 2D wide; torch's CPU SDPA computes Dv != D on its math path, so
    from 128 x 128 scores on, auto takes the tiled kernel."""
    q, k = torch.randn(1, 2, 256, 8), torch.randn(1, 2, 256, 8)
    wide, narrow = torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 8)
    assert mh.explain(q, k, wide, mask=mh.causal()).splitlines()[1].startswith("auto -> tiled")
    assert "torch's SDPA computes Dv=16 != D=8 with its math path" in mh.explain(q, k, wide, mask=mh.causal())
    assert mh.explain(q, k, narrow, mask=mh.causal()).splitlines()[1].startswith("auto -> sdpa")
    short = mh.explain(q[:, :, :16], k[:, :, :16], wide[:, :, :16], mask=mh.causal())
    assert short.splitlines()[1].startswith("auto -> sdpa")


def test_swap_gives_each_layer_its_depth():
    lm = mh.TransformerLM(50, d, 3, H, 2 * d, n_kv_heads=2)
    out = V.swap(lm, "differential")
    assert [layer.self_attn.layer_idx for layer in out.layers] == [0, 1, 2]
    assert [layer.self_attn.lambda_init for layer in out.layers] == [default_lambda_init(i) for i in range(3)]
    assert {layer.self_attn.layer_idx for layer in V.swap(lm, "differential", layer_idx=5).layers} == {5}
