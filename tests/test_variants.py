"""The head designs of mh.variants against their equations written a second, naive way (float64).

Each reference below loops over heads (and, where a design works per token or per (query, key) pair, over
those too) and reads the module's parameters directly; the modules compute the same thing vectorised,
through the fused core or the explicit-score path. Parameters are randomised first, so zero-initialised
parts (DCMHA's dynamic weights, MoH's routers) take part in the check.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import multihead as mh
from multihead import variants as V
from multihead.variants.gated import hard_concrete, l0_norm
from tests.numerics import TOL, max_err

F64 = torch.float64
B, N, M, d, H = 2, 7, 5, 24, 4
D = d // H


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


def softmax_rows(s):
    """Softmax over the last dim; a row with no finite score gives zeros (the design contract)."""
    return torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)


def dense(mask, n_heads, n, length):
    return None if mask is None else mask.dense(B, n_heads, n, length)  # (B, H, N, L)


def out_proj(m, heads, head_mask):
    """concat_i(head_i * head_mask_i) W^O + b^O, heads a list of (B, N, Dh)."""
    hm = torch.ones(len(heads), dtype=F64) if head_mask is None else head_mask
    return lin(torch.cat([h * hm[i] for i, h in enumerate(heads)], dim=-1), m.o_proj.weight, m.o_proj.bias)


def qkv_rows(m, x, src):
    """Per-head q (Hq of them) and k, v (Hkv of them) of a module with MHA's fused qkv_proj layout."""
    w, b, Hq, Hkv, Dh = m.qkv_proj.weight, m.qkv_proj.bias, m.n_heads, m.n_kv_heads, m.head_dim
    q = [lin(x, w, b, slice(i * Dh, (i + 1) * Dh)) for i in range(Hq)]
    k = [lin(src, w, b, slice((Hq + j) * Dh, (Hq + j + 1) * Dh)) for j in range(Hkv)]
    v = [lin(src, w, b, slice((Hq + Hkv + j) * Dh, (Hq + Hkv + j + 1) * Dh)) for j in range(Hkv)]
    return q, k, v


