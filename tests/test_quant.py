"""Int8 weights and int8 K/V: within a stated tolerance of fp32, smaller, and generating."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.models import quant
from multihead.nn import kv_cache

# Stated tolerance of a quantized model: per-channel int8 rounds each weight by at most scale / 2, i.e.
# 0.4% of its row's largest weight; through a small LM this moves logits by at most this fraction of
# their range (measured: 0.4% for the weight-only kernels, 0.7% with fbgemm's int8 activations).
LOGIT_TOL = 0.05


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return mh.TransformerLM(500, 64, 2, 4, 128, n_kv_heads=2).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kernel", ["auto", "fbgemm", "int8pack", "dequant"])
@pytest.mark.parametrize("kv", [None, "int8"])
def test_quantized_lm_within_tolerance_of_fp32(lm, ids, kernel, kv):
    with torch.no_grad():
        ref = lm(ids)
        out = quant.quantize(lm, kv=kv, kernel=kernel)(ids)
    span = float(ref.max() - ref.min())
    assert float((out - ref).abs().max()) <= LOGIT_TOL * span
    assert float((out.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


def test_int8_linear_rounding_bound():
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 16)
    q = quant.Int8Linear(lin, kernel="dequant")
    w = q.weight_int8.float() * q.scale[:, None]
    assert float(((w - lin.weight.detach()).abs() - q.scale[:, None] / 2).max()) <= 1e-6
    x = torch.randn(3, 5, 32)
    assert q(x).shape == (3, 5, 16)
    assert torch.allclose(q(x), torch.nn.functional.linear(x, w, lin.bias), atol=1e-5)


def test_quantize_shrinks_the_model_and_ties_share_storage(lm):
    q = quant.quantize(lm)
    assert sum(isinstance(m, quant.Int8Linear) for m in q.modules()) == 2 * 5 + 1  # qkv, o, w1, w2, w3; head
    assert q.embed.weight_int8 is q.lm_head.weight_int8  # the tied head reads the embedding's int8 rows
    ratio = quant.model_bytes(lm) / quant.model_bytes(q)
    assert 3.5 < ratio < 4.0  # int8 instead of fp32, plus fp32 scales and norms
    assert not any(isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) for m in q.modules())


def test_quantized_lm_generates_with_the_int8_cache(lm, ids):
    q = quant.quantize(lm)
    assert q.make_cache(1, 8)[0].kind == "int8"
    assert quant.quantize(lm, kv=None).make_cache(1, 8)[0].kind == "dense"
    out = q.generate(ids[:, :6], 6)
    assert out.shape == (2, 12) and torch.equal(out[:, :6], ids[:, :6])
    assert torch.equal(q.generate(ids[:, :6], 6, cache=None), out)  # cache kind does not change tokens here


def test_kv_int8_attention_error_is_bounded():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    exact = mh.attention(q, k, v, mask=mh.causal())
    approx = quant.KVInt8()(q, k, v, mask=mh.causal())
    assert 0 < float((approx - exact).abs().max()) < 0.05


def test_encoder_quantizes_too():
    torch.manual_seed(0)
    enc = mh.Encoder(2, 32, 4, 64).eval()
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        assert float((quant.quantize(enc)(x) - enc(x)).abs().max()) < 0.1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"weights": "int4"}, r"quantize weights must be 'int8' or None, got 'int4'"),
        ({"kv": "fp8"}, r"quantize kv must be 'int8' or None, got 'fp8'"),
        ({"kernel": "cuda"}, r"quantize kernel must be one of \['auto', 'fbgemm', 'int8pack', 'dequant'\]"),
    ],
)
def test_bad_arguments(lm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        quant.quantize(lm, **kwargs)
    with pytest.raises(ValueError, match="Int8Linear kernel must be one of"):
        quant.Int8Linear(torch.nn.Linear(2, 2), kernel="fast")


def test_int8_cache_keys_are_not_rounded_twice():
    g = torch.Generator().manual_seed(0)
    cache = mh.KVCache(1, 2, 8, 16, kind="int8")
    k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(2))
    k_all, v_all = cache.update(k, v)
    assert kv_cache.int8_rounded(k_all) and kv_cache.int8_rounded(v_all)
    assert not kv_cache.int8_rounded(k) and not kv_cache.int8_rounded(k_all.clone())
    assert not kv_cache.int8_rounded(mh.KVCache(1, 2, 8, 16).update(k, v)[0])  # a dense cache's view
    # rounding them again would change nothing but the last float bit
    again = kv_cache.dequantize_int8(*kv_cache.quantize_int8(k_all), torch.float32)
    torch.testing.assert_close(again, k_all, rtol=1e-6, atol=0)
    q = torch.randn(1, 4, 1, 8, generator=g)
    exact = mh.attention(q, k_all, v_all, mask=mh.causal())
    torch.testing.assert_close(quant.KVInt8()(q, k_all, v_all, mask=mh.causal()), exact)  # passed through
    # a fresh tensor with the same values is rounded again: the result agrees to the float bit
    torch.testing.assert_close(quant.KVInt8()(q, k_all.clone(), v_all.clone(), mask=mh.causal()), exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_int8_skips_only_the_rounding(dtype, monkeypatch):
    g = torch.Generator().manual_seed(0)
    cache = mh.KVCache(1, 2, 8, 16, kind="int8", dtype=dtype)
    k_all, v_all = cache.update(*(torch.randn(1, 2, 5, 8, generator=g).to(dtype) for _ in range(2)))
    q = torch.randn(1, 4, 1, 8, generator=g).to(dtype)
    calls = []
    real = quant.quantize_int8
    monkeypatch.setattr(quant, "quantize_int8", lambda *a: calls.append(1) or real(*a))
    fast = quant.KVInt8()(q, k_all, v_all, mask=mh.causal())
    assert calls == []  # the cache's own keys and values: nothing rounded again
    slow = quant.KVInt8()(q, k_all.clone(), v_all.clone(), mask=mh.causal())
    assert len(calls) == 2 and fast.dtype == slow.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-2  # bf16: the re-rounded scale moves the last bf16 bit
    torch.testing.assert_close(fast.float(), slow.float(), rtol=tol, atol=tol)


def test_kv_int8_rounds_keys_that_did_not_come_from_an_int8_cache(lm, ids):
    q = quant.quantize(lm, weights=None)  # K/V rounding only
    with torch.no_grad():
        dense_cache = q.generate(ids[:, :6], 6, cache="dense")  # keys rounded by KVInt8 every step
        int8_cache = q.generate(ids[:, :6], 6, cache="int8")  # rounded once, in the cache
        exact = lm.generate(ids[:, :6], 6)
    assert torch.equal(dense_cache, int8_cache)
    assert dense_cache.shape == exact.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fbgemm_takes_half_activations_on_cpu(dtype):
    if not quant._fbgemm_ready():
        pytest.skip("this torch build has no fbgemm / x86 quantized engine")
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    x = torch.randn(2, 3, 64)
    fb, ref = quant.Int8Linear(lin, kernel="fbgemm"), quant.Int8Linear(lin, kernel="dequant")
    y = fb(x.to(dtype))
    assert y.dtype == dtype and y.shape == (2, 3, 48)
    with torch.no_grad():
        expect = ref(x)
    span = float(expect.max() - expect.min())
    assert float((y.float() - expect).abs().max()) <= LOGIT_TOL * span
    assert fb.choose(x.to(dtype)) == "fbgemm"
    assert quant.Int8Linear(lin).choose(x.to(dtype)) == "fbgemm"  # auto: the faster CPU kernel
    with pytest.raises(ValueError, match="'fbgemm' needs fp32, bf16 or fp16 CPU input"):
        fb(x.double())


def test_bf16_quantized_lm_within_tolerance_of_bf16(lm, ids):
    lm16 = quant.copy.deepcopy(lm).to(torch.bfloat16)
    with torch.no_grad():
        ref = lm16(ids).float()
        out = quant.quantize(lm16)(ids).float()
    span = float(ref.max() - ref.min())
    assert float((out - ref).abs().max()) <= LOGIT_TOL * span
    assert float((out.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9
