"""Native decode steps of a batch (several rows at one position, no padding): each row with the bits a
native step of it alone gives it, the eager batch's numbers, the batch's tokens, and the eager step where
the batch is too large for the native rows."""

from __future__ import annotations

import copy

import pytest
import torch

import multihead as mh
from multihead import native
from multihead.models import native_step, quant
from tests.native_counts import count_native_steps

REASON = native.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")
FP16 = pytest.mark.skipif(torch.float16 not in native.dtypes(), reason="no fp16 kernel here")
MODELS = [
    pytest.param({"weights": "fp32", "kv": None}, id="fp32"),
    pytest.param({"weights": "bf16", "kv": None}, id="bf16"),
    pytest.param({"weights": "fp16", "kv": None}, id="fp16", marks=FP16),
    pytest.param({"weights": "int8", "kv": "int8", "group_size": 32}, id="int8-g32"),
    pytest.param({"weights": "int8", "kv": "int8", "group_size": None}, id="int8-row"),
]


def _lm(d=512, seed=0):
    """Widths of whole 512s and tails (d 512, d_ff 640: the int8 rows' blocked chunks and their rest)."""
    torch.manual_seed(seed)
    lm = mh.TransformerLM(300, d, 2, 4, 640, n_kv_heads=2, norm_eps=1e-6).eval()
    with torch.no_grad():
        for m in lm.modules():
            if isinstance(m, mh.nn.norms.RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return lm


def _token_by_token(model, tokens, max_len=32):
    """Every token of ``tokens`` (B, T) fed as a one-token step: the stacked hidden states (B, T, d) and
    the caches (a native model's steps are all native)."""
    cache = model.make_cache(tokens.shape[0], max_len)
    with torch.inference_mode():
        hs = [model.hidden_states(tokens[:, t : t + 1], cache=cache) for t in range(tokens.shape[1])]
    return torch.cat(hs, 1), cache


@pytest.mark.parametrize("kw", MODELS)
def test_each_row_of_a_native_batch_has_the_bits_of_its_steps_alone(kw, monkeypatch):
    model = quant.quantize(_lm(), kernel="native", **kw)
    tokens = torch.randint(0, 300, (3, 7), generator=torch.Generator().manual_seed(1))  # (B, T)
    calls = count_native_steps(monkeypatch)
    got, cache = _token_by_token(model, tokens)
    assert len(calls) == 7  # one native call a step for the three rows
    for b in range(3):
        alone, own = _token_by_token(model, tokens[b : b + 1])
        assert torch.equal(got[b], alone[0])
        for kv, kv1 in zip(cache, own):  # the same keys and values (and int8 scales) written
            assert torch.equal(kv.k[b], kv1.k[0]) and torch.equal(kv.v[b], kv1.v[0])
            if kv.k_scale is not None:
                assert torch.equal(kv.k_scale[b], kv1.k_scale[0])
    assert len(calls) == 7 + 3 * 7


def test_a_native_fp32_batch_matches_the_float64_model():
    lm = _lm()
    tokens = torch.randint(0, 300, (4, 6), generator=torch.Generator().manual_seed(2))
    got, cache = _token_by_token(quant.quantize(lm, weights="fp32", kv=None, kernel="native"), tokens)
    want, ref = _token_by_token(copy.deepcopy(lm).double(), tokens)
    assert float((got.double() - want).abs().max()) < 1e-5 * float(want.abs().max())
    for c, r in zip(cache, ref):
        torch.testing.assert_close(c.k[:, :, :6].double(), r.k[:, :, :6], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", MODELS[1:])
def test_a_native_batch_follows_the_eager_batch(kw):
    """bf16 / fp16: as close to the eager batch as a native row is to an eager row; int8 also within 1%
    of the range (the attentions' sums in another order can move an activation across an int8 rounding
    boundary, one step of 1/127 of its block's largest value, in one row and not in another)."""
    lm, tokens = _lm(), torch.randint(0, 300, (3, 6), generator=torch.Generator().manual_seed(3))
    fast = quant.quantize(lm, kernel="native", **kw)
    slow = quant.quantize(lm, kernel="native", **kw)
    slow.native_steps = False
    got, _ = _token_by_token(fast, tokens)
    want, _ = _token_by_token(slow, tokens)
    one, _ = _token_by_token(fast, tokens[:1])
    one_eager, _ = _token_by_token(slow, tokens[:1])
    row_gap = float((one.float() - one_eager.float()).abs().max())
    tol = 0.01 * float(want.abs().max()) if kw["weights"] == "int8" else 1e-5
    assert float((got.float() - want.float()).abs().max()) <= max(2 * row_gap, tol)


@pytest.mark.parametrize("kw", [MODELS[0], MODELS[3]])
def test_a_batch_generates_natively_the_tokens_of_each_prompt_alone(kw, monkeypatch):
    model = quant.quantize(_lm(), kernel="native", **kw)
    prompts = torch.randint(0, 300, (3, 8), generator=torch.Generator().manual_seed(4))  # equal lengths
    calls = count_native_steps(monkeypatch)
    with torch.inference_mode():
        got = model.generate(prompts, 10)
        assert len(calls) == 9  # every step after the prefill, the three rows in one call
        for b in range(3):
            assert torch.equal(got[b : b + 1], model.generate(prompts[b : b + 1], 10))


def test_batches_past_the_native_rows_take_the_eager_step():
    lm = _lm()
    fp32 = quant.quantize(lm, weights="fp32", kv=None, kernel="native")
    int8 = quant.quantize(lm, weights="int8", kv="int8", kernel="native", group_size=32)
    rows = torch.arange(native_step.ROWS_FLOAT + 1).view(-1, 1)  # (17, 1)
    many = torch.zeros(native_step.ROWS_INT8 + 1, 1, dtype=torch.long)
    with torch.inference_mode():
        assert native_step.why_not_call(fp32, rows, None, fp32.make_cache(17, 8)) == (
            "a batch of 17 rows (native steps take up to 16 rows of this model's weights)"
        )
        assert native_step.why_not_call(int8, rows, None, int8.make_cache(17, 8), "int8") is None
        assert "native steps take up to 64 rows" in native_step.why_not_call(
            int8, many, None, int8.make_cache(len(many), 8), "int8"
        )
    tokens = torch.randint(0, 300, (17, 3), generator=torch.Generator().manual_seed(5))
    got, _ = _token_by_token(fp32, tokens)  # 17 rows: the eager step, the float64 model's numbers
    want, _ = _token_by_token(copy.deepcopy(lm).double(), tokens)
    assert float((got.double() - want).abs().max()) < 1e-5 * float(want.abs().max())