# -- naive references ------------------------------------------------------------------------------------
def ref_talking(m, x, ctx=None, mask=None, head_mask=None):
    """Talking heads: L_h = sum_g J_g P_l[g, h]; W = softmax(L); U_h = sum_g W_g P_w[g, h]; O_h = U_h V_h."""
    src = x if ctx is None else ctx
    q, k, v = qkv_rows(m, x, src)
    G = m.n_heads // m.n_kv_heads
    J = [q[i] @ k[i // G].transpose(-1, -2) / math.sqrt(D) for i in range(H)]
    allowed = dense(mask, H, x.shape[1], src.shape[1])
    Pl, Pw = m.logit_mix, m.weight_mix
    W = []
    for h in range(H):
        L = sum(J[g] * Pl[g, h] for g in range(H))
        if allowed is not None:
            L = L.masked_fill(~allowed[:, h], float("-inf"))
        W.append(softmax_rows(L))
    heads = []
    for h in range(H):
        U = sum(W[g] * Pw[g, h] for g in range(H))
        if allowed is not None:
            U = U.masked_fill(~allowed[:, h], 0.0)
        heads.append(U @ v[h // G])
    return out_proj(m, heads, head_mask)


def ref_compose(c, a, xq, xk):
    """DCMHA Compose at every (b, i, j), one head-score vector at a time."""
    Hh, R = c.static.shape[0], c.query_side.rank

    def weights(side, xv):
        w = side.out.weight @ F.gelu(side.hidden.weight @ xv)
        return w[: Hh * R].reshape(Hh, R), w[Hh * R :].reshape(R, Hh), torch.tanh(side.gate.weight @ xv)

    out = torch.empty_like(a)
    for b in range(a.shape[0]):
        for i in range(a.shape[2]):
            q1, q2, qg = weights(c.query_side, xq[b, i])
            for j in range(a.shape[3]):
                k1, k2, kg = weights(c.key_side, xk[b, j])
                s = a[b, :, i, j]
                out[b, :, i, j] = s @ c.static + (s @ q1) @ q2 + s * qg + (s @ k1) @ k2 + s * kg
    return out


def ref_dcmha(m, x, ctx=None, mask=None, head_mask=None):
    src = x if ctx is None else ctx
    q, k, v = qkv_rows(m, x, src)
    G = m.n_heads // m.n_kv_heads
    a = torch.stack([q[i] @ k[i // G].transpose(-1, -2) / math.sqrt(D) for i in range(H)], dim=1)
    a = ref_compose(m.pre, a, x, src)
    allowed = dense(mask, H, x.shape[1], src.shape[1])
    if allowed is not None:
        a = a.masked_fill(~allowed, float("-inf"))
    w = ref_compose(m.post, softmax_rows(a), x, src)
    if allowed is not None:
        w = w.masked_fill(~allowed, 0.0)
    return out_proj(m, [w[:, h] @ v[h // G] for h in range(H)], head_mask)


def ref_mohsa(m, x, ctx=None, mask=None, head_mask=None):
    """Each head reads [i D - o, (i + 1) D + o) of the concatenated q / k / v, zeros outside."""
    src = x if ctx is None else ctx
    o, Hkv = m.overlap_dim, m.n_kv_heads
    q, k, v = qkv_rows(m, x, src)

    def widen(parts, i):
        full = torch.cat(parts, dim=-1)
        lo, hi = i * D - o, (i + 1) * D + o
        left = full.new_zeros(*full.shape[:-1], max(0, -lo))
        right = full.new_zeros(*full.shape[:-1], max(0, hi - full.shape[-1]))
        return torch.cat([left, full[..., max(lo, 0) : min(hi, full.shape[-1])], right], dim=-1)

    G = H // Hkv
    allowed = dense(mask, H, x.shape[1], src.shape[1])
    heads = []
    for i in range(H):
        qi, ki, vi = widen(q, i), widen(k, i // G), widen(v, i // G)
        s = qi @ ki.transpose(-1, -2) / math.sqrt(D + 2 * o)
        if allowed is not None:
            s = s.masked_fill(~allowed[:, i], float("-inf"))
        heads.append(softmax_rows(s) @ vi)
    return out_proj(m, heads, head_mask)


def ref_collab(m, x, ctx=None, mask=None, head_mask=None):
    """scores_i = (X W~_Q + b~_Q) diag(m_i) (X W~_K + b~_K)^T / sqrt(D)."""
    src = x if ctx is None else ctx
    qt, kt = lin(x, m.q_proj.weight, m.q_proj.bias), lin(src, m.k_proj.weight, m.k_proj.bias)
    allowed = dense(mask, H, x.shape[1], src.shape[1])
    heads = []
    for i in range(H):
        s = (qt * m.mixing[i]) @ kt.transpose(-1, -2) / math.sqrt(D)
        if allowed is not None:
            s = s.masked_fill(~allowed[:, i], float("-inf"))
        heads.append(softmax_rows(s) @ lin(src, m.v_proj.weight, m.v_proj.bias, slice(i * D, (i + 1) * D)))
    return out_proj(m, heads, head_mask)


def ref_heads(m, x, src, allowed):
    """Plain per-head attention of a module with MHA's qkv layout: a list of (B, N, D)."""
    q, k, v = qkv_rows(m, x, src)
    G = m.n_heads // m.n_kv_heads
    heads = []
    for i in range(m.n_heads):
        s = q[i] @ k[i // G].transpose(-1, -2) / math.sqrt(m.head_dim)
        if allowed is not None:
            s = s.masked_fill(~allowed[:, i], float("-inf"))
        heads.append(softmax_rows(s) @ v[i // G])
    return heads


def ref_moh(m, x, ctx=None, mask=None, head_mask=None):
    """MoH routing one token at a time: g_i = alpha_1 softmax(W_s x)_i or alpha_2 softmax(W_r x)_i (top-k)."""
    src = x if ctx is None else ctx
    heads = ref_heads(m, x, src, dense(mask, H, x.shape[1], src.shape[1]))
    Hs, Hr, k = m.n_shared, m.n_heads - m.n_shared, m.top_k
    hm = torch.ones(H, dtype=F64) if head_mask is None else head_mask
    out = torch.empty_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            xt = x[b, t]
            alpha = torch.softmax(m.router_groups.weight @ xt, 0)
            ps, pr = (
                torch.softmax(m.router_shared.weight @ xt, 0),
                torch.softmax(m.router_routed.weight @ xt, 0),
            )
            top = sorted(range(Hr), key=lambda j: -pr[j].item())[:k]
            g = [alpha[0] * ps[i] for i in range(Hs)] + [
                alpha[1] * pr[j] if j in top else 0.0 for j in range(Hr)
            ]
            cat = torch.cat([g[i] * heads[i][b, t] * hm[i] for i in range(H)])
            out[b, t] = lin(cat, m.o_proj.weight, m.o_proj.bias)
    return out


def ref_gated(m, x, gates, ctx=None, mask=None):
    src = x if ctx is None else ctx
    return out_proj(m, ref_heads(m, x, src, dense(mask, H, x.shape[1], src.shape[1])), gates)


def naive_hard_concrete(log_alpha, u, beta):
    out = []
    for la, ui in zip(log_alpha.tolist(), u.tolist()):
        s = 1 / (1 + math.exp(-(math.log(ui) - math.log(1 - ui) + la) / beta))
        out.append(min(1.0, max(0.0, s * 1.2 - 0.1)))
    return torch.tensor(out, dtype=F64)


# -- the equation checks --------------------------------------------------------------------------------
DESIGNS = {
    "talking": (lambda: V.TalkingHeads(d, H, 2), ref_talking),
    "dcmha": (lambda: V.DynamicComposition(d, H, 2, rank=2), ref_dcmha),
    "mohsa": (lambda: V.OverlappingHeads(d, H, 2, overlap=0.34), ref_mohsa),
    "collab": (lambda: V.CollaborativeHeads(d, H, d_shared=10), ref_collab),
    "moh": (lambda: V.MixtureOfHeads(d, H, 2, n_shared=2, top_k=1, skip="always"), ref_moh),
    "moh-dense": (lambda: V.MixtureOfHeads(d, H, n_shared=1, top_k=2, skip="never"), ref_moh),
}
EXTRA = {"mohsa": {"overlap": 0.34}}  # D = 6: 2 features per side, whole rotary pairs
MASKS = {
    "none": None,
    "causal": mh.causal(),
    "per-head": mh.custom(lambda b, h, q, k: (k <= q) | (h == 1)),  # head 1 sees everything
    "empty-row": mh.causal() & mh.custom(lambda b, h, q, k: q != 2),  # query 2 sees nothing: zeros
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("design", list(DESIGNS))
def test_self_attention_matches_the_naive_equations(design, mask):
    make, ref = DESIGNS[design]
    m = randomize(make()).eval()
    x, _ = inputs()
    head_mask = torch.tensor([1.0, 0.5, 0.0, 2.0], dtype=F64)
    got = m(x, mask=MASKS[mask], head_mask=head_mask)
    want = ref(m, x, mask=MASKS[mask], head_mask=head_mask)
    assert max_err(got, want) < TOL[F64]


@pytest.mark.parametrize("design", list(DESIGNS))
def test_cross_attention_matches_the_naive_equations(design):
    make, ref = DESIGNS[design]
    m = randomize(make(), seed=3).eval()
    x, ctx = inputs(seed=4)
    assert max_err(m(x, ctx), ref(m, x, ctx)) < TOL[F64]


def test_gated_heads_match_the_hard_concrete_equations():
    m = randomize(V.GatedHeads(d, H, 2, l0_weight=0.5), seed=5)
    x, ctx = inputs(seed=6)
    la = m.log_alpha.detach()
    m.eval()  # deterministic gates: clamp(sigmoid(log_alpha) (zeta - gamma) + gamma, 0, 1)
    det = torch.tensor([min(1.0, max(0.0, 1.2 / (1 + math.exp(-a)) - 0.1)) for a in la.tolist()], dtype=F64)
    assert max_err(m(x, mask=mh.causal()), ref_gated(m, x, det, mask=mh.causal())) < TOL[F64]
    assert max_err(m(x, ctx), ref_gated(m, x, det, ctx)) < TOL[F64]
    l0 = sum(1 / (1 + math.exp(-(a - (2 / 3) * math.log(0.1 / 1.1)))) for a in la.tolist())
    assert abs(m.aux_loss.item() - 0.5 * l0) < TOL[F64]
    assert abs(float(l0_norm(la, 2 / 3)) - l0) < TOL[F64]
    m.train()  # one sample per forward: the first random draw of the call
    torch.manual_seed(7)
    got = m(x, mask=mh.causal())
    torch.manual_seed(7)
    u = torch.rand(H, dtype=F64)
    want = ref_gated(m, x, naive_hard_concrete(la, u, 2 / 3), mask=mh.causal())
    assert max_err(got, want) < TOL[F64]
    assert max_err(hard_concrete(la, u, 2 / 3), naive_hard_concrete(la, u, 2 / 3)) < TOL[F64]


def test_fresh_talking_dcmha_gated_and_zero_overlap_modules_are_multi_head_attention():
    """Identity mixing, identity static composition with zero dynamic parts, open gates, overlap 0."""
    x, _ = inputs(seed=8)
    for m in (
        V.TalkingHeads(d, H),
        V.DynamicComposition(d, H),
        V.GatedHeads(d, H),
        V.OverlappingHeads(d, H, overlap=0.0),
    ):
        m.double().eval()
        mha = mh.MultiHeadAttention(d, H).double().eval()
        mha.load_state_dict(
            {k: v for k, v in m.state_dict().items() if k.split(".")[0] in ("qkv_proj", "o_proj")}
        )
        assert max_err(m(x, mask=mh.causal()), mha(x, mask=mh.causal())) < TOL[F64], type(m).__name__


def test_rotary_keeps_scores_relative():
    """Shifting every position by the same offset leaves each design's output unchanged."""
    rot = mh.RotaryEmbedding(D)
    x, _ = inputs(seed=9)
    pos = torch.arange(N)
    for make in (
        lambda: V.OverlappingHeads(d, H, overlap=0.5, rotary=rot),
        lambda: V.CollaborativeHeads(d, H, d_shared=12, rotary=rot),
        lambda: V.MixtureOfHeads(d, H, top_k=1, rotary=rot, skip="always"),
        lambda: V.TalkingHeads(d, H, rotary=rot),
        lambda: V.DynamicComposition(d, H, rotary=rot),
        lambda: V.GatedHeads(d, H, rotary=rot),
    ):
        m = randomize(make(), seed=10).eval()
        a = m(x, mask=mh.causal(), positions=pos)
        b = m(x, mask=mh.causal(), positions=pos + 37)
        c = m(x, mask=mh.causal(), positions=pos * 2)  # not a shift: the output must change
        assert max_err(a, b) < 1e-9, type(m).__name__
        assert max_err(a, c) > 1e-6, type(m).__name__


@pytest.mark.parametrize("name", ["moh", "mohsa", "talking", "gated"])
def test_cache_decode_equals_the_full_causal_pass(name):
    rot = mh.RotaryEmbedding(D)
    m = randomize(V.build(name, d, H, n_kv_heads=2, rotary=rot, **EXTRA.get(name, {})), seed=11).eval()
    x, _ = inputs(seed=12)
    full = m(x, mask=mh.causal())
    cache = mh.KVCache(B, 2, D, N, dtype=F64)
    steps = [m(x[:, :4], mask=mh.causal(), cache=cache)]
    steps += [m(x[:, t : t + 1], mask=mh.causal(), cache=cache) for t in range(4, N)]
    assert max_err(torch.cat(steps, dim=1), full) < TOL[F64]


# -- CollaborativeHeads re-parametrisation ----------------------------------------------------------------
@pytest.mark.parametrize(("n_kv", "rotary"), [(H, False), (2, True), (1, False)])
def test_collab_from_mha_is_exact_at_full_rank(n_kv, rotary):
    rot = mh.RotaryEmbedding(D) if rotary else None
    mha = randomize(mh.MultiHeadAttention(d, H, n_kv, rotary=rot), seed=13).eval()
    collab = V.CollaborativeHeads.from_mha(mha).eval()
    assert collab.d_shared == H * D and collab.mixing.dtype == F64
    x, ctx = inputs(seed=14)
    mask = mh.causal()
    assert max_err(collab(x, mask=mask), mha(x, mask=mask)) < TOL[F64]
    if not rotary:
        assert max_err(collab(x, ctx), mha(x, ctx)) < TOL[F64]


def test_collab_from_mha_recovers_a_shared_low_rank_structure():
    """An MHA with W_Q^i = (A diag(m_i))^T, W_K^i = B^T, b_Q^i = m_i * c (one rank-D CP structure shared by
    the heads) is fitted at d_shared = D; below that rank the fit is only an approximation."""
    g = torch.Generator().manual_seed(15)
    a, bk, mix = (torch.randn(*s, generator=g, dtype=F64) for s in ((d, D), (d, D), (H, D)))
    c = torch.randn(D, generator=g, dtype=F64)
    mha = mh.MultiHeadAttention(d, H).double().eval()
    with torch.no_grad():
        w, b = mha.qkv_proj.weight, mha.qkv_proj.bias
        w[: H * D] = torch.cat([(a * mix[i]).T for i in range(H)])  # rows of W_Q^i: (A diag(m_i))^T
        w[H * D : 2 * H * D] = bk.T.repeat(H, 1)
        b[: H * D] = (mix * c).reshape(-1)
    x, _ = inputs(seed=16)
    low = V.CollaborativeHeads.from_mha(mha, D, iters=200).eval()
    ref = mha(x, mask=mh.causal())
    assert max_err(low(x, mask=mh.causal()), ref) < 1e-6 * ref.abs().max()
    worse = V.CollaborativeHeads.from_mha(mha, 2, iters=50).eval()  # below the true rank: an approximation
    assert max_err(worse(x, mask=mh.causal()), ref) > 1e-4


# -- gradients, copies, aux losses ---------------------------------------------------------------------
#: the designs that are plain MultiHeadAttention (no aux_loss): head counts or learned sinks only
PLAIN = ("mha", "gqa", "mqa", "sinks")
NEW_HEADS = [n for n in V.NAMES if n not in PLAIN]


@pytest.mark.parametrize("name", NEW_HEADS)
def test_gradients_reach_every_parameter(name):
    m = randomize(V.build(name, d, H, rotary=mh.RotaryEmbedding(D), **EXTRA.get(name, {})), seed=17).train()
    if name == "moh":
        m.skip = "always"  # the skipping path must train as well
    x, _ = inputs(seed=18)
    x.requires_grad_(True)
    loss = m(x, mask=mh.causal()).pow(2).mean() + m.aux_loss
    loss.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for pname, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname
    copy.deepcopy(m)  # the aux loss of the last forward carries a graph: copies must still work


def test_aux_losses_are_set_and_summed():
    x, _ = inputs(seed=19)
    for name in NEW_HEADS:
        m = V.build(name, d, H).double()
        m(x)
        assert isinstance(m.aux_loss, torch.Tensor) and m.aux_loss.dim() == 0
        assert (m.aux_loss > 0) == (name in ("moh", "gated")), name
    lm = V.swap(mh.TransformerLM(32, d, 2, H, 2 * d), "moh", balance_weight=1.0)
    lm(torch.randint(0, 32, (B, N)))
    layers = [layer.self_attn.aux_loss for layer in lm.layers]
    assert torch.allclose(V.aux_loss(lm), layers[0] + layers[1])
    assert float(V.aux_loss(mh.TransformerLM(32, d, 1, H, 2 * d))) == 0.0


@pytest.mark.parametrize("name", NEW_HEADS)
def test_lower_precision_follows_float64(name):
    """float32 stays within float32 rounding of the float64 result; bfloat16 runs and stays finite."""
    m64 = randomize(V.build(name, d, H, rotary=mh.RotaryEmbedding(D), **EXTRA.get(name, {})), seed=20).eval()
    x, _ = inputs(seed=21)
    want = m64(x, mask=mh.causal())
    m32 = copy.deepcopy(m64).float()
    assert max_err(m32(x.float(), mask=mh.causal()), want) < 1e-4 * max(1.0, want.abs().max().item())
    y = copy.deepcopy(m64).bfloat16()(x.bfloat16(), mask=mh.causal())
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
