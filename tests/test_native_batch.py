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


@pytest.mark.parametrize("kw", MODELS)
def test_a_native_prompt_has_the_bits_of_its_tokens_stepped_one_by_one(kw, monkeypatch):
    """A prompt in native calls (int8: chunks of up to ROWS_INT8 tokens; here 150 = 64 + 64 + 22) and then
    its continuation (a second prompt at a filled cache): each token's state and cache row as the one-token
    steps give them, each token attending to the positions up to its own."""
    model = quant.quantize(_lm(), kernel="native", **kw)
    n = 150 if kw["weights"] == "int8" else native_step.ROWS_FLOAT
    tokens = torch.randint(0, 300, (1, n + 5), generator=torch.Generator().manual_seed(6))
    prompts: list[int] = []
    calls = count_native_steps(monkeypatch, prompts)
    cache = model.make_cache(1, 200)
    with torch.inference_mode():
        got = torch.cat(
            [
                model.hidden_states(tokens[:, :n], cache=cache),
                model.hidden_states(tokens[:, n:], cache=cache),
            ],
            1,
        )
    assert prompts == [n, 5] and not calls and cache[0].position == n + 5
    want, stepped = _token_by_token(model, tokens, max_len=200)
    assert torch.equal(got, want)
    for kv, kv1 in zip(cache, stepped):
        assert torch.equal(kv.k, kv1.k) and torch.equal(kv.v, kv1.v)
        if kv.k_scale is not None:  # an int8 cache's scales too
            assert torch.equal(kv.k_scale, kv1.k_scale) and torch.equal(kv.v_scale, kv1.v_scale)


def test_a_native_fp32_prompt_matches_the_float64_model():
    lm = _lm()
    tokens = torch.randint(0, 300, (1, 13), generator=torch.Generator().manual_seed(7))
    fast = quant.quantize(lm, weights="fp32", kv=None, kernel="native")
    ref = copy.deepcopy(lm).double()
    with torch.inference_mode():
        cache, rcache = fast.make_cache(1, 32), ref.make_cache(1, 32)
        got, want = fast.hidden_states(tokens, cache=cache), ref.hidden_states(tokens, cache=rcache)
    assert float((got.double() - want).abs().max()) < 1e-5 * float(want.abs().max())
    torch.testing.assert_close(cache[1].v[:, :, :13].double(), rcache[1].v[:, :, :13], rtol=1e-5, atol=1e-5)


def test_long_prompts_and_padded_ones_take_the_eager_layers():
    lm = _lm()
    fp32 = quant.quantize(lm, weights="fp32", kv=None, kernel="native")
    long = torch.zeros(1, native_step.ROWS_FLOAT + 1, dtype=torch.long)
    five = torch.zeros(1, 5, dtype=torch.long)
    mask = torch.ones(1, 5, dtype=torch.bool)
    mask[0, 0] = False
    with torch.inference_mode():
        assert native_step.why_not_call(fp32, long, None, fp32.make_cache(1, 32)).startswith(
            "17 tokens (native steps of float weights take up to 16;"
        )
        int8 = quant.quantize(lm, weights="int8", kv="int8", kernel="native", group_size=32)
        longer = torch.zeros(1, native_step.PROMPT_INT8 + 1, dtype=torch.long)
        assert native_step.why_not_call(int8, longer, None, int8.make_cache(1, 600), "int8") == (
            "513 tokens (native int8 prompts take up to 512; the eager attention is faster for more)"
        )
        assert native_step.why_not_call(int8, longer[:, 1:], None, int8.make_cache(1, 600), "int8") is None
        assert (
            native_step.why_not_call(fp32, five, None, fp32.make_cache(1, 4))
            == "the cache is full (4 positions)"
        )
        assert (
            native_step.why_not_call(fp32, five, mask, fp32.make_cache(1, 32))
            == "the attention mask has padding"
        )


@pytest.mark.parametrize("kw", [MODELS[1], MODELS[3]])
def test_generation_runs_its_prompt_natively(kw, monkeypatch):
    model = quant.quantize(_lm(), kernel="native", **kw)
    prompt = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(8))
    prompts: list[int] = []
    calls = count_native_steps(monkeypatch, prompts)
    with torch.inference_mode():
        got = model.generate(prompt, 8)
    assert prompts == [12] and len(calls) == 7
    with torch.inference_mode():  # the first new token: what the prompt fed one token at a time gives
        hs, _ = _token_by_token(model, prompt, max_len=32)
        assert int(model.lm_head(hs[:, -1:]).argmax(-1)) == int(got[0, 12])
