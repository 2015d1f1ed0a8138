"""The decode path: 1-16 query rows against a long cache, grouped GQA, split over keys, vs the oracle."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.backends import decode as decode_mod
from multihead.core.problem import make_problem
from tests.numerics import allowed, max_err

HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}


def _inputs(B, Hq, Hkv, Nq, Nk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype)
    return q, k, v


def _masks(B, Nk):
    return {
        "none": None,
        "causal": mh.causal(),
        "window": mh.sliding_window(150),
        "padding": mh.padding(torch.tensor([Nk, Nk // 3])[:B]),
        "document": mh.document(torch.arange(Nk) * 3 // Nk) & mh.causal(),
    }


@pytest.fixture(params=[False, True], ids=["whole", "split"])
def split(request, monkeypatch):
    """With a small MIN_CHUNK the cache is cut into chunks merged by log-sum-exp."""
    if request.param:
        monkeypatch.setattr(decode_mod, "MIN_CHUNK", 64)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("nq", [1, 5, 16])
@pytest.mark.parametrize("mask_name", list(_masks(2, 8)))
def test_decode_against_reference(split, dtype, heads, nq, mask_name):
    Hq, Hkv = heads
    q, k, v = _inputs(2, Hq, Hkv, nq, 523, 59 if Hkv == 2 else 16, dtype)
    mask = _masks(2, 523)[mask_name]
    gold = mh.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    base = max_err(mh.attention(q, k, v, mask=mask, backend="matrix"), gold)
    out = mh.attention(q, k, v, mask=mask, backend="decode")
    assert out.dtype == dtype and out.shape == gold.shape
    assert max_err(out, gold) <= allowed(base)


def test_split_is_exact_in_float64(monkeypatch):
    monkeypatch.setattr(decode_mod, "MIN_CHUNK", 32)
    q, k, v = _inputs(1, 4, 1, 3, 1000, 8, torch.float64)
    p = make_problem(q, k, v, mask=mh.causal())
    assert decode_mod.n_chunks(p, 1000) > 1
    got = mh.attention(q, k, v, mask=mh.causal(), backend="decode", return_lse=True)
    ref = mh.attention(q, k, v, mask=mh.causal(), backend="reference", return_lse=True)
    assert max_err(got.out, ref.out) < 1e-12 and max_err(got.lse, ref.lse) < 1e-12


def test_decode_gradients():
    q, k, v = (t.requires_grad_(True) for t in _inputs(1, 8, 2, 4, 300, 16, torch.float64))
    out = mh.attention(q, k, v, mask=mh.causal(), backend="decode")
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref = torch.autograd.grad(mh.attention(q, k, v, mask=mh.causal(), backend="reference").sum(), (q, k, v))
    for a, b in zip(grads, ref):
        assert max_err(a, b) < 1e-10


def test_auto_picks_decode_for_short_queries():
    q, k, v = _inputs(1, 8, 2, 1, 4096, 16, torch.float32)
    text = mh.explain(q, k, v, mask=mh.causal())
    assert "auto -> decode" in text
    q16 = torch.randn(1, 8, 17, 16)
    text = mh.explain(q16, k, v, mask=mh.causal())
    assert "auto -> decode" not in text and "at most 16 query rows, this call has Nq=17" in text


def test_decode_plan_reads_only_the_window():
    q, k, v = _inputs(1, 4, 1, 2, 5000, 8, torch.float32)
    pieces = decode_mod.BACKEND.plan(make_problem(q, k, v, mask=mh.sliding_window(300)))
    assert sum(pc.k1 - pc.k0 for pc in pieces) <= 300 + decode_mod.BLOCK_K


def test_decode_refuses_weights():
    q, k, v = _inputs(1, 4, 1, 2, 200, 8, torch.float32)
    with pytest.raises(ValueError, match="backend 'decode' cannot return the attention weights"):
        mh.attention(q, k, v, backend="decode", return_weights=True)


@pytest.mark.parametrize("mask", [None, mh.causal()], ids=["none", "causal"])
@pytest.mark.parametrize("nk", [1000, 1003], ids=["even", "tail"])
def test_plain_decode_step_is_exact_in_float64(monkeypatch, mask, nk):
    """A cached step that sees every key skips the planner; chunks and a leftover tail merge exactly."""
    monkeypatch.setattr(decode_mod, "MIN_CHUNK", 32)
    q, k, v = _inputs(1, 4, 1, 1, nk, 8, torch.float64)
    p = make_problem(q, k, v, mask=mask)
    assert decode_mod._sees_every_key(p) and decode_mod.n_chunks(p, nk) > 1
    got = mh.attention(q, k, v, mask=mask, backend="decode", return_lse=True)
    ref = mh.attention(q, k, v, mask=mask, backend="reference", return_lse=True)
    assert max_err(got.out, ref.out) < 1e-12 and max_err(got.lse, ref.lse) < 1e-12


def test_plain_decode_step_needs_one_row_and_no_bias():
    q, k, v = _inputs(1, 4, 1, 2, 300, 8, torch.float32)
    assert not decode_mod._sees_every_key(make_problem(q, k, v, mask=mh.causal()))  # 2 rows: a corner
    assert not decode_mod._sees_every_key(make_problem(q[:, :, :1], k, v, bias=mh.alibi(4)))
    assert not decode_mod._sees_every_key(make_problem(q[:, :, :1], k, v, mask=mh.sliding_window(8)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
def test_plain_decode_step_reads_a_cache_view_in_place(dtype):
    """The first L positions of a preallocated cache are a strided view; the step reads it as it is."""
    cache = mh.KVCache(2, 2, 16, 300, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    kv = [torch.randn(2, 2, 200, 16, generator=g, dtype=torch.float64).to(dtype) for _ in range(2)]
    k, v = cache.update(*kv)  # (2, 2, 200, 16) views of (2, 2, 300, 16) storage
    assert not k.is_contiguous() and k.data_ptr() == cache.k.data_ptr()
    q = torch.randn(2, 8, 1, 16, generator=g, dtype=torch.float64).to(dtype)  # (B, Hq, 1, D): G = 4
    got = mh.attention(q, k, v, mask=mh.causal(), backend="decode")
    gold = mh.attention(*(t.double() for t in (q, k, v)), mask=mh.causal(), backend="reference")
    plain = mh.attention(q, k.contiguous(), v.contiguous(), mask=mh.causal(), backend="matrix")
    assert max_err(got, gold) <= max(2 * max_err(plain, gold), 1e-12)


def test_unmasked_step_matches_reference_and_declines_the_rest():
    """decode.unmasked_step (the HF attention function's fast path): GQA folded into rows, exact against
    the float64 reference; None for what needs the general path."""
    from multihead.backends.decode import MAX_ROWS, MIN_CHUNK, unmasked_step

    g = torch.Generator().manual_seed(5)
    for nq in (1, 3):
        q = torch.randn(2, 6, nq, 16, generator=g)  # (B, Hq, Nq, D)
        k, v = (torch.randn(2, 3, 50, 16, generator=g) for _ in range(2))  # (B, Hkv, Nk, D): G = 2
        out = unmasked_step(q, k, v, 0.2)
        assert out is not None and out.shape == (2, 6, nq, 16)
        ref = mh.attention(q.double(), k.double(), v.double(), scale=0.2, backend="reference")
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    q1 = torch.randn(1, 4, 1, 16, generator=g)  # (1, Hq, 1, D)
    assert unmasked_step(torch.randn(1, 4, MAX_ROWS + 1, 16), k[:1, :2], v[:1, :2], None) is None
    assert unmasked_step(torch.randn(1, 5, 1, 16), k[:1], v[:1], None) is None  # 5 heads on 3 kv heads
    assert unmasked_step(q1, k[:1, :, :0], v[:1, :, :0], None) is None  # no keys
    long_k = torch.randn(1, 2, 2 * MIN_CHUNK, 16)  # two (batch, kv head) lanes, a long cache
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(4)  # 2 lanes for 4 threads: split over the cores, the general path
        assert unmasked_step(q1, long_k, long_k, None) is None
        torch.set_num_threads(1)  # 2 lanes keep one thread busy: one call
        assert unmasked_step(q1, long_k, long_k, None) is not None
    finally:
        torch.set_num_threads(n)
