"""Int8 weights and int8 K/V: within a stated tolerance of fp32, smaller, and generating."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.models import quant

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
