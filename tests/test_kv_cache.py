"""KV cache: dense / sliding / int8 storage, and cached decoding equal to full attention."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.nn.kv_cache import KVCache
from tests.numerics import TOL, max_err

F64 = torch.float64
B, HKV, D = 2, 2, 8


def kv(n: int, seed: int = 0, dtype=F64, dv: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, HKV, n, D, generator=g, dtype=dtype)
    return k, torch.randn(B, HKV, n, dv, generator=g, dtype=dtype)


def chunks(total: int, sizes: list[int]) -> list[tuple[int, int]]:
    """(start, end) pairs covering range(total) with the given chunk sizes, cycled."""
    out, s, i = [], 0, 0
    while s < total:
        e = min(total, s + sizes[i % len(sizes)])
        out.append((s, e))
        s, i = e, i + 1
    return out


def int8_round_trip(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent per-token symmetric int8 round trip in float64: (dequantised x, scale)."""
    scale = x.double().abs().amax(-1, keepdim=True) / 127
    q = torch.round(x.double() / scale.clamp_min(1e-300)).clamp(-127, 127)
    return q * scale, scale


# -- storage ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dv", [D, 5])
def test_dense_appends_by_index_and_returns_prefix(dv):
    k, v = kv(12, dv=dv)
    cache = KVCache(B, HKV, D, 16, dtype=F64, v_head_dim=dv)
    for s, e in chunks(12, [5, 1, 1, 3, 2]):
        assert cache.position == s
        k_all, v_all = cache.update(k[:, :, s:e], v[:, :, s:e])
        assert torch.equal(k_all, k[:, :, :e]) and torch.equal(v_all, v[:, :, :e])
        assert cache.length == cache.position == e
    assert cache.k.data_ptr() == k_all.data_ptr()  # a view of the preallocated storage, no copies
    cache.reset()
    assert cache.length == cache.position == 0
    k_all, _ = cache.update(k[:, :, 7:9], v[:, :, 7:9])
    assert torch.equal(k_all, k[:, :, 7:9])


@pytest.mark.parametrize("kind", ["dense", "int8"])
def test_overflow_names_the_numbers_and_the_fix(kind):
    cache = KVCache(B, HKV, D, 6, kind=kind, dtype=F64)
    cache.update(*kv(4))
    with pytest.raises(
        ValueError, match=r"4 cached \+ 3 new = 7 positions > max_len=6.*max_len >= 7.*sliding"
    ):
        cache.update(*kv(3))
    assert cache.length == 4  # nothing was written
    cache.update(*kv(2))
    assert cache.length == 6


@pytest.mark.parametrize("window", [1, 3, 4, 8])
@pytest.mark.parametrize("sizes", [[1], [3, 1, 7, 1, 1, 5, 12, 2], [10, 1]])
def test_sliding_returns_the_window_of_a_dense_reference(window, sizes):
    total = 40
    k, v = kv(total, seed=window)
    cache = KVCache(B, HKV, D, 5, kind="sliding", window=window, dtype=F64)  # max_len is no limit here
    for s, e in chunks(total, sizes):
        k_all, v_all = cache.update(k[:, :, s:e], v[:, :, s:e])
        lo = max(0, s - (window - 1))  # the earliest new token sees window - 1 earlier positions
        assert torch.equal(k_all, k[:, :, lo:e]) and torch.equal(v_all, v[:, :, lo:e])
        assert cache.position == e and cache.length == min(e, window)
    assert cache.nbytes == 2 * B * HKV * window * D * 8


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_int8_round_trip_error_is_at_most_half_a_step(dtype):
    k, v = kv(9, seed=3, dtype=dtype)
    k[0, 1, 4] = 0.0  # an all-zero token: scale 0, dequantised exactly
    cache = KVCache(B, HKV, D, 9, kind="int8", dtype=dtype)
    k_all, v_all = cache.update(k[:, :, :6], v[:, :, :6])
    k_all, v_all = cache.update(k[:, :, 6:], v[:, :, 6:])
    assert k_all.dtype == v_all.dtype == dtype and k_all.shape == (B, HKV, 9, D)
    for x, deq in ((k, k_all), (v, v_all)):
        _, scale = int8_round_trip(x)
        err = (deq.double() - x.double()).abs()
        # half a quantisation step, plus the final rounding to the cache dtype
        assert (err <= scale / 2 + TOL[dtype] * x.double().abs()).all()
    assert torch.equal(k_all[0, 1, 4], torch.zeros(D, dtype=dtype))
    assert cache.k.dtype == torch.int8 and cache.k_scale is not None and cache.k_scale.dtype != torch.int8


def test_nbytes_dtype_and_device_moves():
    dense = KVCache(B, HKV, D, 10, dtype=torch.float32, v_head_dim=4)
    assert dense.nbytes == B * HKV * 10 * (D + 4) * 4
    q8 = KVCache(B, HKV, D, 10, kind="int8", dtype=torch.bfloat16)
    assert q8.nbytes == 2 * B * HKV * 10 * (D * 1 + 4)  # int8 values + one float32 scale per token
    assert q8.state_dict() == {} and dense.state_dict() == {}  # a cache is not part of a checkpoint
    q8 = q8.double()  # .to() follows the cast; scales stay in their arithmetic dtype
    assert q8.dtype == F64 and q8.k.dtype == torch.int8 and q8.k_scale is not None
    assert q8.k_scale.dtype == F64
    assert q8.update(*kv(2))[0].dtype == F64
    assert dense.half().dtype == torch.float16 and dense.k.dtype == torch.float16


