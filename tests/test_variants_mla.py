"""mh.variants.LatentAttention (multi-head latent attention, DeepSeek-V2): the naive and the absorbed form
against a float64 per-head reference written here, masks, the latent cache, generation and its size."""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from multihead import variants as V
from tests.numerics import TOL, max_err

d, H = 32, 4
SIZES = dict(kv_rank=12, rope_dims=4, nope_dims=6, v_head_dim=10)  # all different: a mixed-up dim fails


def _rope(t: torch.Tensor, pos: torch.Tensor, base: float, interleaved: bool) -> torch.Tensor:
    """RoPE on the last dim of t (..., N, R) at positions pos (N,): feature pairs rotated by pos * theta_i."""
    R = t.shape[-1]
    theta = base ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)  # (R/2,)
    ang = pos.double()[:, None] * theta  # (N, R/2)
    i = torch.arange(R // 2)
    a_idx, b_idx = (2 * i, 2 * i + 1) if interleaved else (i, i + R // 2)
    a, b = t[..., a_idx], t[..., b_idx]
    out = t.clone()
    out[..., a_idx] = a * ang.cos() - b * ang.sin()
    out[..., b_idx] = b * ang.cos() + a * ang.sin()
    return out


def reference(m, x, *, context=None, allowed=None):
    """Float64 MLA, head by head, straight from the equations and the module's weights.

    allowed: None or a bool tensor (B, H, N, M), True = may attend. Rows with no allowed key are zeros.
    """
    W = {k: v.double() for k, v in m.state_dict().items()}
    r, R, Dn, Dv = m.kv_rank, m.rope_dims, m.nope_dims, m.v_head_dim
    eps = None if m.kv_norm is None else m.kv_norm.eps

    def lin(t, name):
        return t @ W[f"{name}.weight"].T + W.get(f"{name}.bias", 0.0)

    def rms(t, name):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps) * W[f"{name}.weight"]

    x = x.double()
    src = x if context is None else context.double()
    B, N, _ = x.shape
    M = src.shape[1]
    q = lin(x, "q_proj") if m.q_rank is None else lin(rms(lin(x, "q_down"), "q_norm"), "q_up")
    q = q.reshape(B, N, H, Dn + R)
    latent = lin(src, "kv_down")
    c_kv, k_rope = latent[..., :r], latent[..., r:]  # (B, M, r), (B, M, R)
    if m.kv_norm is not None:
        c_kv = rms(c_kv, "kv_norm")
    if m.rotary is not None and context is None:
        base, inter = m.rotary.base, m.rotary.interleaved
        q = torch.cat([q[..., :Dn], _rope(q[..., Dn:].transpose(1, 2), torch.arange(N), base, inter)
                       .transpose(1, 2)], -1)  # fmt: skip
        k_rope = _rope(k_rope, torch.arange(M), base, inter)
    w_up = W["kv_up.weight"].reshape(H, Dn + Dv, r)
    heads = []
    for h in range(H):
        k_h = torch.cat([c_kv @ w_up[h, :Dn].T, k_rope], -1)  # (B, M, Dn + R)
        v_h = c_kv @ w_up[h, Dn:].T  # (B, M, Dv)
        s = q[:, :, h] @ k_h.transpose(1, 2) / math.sqrt(Dn + R)  # (B, N, M)
        if allowed is not None:
            s = s.masked_fill(~allowed[:, h], -math.inf)
        p = torch.softmax(s, -1).nan_to_num(0.0)  # a row with no key: zeros
        heads.append(p @ v_h)  # (B, N, Dv)
    return lin(torch.cat(heads, -1), "o_proj")  # (B, N, d)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return V.LatentAttention(d, H, **{**SIZES, **kw}).eval()


@pytest.mark.parametrize("q_rank", [None, 8])
@pytest.mark.parametrize("rope", ["none", "half", "interleaved"])
@pytest.mark.parametrize("bias", [False, True])
def test_naive_and_absorbed_equal_the_float64_reference(q_rank, rope, bias):
    rotary = None if rope == "none" else mh.RotaryEmbedding(4, base=100.0, interleaved=rope == "interleaved")
    m = make(q_rank=q_rank, rotary=rotary, bias=bias)
    x = torch.randn(2, 9, d)
    B, N = x.shape[:2]
    mask = mh.causal() & mh.padding([9, 6])
    gold = reference(m, x, allowed=mask.dense(B, H, N, N))
    with torch.no_grad():
        m.absorb = False
        naive = m(x, mask=mask)
        m.absorb = True
        absorbed = m(x, mask=mask)
    tol = TOL[torch.float32]
    assert max_err(naive, gold) <= tol and max_err(absorbed, gold) <= tol
    assert max_err(naive, absorbed) <= tol
    assert gold.abs().max() > 10 * tol  # the comparison is not between zeros


@pytest.mark.parametrize("bias", [False, True])
def test_no_rope_features_and_no_latent_norm(bias):
    # rope_dims=0, kv_norm=False: keys c_kv W_UK^i alone, c_kv = x W_DKV (what an absolute-position model
    # converts to); both forms, and cached decode, against the reference
    m = make(rope_dims=0, kv_norm=False, bias=bias)
    assert m.kv_norm is None and m.head_dim == SIZES["nope_dims"] and m.cache_numbers_per_token == 12
    x = torch.randn(2, 7, d)
    mask = mh.causal()
    gold = reference(m, x, allowed=mask.dense(2, H, 7, 7))
    tol = TOL[torch.float32]
    with torch.no_grad():
        for absorb in (False, True):
            m.absorb = absorb
            assert max_err(m(x, mask=mask), gold) <= tol
        cache = m.make_cache(2, 7)
        steps = [m(x[:, :4], mask=mask, cache=cache)] + [m(x[:, i : i + 1], cache=cache) for i in range(4, 7)]
    assert max_err(torch.cat(steps, 1), gold) <= tol
    assert gold.abs().max() > 10 * tol


def test_float64_module_is_the_reference_and_masks_change_the_result():
    m = make(rope_theta=10000.0).double()
    x = torch.randn(2, 7, d, dtype=torch.float64)
    B, N = x.shape[:2]
    for absorb in (False, True):
        m.absorb = absorb
        for mask in (mh.causal(), mh.key_padding(torch.tensor([[1, 1, 1, 0, 1, 1, 0]] * 2).bool())):
            got = m(x, mask=mask)
            assert max_err(got, reference(m, x, allowed=mask.dense(B, H, N, N))) <= TOL[torch.float64]
        assert max_err(m(x), reference(m, x)) <= TOL[torch.float64]
    assert max_err(m(x), m(x, mask=mh.causal())) > 1e-3  # the mask reaches the scores


def test_a_row_with_no_key_is_zero_in_both_forms():
    m = make(rope_theta=10000.0)
    x = torch.randn(1, 4, d)
    none = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    none[..., 1:, :] = True  # query 0 sees nothing
    for absorb in (False, True):
        m.absorb = absorb
        out = m(x, mask=none)
        assert torch.isfinite(out).all()
        # the row is zero before W^O, so the output is o_proj's bias (none here): zeros
        assert torch.equal(out[0, 0], torch.zeros(d))


def test_gradients_agree_between_the_forms():
    m = make(q_rank=8, rope_theta=10000.0).double()
    x = torch.randn(2, 5, d, dtype=torch.float64, requires_grad=True)
    grads = []
    for absorb in (False, True):
        m.absorb = absorb
        m.zero_grad()
        x.grad = None
        m(x, mask=mh.causal()).square().sum().backward()
        grads.append([x.grad.clone(), m.kv_up.weight.grad.clone(), m.q_down.weight.grad.clone()])
    for a, b in zip(*grads):
        assert max_err(a, b) <= 1e-9 and a.abs().max() > 0


def test_cross_attention_matches_the_reference():
    m = make(rope_theta=10000.0).double()
    x, ctx = torch.randn(2, 3, d, dtype=torch.float64), torch.randn(2, 8, d, dtype=torch.float64)
    for absorb in (False, True):
        m.absorb = absorb
        assert max_err(m(x, ctx), reference(m, x, context=ctx)) <= TOL[torch.float64]


@pytest.mark.parametrize("absorb", [None, False, True])
def test_cached_incremental_decode_equals_full_recomputation(absorb):
    m = make(q_rank=8, rope_theta=10000.0, absorb=absorb)
    x = torch.randn(2, 11, d)
    with torch.no_grad():
        full = m(x, mask=mh.causal())
        cache = m.make_cache(2, 16)
        parts = [m(x[:, a:b], mask=mh.causal(), cache=cache) for a, b in ((0, 5), (5, 6), (6, 7), (7, 11))]
    assert cache.length == 11 and cache.position == 11
    assert max_err(torch.cat(parts, 1), full) <= TOL[torch.float32]


def test_the_cheaper_form_is_chosen_per_call():
    m = V.LatentAttention(512, 8, kv_rank=256, rope_dims=32, nope_dims=64, v_head_dim=64)
    assert m.absorbs(1, 2048) and m.absorbs(1, 8)  # one-token decode: absorbed
    assert not m.absorbs(2048, 2048)  # a long prefill: per-head keys are cheaper
    m.absorb = False
    assert not m.absorbs(1, 2048)


def test_latent_cache_holds_only_the_latent_key():
    m = make(rope_theta=10000.0)
    cache = m.make_cache(3, 20)
    assert isinstance(cache, mh.KVCache) and cache.numbers_per_token == 12 + 4
    assert cache.nbytes == 3 * 20 * (12 + 4) * 4  # no separate value storage
    k = torch.randn(3, 1, 2, 16)
    k_all, c_all = cache.update(k)
    assert torch.equal(k_all, k) and torch.equal(c_all, k[..., :12])
    assert c_all.data_ptr() == k_all.data_ptr()  # the values are a view of the keys
    cache.reset()
    assert cache.length == 0


def test_kv_cache_bytes_per_token_counts_the_latent():
    def lm(attention=None):
        return mh.TransformerLM(50, d, 3, H, 2 * d, attention=attention)

    mla = lm(lambda i: V.LatentAttention(d, H, **SIZES, rope_theta=10000.0))
    assert mh.heads.kv_cache_bytes_per_token(mla) == 3 * (12 + 4) * 4
    assert mh.heads.kv_cache_bytes_per_token(mla, torch.bfloat16) == 3 * (12 + 4) * 2
    assert mh.heads.kv_cache_bytes_per_token(lm()) == 3 * 2 * d * 4
    assert sum(c.nbytes for c in mla.make_cache(1, 10)) == 10 * mh.heads.kv_cache_bytes_per_token(mla)


@pytest.mark.parametrize("q_rank", [None, 8])
def test_generate_with_latent_layers_uses_the_latent_cache(q_rank):
    rotary = mh.RotaryEmbedding(4, interleaved=True)
    torch.manual_seed(0)
    lm = mh.TransformerLM(
        50, d, 2, H, 2 * d, attention=lambda i: V.LatentAttention(d, H, **SIZES, q_rank=q_rank, rotary=rotary)
    ).eval()
    assert all(isinstance(c, V.LatentCache) for c in lm.make_cache(1, 8))
    ids = torch.randint(0, 50, (2, 6))
    cached = lm.generate(ids, 10)
    assert torch.equal(cached, lm.generate(ids, 10, cache=None))  # full recomputation every step
    with torch.no_grad():  # the cached step's logits are the full forward's
        cache = lm.make_cache(2, 16)
        lm(cached[:, :8], cache=cache)
        step = lm(cached[:, 8:9], cache=cache)
        assert max_err(step[:, -1], lm(cached[:, :9])[:, -1]) <= TOL[torch.float32]


def test_swap_to_mla_keeps_the_model_rotary():
    lm = mh.TransformerLM(50, d, 2, H, 2 * d)
    out = V.swap(lm, "mla", kv_rank=8)
    a = out.layers[0].self_attn
    assert isinstance(a, V.LatentAttention) and a.rope_dims == d // H and a.kv_rank == 8
    ids = torch.randint(0, 50, (1, 5))
    assert torch.equal(out.generate(ids, 4), out.generate(ids, 4, cache=None))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: V.LatentAttention(d, H, 2),
            r"LatentAttention takes no n_kv_heads \(got 2\).*drop n_kv_heads",
        ),
        (lambda: V.build("mla", d, H, n_kv_heads=1), r"takes no n_kv_heads \(got 1\)"),
        (lambda: V.LatentAttention(d, H, kv_rank=0), r"LatentAttention kv_rank must be an int >= 1, got 0"),
        (lambda: V.LatentAttention(d, H, q_rank=0), r"q_rank must be an int >= 1, got 0; or None"),
        (
            lambda: V.LatentAttention(d, H, rope_dims=6, rotary=mh.RotaryEmbedding(4)),
            r"rotary has head_dim 4 but rope_dims=6",
        ),
        (
            lambda: V.LatentAttention(d, H, rotary=mh.RotaryEmbedding(4), rope_theta=1e4),
            r"got both rotary and rope_theta=10000.0; pass one",
        ),
        (lambda: V.LatentAttention(d, H, scale=0.0), r"scale must be a finite number > 0 or None"),
        (lambda: V.LatentAttention(d, H, absorb="yes"), r"absorb must be True, False or None"),
        (
            lambda: V.LatentAttention(d, H, rope_dims=0, rope_theta=1e4),
            r"rope_dims must be an int >= 1, got 0; \(0 only without rotary",
        ),
        (
            lambda: V.LatentCache(1, 8, 4, 10, kind="int8"),
            r"LatentCache supports kind='dense'.*got kind='int8'",
        ),
        (lambda: V.LatentCache(1, 0, 4, 10), r"LatentCache kv_rank must be an int >= 1, got 0"),
    ],
)
def test_bad_arguments_raise_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_bad_caches_raise_value_errors():
    m = make()
    x = torch.randn(1, 3, d)
    with pytest.raises(
        ValueError, match=r"caches latent keys of width kv_rank \+ rope_dims = 12 \+ 4.*make_cache"
    ):
        m(x, cache=mh.KVCache(1, H, 8, 10))
    with pytest.raises(ValueError, match=r"caches latent keys"):
        m(x, cache=V.LatentCache(1, 8, 4, 10))
    cache = m.make_cache(1, 4)
    m(x, cache=cache)
    with pytest.raises(
        ValueError, match=r"LatentCache overflow: 3 cached \+ 3 new = 6 positions > max_len=4"
    ):
        m(x, cache=cache)
    with pytest.raises(ValueError, match=r"takes latent keys \(B, 1, n, r \+ R\) = \(1, 1, n >= 1, 16\)"):
        cache.update(torch.randn(1, 2, 1, 16))
