"""MultiHeadAttention against a hand-written float64 eq. (3)-(5), weight loading, GQA, cache, dropout."""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from multihead.nn.attention import MultiHeadAttention
from tests.numerics import TOL, max_err

F64 = torch.float64


def random_weights(d_model, Hq, Hkv, D, bias, seed=0):
    """Separate W_Q, W_K, W_V, W^O (nn.Linear layout: out x in) and biases, float64."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=F64) / math.sqrt(shape[-1])

    w = {
        "q_proj.weight": r(Hq * D, d_model),
        "k_proj.weight": r(Hkv * D, d_model),
        "v_proj.weight": r(Hkv * D, d_model),
        "o_proj.weight": r(d_model, Hq * D),
    }
    if bias:
        for name, n in (("q", Hq * D), ("k", Hkv * D), ("v", Hkv * D), ("o", d_model)):
            w[f"{name}_proj.bias"] = torch.randn(n, generator=g, dtype=F64)
    return w


def reference_mha(w, x, Hq, Hkv, D, *, context=None, mask=None, head_mask=None):
    """eq. (3)-(5), one head at a time: head_i = softmax(Q^i K^iT / sqrt(d_k)) V^i, concat, W^O.

    x (B, N, d), context (B, M, d), mask (N, M) bool (True = may attend), head_mask (Hq,).
    """
    src = x if context is None else context
    G = Hq // Hkv

    def lin(t, name, rows):
        out = t @ w[f"{name}_proj.weight"][rows].T
        b = w.get(f"{name}_proj.bias")
        return out if b is None else out + b[rows]

    heads = []
    for i in range(Hq):
        j = i // G  # the kv head query head i reads
        Q = lin(x, "q", slice(i * D, (i + 1) * D))  # (B, N, D)   eq. (3)
        K = lin(src, "k", slice(j * D, (j + 1) * D))  # (B, M, D)
        V = lin(src, "v", slice(j * D, (j + 1) * D))  # (B, M, D)
        S = Q @ K.transpose(-1, -2) / math.sqrt(D)  # (B, N, M)
        if mask is not None:
            S = S.masked_fill(~mask, float("-inf"))
        head = torch.softmax(S, dim=-1) @ V  # (B, N, D)   eq. (4)
        heads.append(head if head_mask is None else head * head_mask[i])
    return lin(torch.cat(heads, dim=-1), "o", slice(None))  # (B, N, d)   eq. (5)


def build(d_model, Hq, Hkv, D, bias, **kw):
    m = MultiHeadAttention(d_model, Hq, Hkv, head_dim=D, bias=bias, dtype=F64, **kw)
    w = random_weights(d_model, Hq, Hkv, m.head_dim, bias)
    m.load_state_dict(w)  # separate q/k/v keys go through the fusing pre-hook
    return m, w


# (d_model, Hq, Hkv, head_dim, bias, N): MHA, GQA, MQA, an odd head dim (Hq * D != d_model), N = 1 and 113
GRID = [
    (64, 4, 4, None, True, 113),
    (64, 8, 2, None, False, 17),
    (64, 4, 1, None, True, 1),
    (48, 3, 1, 59, True, 113),
    (40, 6, 3, 59, False, 1),
]


@pytest.mark.parametrize("d_model,Hq,Hkv,D,bias,N", GRID)
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_matches_eq_9_33_to_9_35(d_model, Hq, Hkv, D, bias, N, causal):
    m, w = build(d_model, Hq, Hkv, D, bias)
    x = torch.randn(2, N, d_model, dtype=F64)
    out = m(x, mask=mh.causal() if causal else None)
    tril = torch.ones(N, N, dtype=torch.bool).tril() if causal else None
    ref = reference_mha(w, x, Hq, Hkv, m.head_dim, mask=tril)
    assert out.shape == (2, N, d_model)
    assert max_err(out, ref) <= TOL[F64]


@pytest.mark.parametrize("d_model,Hq,Hkv,D,bias,N", GRID)
def test_cross_attention_matches_reference(d_model, Hq, Hkv, D, bias, N):
    m, w = build(d_model, Hq, Hkv, D, bias)
    x = torch.randn(2, N, d_model, dtype=F64)
    ctx = torch.randn(2, 29, d_model, dtype=F64)
    real = torch.ones(2, 29, dtype=torch.bool)
    real[1, 20:] = False
    out = m(x, ctx, mask=mh.key_padding(real))
    ref = torch.stack(
        [
            reference_mha(
                w, x[b : b + 1], Hq, Hkv, m.head_dim, context=ctx[b : b + 1], mask=real[b][None, :]
            )[0]
            for b in range(2)
        ]
    )
    assert max_err(out, ref) <= TOL[F64]


@pytest.mark.parametrize("backend", ["reference", "matrix", "sdpa", "tiled"])
def test_every_backend_gives_the_same_module_output(backend):
    m, w = build(32, 4, 2, None, True, backend=backend)
    x = torch.randn(2, 13, 32, dtype=F64)
    ref = reference_mha(w, x, 4, 2, 8, mask=torch.ones(13, 13, dtype=torch.bool).tril())
    assert max_err(m(x, mask=mh.causal()), ref) <= TOL[F64]


def test_fused_layout_split_and_load_round_trip():
    m, w = build(48, 6, 2, None, True)
    sd = m.state_dict()
    assert set(sd) == {"qkv_proj.weight", "qkv_proj.bias", "o_proj.weight", "o_proj.bias"}
    # the fused weight is [W_Q; W_K; W_V] row blocks
    fused = torch.cat([w["q_proj.weight"], w["k_proj.weight"], w["v_proj.weight"]])
    assert torch.equal(sd["qkv_proj.weight"], fused)
    split = m.split_state_dict()
    assert set(split) == set(w)
    for key, t in w.items():
        assert torch.equal(split[key], t), key
    # loading the fused form and the split form give the same module
    a = MultiHeadAttention(48, 6, 2, dtype=F64)
    a.load_state_dict(sd)
    b = MultiHeadAttention(48, 6, 2, dtype=F64)
    b.load_state_dict(split)
    x = torch.randn(3, 7, 48, dtype=F64)
    assert torch.equal(a(x), m(x)) and torch.equal(b(x), m(x))


def test_loading_split_weights_inside_a_parent_module_uses_the_prefix():
    parent = torch.nn.ModuleDict({"attn": MultiHeadAttention(16, 2, dtype=F64)})
    w = random_weights(16, 2, 2, 8, True)
    parent.load_state_dict({f"attn.{k}": v for k, v in w.items()})
    x = torch.randn(1, 5, 16, dtype=F64)
    assert max_err(parent["attn"](x), reference_mha(w, x, 2, 2, 8)) <= TOL[F64]


def test_partial_split_weights_are_reported_by_strict_loading():
    w = random_weights(16, 2, 2, 8, False)
    del w["v_proj.weight"]
    with pytest.raises(RuntimeError, match=r"qkv_proj\.weight"):
        MultiHeadAttention(16, 2, bias=False, dtype=F64).load_state_dict(w)


@pytest.mark.parametrize("Hkv", [1, 2])
def test_gqa_equals_mha_with_repeated_kv_weights(Hkv):
    d, Hq, D = 32, 4, 8
    G = Hq // Hkv
    gqa, w = build(d, Hq, Hkv, None, True)
    rep = dict(w)
    for name in ("k", "v"):
        wk, bk = w[f"{name}_proj.weight"], w[f"{name}_proj.bias"]
        rep[f"{name}_proj.weight"] = (
            wk.view(Hkv, D, d).repeat_interleave(G, 0).reshape(Hq * D, d)
        )  # i <- i // G
        rep[f"{name}_proj.bias"] = bk.view(Hkv, D).repeat_interleave(G, 0).reshape(Hq * D)
    mha = MultiHeadAttention(d, Hq, dtype=F64)
    mha.load_state_dict(rep)
    x = torch.randn(2, 11, d, dtype=F64)
    assert max_err(gqa(x, mask=mh.causal()), mha(x, mask=mh.causal())) <= TOL[F64]


def test_explicit_head_dim_is_kept():
    m = MultiHeadAttention(64, 4, head_dim=59)
    assert m.head_dim == 59
    assert m.qkv_proj.weight.shape == (3 * 4 * 59, 64) and m.o_proj.weight.shape == (64, 4 * 59)


def test_no_bias_means_no_bias_parameters():
    m = MultiHeadAttention(32, 4, 2, bias=False)
    assert m.qkv_proj.bias is None and m.o_proj.bias is None
    assert set(m.split_state_dict()) == {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}


def test_head_mask_scales_each_head_before_w_o():
    m, w = build(32, 4, 2, None, True)
    x = torch.randn(2, 9, 32, dtype=F64)
    hm = torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=F64)
    assert max_err(m(x, head_mask=hm), reference_mha(w, x, 4, 2, 8, head_mask=hm)) <= TOL[F64]
    per_batch = torch.stack([hm, torch.ones(4, dtype=F64)])  # (B, Hq)
    out = m(x, head_mask=per_batch)
    assert max_err(out[0], m(x[:1], head_mask=hm)[0]) <= TOL[F64]
    assert max_err(out[1], m(x[1:])[0]) <= TOL[F64]
    # all heads pruned: only the output bias is left
    zero = m(x, head_mask=torch.zeros(4, dtype=F64))
    assert max_err(zero, w["o_proj.bias"].expand_as(zero)) <= TOL[F64]


def test_gradients_flow_to_every_parameter_and_match_reference():
    m, w = build(24, 4, 2, None, True)
    x = torch.randn(2, 6, 24, dtype=F64, requires_grad=True)
    m(x, mask=mh.causal()).pow(2).sum().backward()
    wr = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    xr = x.detach().clone().requires_grad_(True)
    reference_mha(wr, xr, 4, 2, 6, mask=torch.ones(6, 6, dtype=torch.bool).tril()).pow(2).sum().backward()
    assert max_err(x.grad, xr.grad) <= TOL[F64]
    fused_grad = torch.cat([wr[f"{p}_proj.weight"].grad for p in "qkv"])
    assert max_err(m.qkv_proj.weight.grad, fused_grad) <= TOL[F64]
    assert max_err(m.o_proj.weight.grad, wr["o_proj.weight"].grad) <= TOL[F64]


def test_dropout_is_stochastic_in_training_and_off_in_eval():
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, dropout=0.5)
    plain = MultiHeadAttention(32, 4)
    plain.load_state_dict(m.state_dict())
    x = torch.randn(2, 10, 32)
    m.train()
    assert not torch.equal(m(x), m(x))
    m.eval()
    assert torch.equal(m(x), m(x))
    assert max_err(m(x), plain(x)) <= TOL[torch.float32]


def test_no_hidden_state_is_kept():
    m = MultiHeadAttention(16, 2)
    before = set(vars(m))
    m(torch.randn(1, 4, 16), mask=mh.causal())
    assert set(vars(m)) == before


# -- rotary and the KV cache ---------------------------------------------------------------------------
def rotary_mha(Hq, Hkv, d=32, bias=False):
    from multihead.nn.positions import RotaryEmbedding

    torch.manual_seed(0)
    return MultiHeadAttention(d, Hq, Hkv, bias=bias, rotary=RotaryEmbedding(d // Hq), dtype=F64)


def test_rotary_is_applied_to_q_and_k_and_is_relative():
    m = rotary_mha(4, 2)
    x = torch.randn(1, 12, 32, dtype=F64)
    base = m(x, mask=mh.causal())
    shifted = m(x, mask=mh.causal(), positions=torch.arange(100, 112))
    assert max_err(base, shifted) <= 1e-9  # only m - n matters
    plain = MultiHeadAttention(32, 4, 2, bias=False, dtype=F64)
    plain.load_state_dict(m.state_dict())
    assert max_err(base, plain(x, mask=mh.causal())) > 1e-3  # rotary did change the output


def _kv_cache(m, kind, max_len, window=None):
    from multihead.nn.kv_cache import KVCache

    return KVCache(1, m.n_kv_heads, m.head_dim, max_len, kind=kind, window=window, dtype=F64)


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (4, 1)])
def test_cache_prefill_then_steps_equals_full_forward(Hq, Hkv):
    m = rotary_mha(Hq, Hkv)
    x = torch.randn(1, 11, 32, dtype=F64)
    full = m(x, mask=mh.causal())
    cache = _kv_cache(m, "dense", 16)
    parts = [m(x[:, :6], mask=mh.causal(), cache=cache)]  # prefill
    parts += [m(x[:, t : t + 1], mask=mh.causal(), cache=cache) for t in range(6, 9)]  # one-token steps
    parts += [m(x[:, 9:], mask=mh.causal(), cache=cache)]  # a 2-token chunk
    assert cache.length == 11 and cache.position == 11
    assert max_err(torch.cat(parts, dim=1), full) <= TOL[F64]


def test_sliding_cache_with_sliding_window_mask_equals_full_forward():
    m = rotary_mha(4, 2)
    w = 4
    x = torch.randn(1, 13, 32, dtype=F64)
    full = m(x, mask=mh.sliding_window(w))
    cache = _kv_cache(m, "sliding", 16, window=w)
    parts = [m(x[:, :6], mask=mh.sliding_window(w), cache=cache)]
    parts += [m(x[:, t : t + 1], mask=mh.sliding_window(w), cache=cache) for t in range(6, 13)]
    assert cache.position == 13
    assert max_err(torch.cat(parts, dim=1), full) <= TOL[F64]


def test_int8_cache_is_close_to_full_forward():
    m = rotary_mha(4, 2)
    x = torch.randn(1, 10, 32, dtype=F64)
    full = m(x, mask=mh.causal())
    cache = _kv_cache(m, "int8", 16)
    parts = [m(x[:, :5], mask=mh.causal(), cache=cache)]
    parts += [m(x[:, t : t + 1], mask=mh.causal(), cache=cache) for t in range(5, 10)]
    err = max_err(torch.cat(parts, dim=1), full)
    # Symmetric int8 rounds each cached k/v entry by at most half a step, absmax / 254 (< 0.4% of the
    # largest entry). Scores, softmax and W^O propagate that with gain O(1) here, so 2% of the output
    # scale is a generous bound that still fails for a wrong cache (errors of order 1).
    assert err <= 0.02 * full.abs().max().item()
    assert err > 0.0  # it did quantise


# -- validation -----------------------------------------------------------------------------------------
def test_bad_constructor_arguments_raise():
    with pytest.raises(ValueError, match=r"n_heads \(6\) must be divisible by n_kv_heads \(4\)"):
        MultiHeadAttention(48, 6, 4)
    with pytest.raises(ValueError, match=r"d_model \(50\) is not divisible by n_heads \(4\).*head_dim"):
        MultiHeadAttention(50, 4)
    with pytest.raises(ValueError, match=r"dropout must be a probability in \[0, 1\), got 1.0"):
        MultiHeadAttention(32, 4, dropout=1.0)
    with pytest.raises(ValueError, match=r"dropout must be a probability in \[0, 1\), got -0.1"):
        MultiHeadAttention(32, 4, dropout=-0.1)
    with pytest.raises(ValueError, match="unknown backend 'flash9'; valid backends are: auto, reference"):
        MultiHeadAttention(32, 4, backend="flash9")
    with pytest.raises(ValueError, match="head_dim must be an int >= 1"):
        MultiHeadAttention(32, 4, head_dim=0)


def test_bad_forward_arguments_raise():
    m = MultiHeadAttention(32, 4)
    with pytest.raises(ValueError, match=r"x has width 31 but the module was built with d_model=32"):
        m(torch.randn(2, 5, 31))
    with pytest.raises(ValueError, match=r"x must have 3 dims \(B, N, d_model\), got 2 dims"):
        m(torch.randn(5, 32))
    with pytest.raises(ValueError, match=r"context has width 16"):
        m(torch.randn(2, 5, 32), torch.randn(2, 7, 16))
    with pytest.raises(ValueError, match="context batch 3 differs from x batch 2"):
        m(torch.randn(2, 5, 32), torch.randn(3, 7, 32))
    with pytest.raises(ValueError, match=r"head_mask must be a float tensor of shape \(Hq,\) = \(4,\)"):
        m(torch.randn(2, 5, 32), head_mask=torch.ones(3))
    with pytest.raises(ValueError, match="positions are only used by rotary self-attention"):
        m(torch.randn(2, 5, 32), positions=torch.arange(5))
    with pytest.raises(ValueError, match="does not broadcast"):
        m(torch.randn(2, 5, 32), mask=torch.ones(6, 6, dtype=torch.bool))


def test_cache_with_cross_attention_raises():
    m = rotary_mha(4, 2)
    with pytest.raises(ValueError, match="cache is for self-attention"):
        m(torch.randn(1, 3, 32, dtype=F64), torch.randn(1, 4, 32, dtype=F64), cache=_kv_cache(m, "dense", 8))