def test_writes_are_detached():
    k, v = kv(3)
    k.requires_grad_(True)
    for kind, window in (("dense", None), ("int8", None), ("sliding", 2)):
        k_all, _ = KVCache(B, HKV, D, 4, kind=kind, window=window, dtype=F64).update(k, v)
        assert not k_all.requires_grad


def test_construction_errors():
    with pytest.raises(ValueError, match=r"kind must be one of \['dense', 'sliding', 'int8'\], got 'paged'"):
        KVCache(B, HKV, D, 8, kind="paged")
    with pytest.raises(ValueError, match=r"kind='sliding' needs window"):
        KVCache(B, HKV, D, 8, kind="sliding")
    with pytest.raises(ValueError, match=r"window must be an int >= 1, got 0"):
        KVCache(B, HKV, D, 8, kind="sliding", window=0)
    with pytest.raises(ValueError, match=r"window=4 only applies to kind='sliding'"):
        KVCache(B, HKV, D, 8, window=4)
    with pytest.raises(ValueError, match=r"max_len must be an int >= 1, got 0"):
        KVCache(B, HKV, D, 0)
    with pytest.raises(ValueError, match=r"dtype must be float16.*got torch.int64"):
        KVCache(B, HKV, D, 8, dtype=torch.int64)


def test_update_errors_leave_the_cache_untouched():
    cache = KVCache(B, HKV, D, 8, dtype=F64)
    k, v = kv(2)
    with pytest.raises(ValueError, match=r"dtype torch.float32 but the cache holds torch.float64.*\.to\("):
        cache.update(k.float(), v.float())
    with pytest.raises(ValueError, match=r"k_new \(3, 2, 2, 8\).*\(B, Hkv, n, D\) = \(2, 2, 2, 8\)"):
        cache.update(torch.cat([k, k[:1]]), torch.cat([v, v[:1]]))  # wrong batch
    with pytest.raises(ValueError, match=r"n_kv_heads=2"):
        cache.update(k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1))  # query heads instead of kv heads
    with pytest.raises(ValueError, match=r"v_new \(2, 2, 1, 8\)"):
        cache.update(k, v[:, :, :1])  # k and v lengths differ
    with pytest.raises(ValueError, match=r"4-dim tensor"):
        cache.update(k[0], v[0])
    with pytest.raises(ValueError, match=r"at least one new position"):
        cache.update(k[:, :, :0], v[:, :, :0])
    assert cache.position == 0


# -- cached decoding equals full attention ----------------------------------------------------------------
def qkv_full(n: int, hq: int = 4, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, hq, n, D, generator=g, dtype=F64)
    k, v = kv(n, seed=seed + 1)
    return q, k, v


def decode(cache: KVCache, q, k, v, steps, mask) -> torch.Tensor:
    """Run attention chunk by chunk through ``cache``; concatenate the outputs over positions."""
    outs = []
    for s, e in steps:
        k_all, v_all = cache.update(k[:, :, s:e], v[:, :, s:e])
        outs.append(mh.attention(q[:, :, s:e], k_all, v_all, mask=mask))  # (B, Hq, e - s, D)
    return torch.cat(outs, dim=2)  # (B, Hq, N, D)


PREFILL_THEN_STEPS = [(0, 7)] + [(i, i + 1) for i in range(7, 13)] + [(13, 16), (16, 17)]


@pytest.mark.parametrize("hq", [2, 4])  # MHA and GQA (the cache holds only the 2 kv heads)
def test_dense_cached_decoding_equals_full_causal_attention(hq):
    q, k, v = qkv_full(17, hq)
    full = mh.attention(q, k, v, mask=mh.causal(), backend="reference")
    got = decode(KVCache(B, HKV, D, 17, dtype=F64), q, k, v, PREFILL_THEN_STEPS, mh.causal())
    assert max_err(got, full) <= TOL[F64]


@pytest.mark.parametrize("window", [1, 4, 9])
def test_sliding_cached_decoding_equals_full_sliding_window_attention(window):
    q, k, v = qkv_full(17)
    full = mh.attention(q, k, v, mask=mh.sliding_window(window), backend="reference")
    cache = KVCache(B, HKV, D, 4, kind="sliding", window=window, dtype=F64)
    got = decode(cache, q, k, v, PREFILL_THEN_STEPS, mh.sliding_window(window))
    assert max_err(got, full) <= TOL[F64]
    # one-token steps see exactly the window, so plain causal() gives the same rows
    cache.reset()
    steps = [(i, i + 1) for i in range(17)]
    assert max_err(decode(cache, q, k, v, steps, mh.causal()), full) <= TOL[F64]


def test_int8_cached_decoding_equals_attention_over_the_quantised_keys_and_values():
    q, k, v = qkv_full(17)
    (k8, _), (v8, _) = int8_round_trip(k), int8_round_trip(v)
    full = mh.attention(q, k8, v8, mask=mh.causal(), backend="reference")
    got = decode(KVCache(B, HKV, D, 17, kind="int8", dtype=F64), q, k, v, PREFILL_THEN_STEPS, mh.causal())
    assert max_err(got, full) <= TOL[F64]
