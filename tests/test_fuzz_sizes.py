"""Sizes and numbers a user gives are checked before any work: a clear ValueError, never an
OverflowError, an IndexError, a RuntimeError from deep inside torch, NaN, or an allocation that cannot fit.

Every property draws arguments from the whole range (negative, zero, huge, subnormal, non-finite,
wrong types) and requires: either the call works and its result is right, or it raises a ValueError.
Refusals that must come before allocating are checked with a tiny limit (``MULTIHEAD_MAX_SCORE_BYTES``)
and a patched materialisation, never with timings.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead.core.checks import MAX_INDEX
from multihead.models.lm import TransformerLM

HUGE_INTS = st.one_of(
    st.integers(-5, 40), st.sampled_from([2**62, 2**62 + 1, 2**63, 10**30, -(10**30)]), st.integers()
)
NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([5e-324, 1e-45, 1e-300, 1e300, 0.0, -0.0]),
    st.integers(-3, 3),
    st.booleans(),
    st.none(),
    st.just("1"),
)


def small_qkv(n: int = 6):
    torch.manual_seed(0)
    return torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4)


# -- mask and bias constructors ---------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(size=st.one_of(HUGE_INTS, NUMBERS))
def test_mask_sizes_construct_or_raise_value_error(size):
    q, k, v = small_qkv()
    for make in (mh.sliding_window, mh.prefix_lm):
        try:
            mask = make(size)
        except ValueError as e:
            assert "must be" in str(e)
            continue
        assert isinstance(size, int) and not isinstance(size, bool) and 0 <= size <= MAX_INDEX
        want = mh.attention(q, k, v, mask=mask, backend="reference")
        assert torch.isfinite(want).all()
        torch.testing.assert_close(mh.attention(q, k, v, mask=mask, backend="tiled"), want.float())


@settings(max_examples=100, deadline=None)
@given(n_heads=st.one_of(HUGE_INTS, NUMBERS))
def test_alibi_head_counts_construct_or_raise_value_error(n_heads):
    try:
        bias = mh.alibi(n_heads)
    except ValueError as e:
        assert "alibi n_heads must be" in str(e)
        return
    assert isinstance(n_heads, int) and 1 <= n_heads <= 1 << 16
    assert bias.slopes.shape == (n_heads,)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(HUGE_INTS, min_size=1, max_size=3))
def test_padding_and_document_lists_construct_or_raise_value_error(values):
    q, k, v = small_qkv(n=len(values))
    for make in (lambda: mh.padding(values[:1]), lambda: mh.document(values)):
        try:
            mask = make()
        except ValueError as e:
            assert "must be" in str(e)
            continue
        try:
            out = mh.attention(q, k, v, mask=mask)
        except ValueError as e:
            assert "exceed" in str(e) or "lengths" in str(e)
            continue
        assert torch.isfinite(out).all()


# -- custom predicates of any shape ------------------------------------------------------------------------
#: shape changes of an elementwise result: the first three keep it broadcastable (a different, valid
#: mask), the last three do not
OPS = {
    "elementwise": (lambda t: t, True),
    "any over the keys": (
        lambda t: t.any(dim=-1, keepdim=True) if t.dtype == torch.bool else t.sum(-1, True),
        True,
    ),
    "first key only": (lambda t: t[..., :1], True),
    "flattened": (lambda t: t.reshape(-1), False),
    "a fifth dim": (lambda t: t[None], False),
    "three keys": (lambda t: t[..., :3], False),
}


def _index_fn(op, bias: bool = False):
    def fn(b, h, qi, ki):
        full = (qi * 7 + ki * 3 + h + b) % 5  # broadcast (1, H, nq, nk)
        return op(full.double() / 5 if bias else full > 1)

    return fn


def _dense(fn) -> torch.Tensor:
    from multihead.core.masks import MaskContext, index_grid

    out = fn(*index_grid(MaskContext(1, 2, 6, 6)))
    return out.reshape((1,) * (4 - out.dim()) + tuple(out.shape)).expand(1, 2, 6, 6)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op=st.sampled_from(list(OPS)))
@pytest.mark.parametrize("backend", ["auto", "reference", "matrix", "sdpa", "tiled"])
def test_custom_mask_of_any_shape_works_or_raises_value_error(backend, op):
    q, k, v = small_qkv()
    change, fits = OPS[op]
    fn = _index_fn(change)
    if not fits:
        with pytest.raises(ValueError, match=r"custom mask fn 'fn' returned shape .* must broadcast"):
            mh.attention(q, k, v, mask=mh.custom(fn), backend=backend)
        return
    want = mh.attention(q, k, v, mask=_dense(fn), backend="reference")
    torch.testing.assert_close(mh.attention(q, k, v, mask=mh.custom(fn), backend=backend), want.float())


@settings(max_examples=30, deadline=None)
@given(op=st.sampled_from(list(OPS)))
def test_custom_bias_of_any_shape_works_or_raises_value_error(op):
    q, k, v = small_qkv()
    change, fits = OPS[op]
    fn = _index_fn(change, bias=True)
    for backend in ("matrix", "tiled", "sdpa"):
        if not fits:
            with pytest.raises(ValueError, match=r"custom_bias fn 'fn' returned shape .* must broadcast"):
                mh.attention(q, k, v, bias=mh.custom_bias(fn), backend=backend)
        else:
            want = mh.attention(q, k, v, bias=_dense(fn), backend="reference")
            got = mh.attention(q, k, v, bias=mh.custom_bias(fn), backend=backend)
            torch.testing.assert_close(got, want.float())


# -- dense paths refuse before allocating ----------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(n=st.integers(8, 96), window=st.integers(1, 100))
def test_sdpa_refuses_a_dense_mask_over_the_limit_before_building_it(n, window):
    """The limit is 8 KiB: the (n, n) bool mask and its float copy take 5 n^2 bytes in fp32."""
    from multihead.core.masks import SlidingWindow

    q = torch.randn(1, 1, n, 4)
    mask = mh.sliding_window(window)
    want = mh.attention(q, q, q, mask=mask, backend="reference").float()
    built: list[int] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MULTIHEAD_MAX_SCORE_BYTES", "8192")
        if 5 * n * n <= 8192:
            torch.testing.assert_close(mh.attention(q, q, q, mask=mask, backend="sdpa"), want)
            return
        out = mh.attention(q, q, q, mask=mask)  # auto leaves it to a path that builds no (n, n) mask
        torch.testing.assert_close(out, want)
        assert "auto -> sdpa" not in mh.explain(q, q, q, mask=mask)
        mp.setattr(SlidingWindow, "natural", lambda self, ctx, device=None: built.append(1))
        with pytest.raises(
            ValueError, match=r"backend 'sdpa' would materialise the mask as a dense attn_mask"
        ):
            mh.attention(q, q, q, mask=mask, backend="sdpa")
    assert not built  # refused before the mask was built


def test_sdpa_at_70000_keys_is_refused_and_auto_takes_tiled():
    q = torch.randn(1, 1, 70000, 8)
    with pytest.raises(
        ValueError, match=r"'sdpa' would materialise .* \(Nq, Nk\) = \(70000, 70000\): 22\.8 GiB"
    ):
        mh.attention(q, q, q, mask=mh.sliding_window(64), backend="sdpa")
    assert mh.explain(q, q, q, mask=mh.sliding_window(64)).splitlines()[1].startswith("auto -> tiled")


# -- generate ----------------------------------------------------------------------------------------------
def tiny_lm(max_len: int = 16) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(vocab_size=11, d_model=8, n_layers=1, n_heads=2, d_ff=16, max_len=max_len).eval()


LM = tiny_lm()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(0, 2),
    n=st.integers(0, 3),
    new=st.one_of(st.integers(-2, 4), st.sampled_from([13, 10**12, 2**63, 10**30])),
    temperature=st.one_of(st.just(1.0), NUMBERS),
    top_k=st.one_of(st.none(), st.integers(-1, 20), st.booleans()),
    top_p=st.one_of(st.none(), NUMBERS),
    eos=st.one_of(st.none(), st.integers(-1, 12), st.just("x")),
)
def test_generate_arguments_work_or_raise_value_error(b, n, new, temperature, top_k, top_p, eos):
    ids = torch.randint(0, 11, (b, n))
    try:
        out = LM.generate(
            ids, new, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos
        )
    except ValueError:
        return
    assert b >= 1 and n >= 1 and 0 <= new <= 16 - n
    assert isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0
    assert out.shape[0] == b and n <= out.shape[1] <= n + new
    assert torch.equal(out[:, :n], ids) and int(out.min()) >= 0 and int(out.max()) < 11


def test_an_empty_batch_is_a_value_error():
    with pytest.raises(ValueError, match=r"ids of shape \(0, 3\) has B=0 rows"):
        LM.generate(torch.zeros(0, 3, dtype=torch.long), 2)


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-300])
def test_a_tiny_temperature_samples_the_best_token(temperature):
    """softmax(logits / T) for T -> 0 is the argmax: computed shifted in float64, never inf / inf."""
    ids = torch.tensor([[1, 2, 3]])
    greedy = LM.generate(ids, 5)
    assert torch.equal(LM.generate(ids, 5, do_sample=True, temperature=temperature), greedy)


@pytest.mark.parametrize("temperature", [0, -1.0, math.inf, math.nan, "1", True])
def test_a_bad_temperature_is_a_value_error(temperature):
    with pytest.raises(ValueError, match=r"temperature must be > 0, got .*finite number"):
        LM.generate(torch.tensor([[1]]), 2, do_sample=True, temperature=temperature)


def test_a_huge_generation_is_refused_before_allocating(monkeypatch):
    """max_len 2**62 (a config's max_position_embeddings) lets 10**12 new tokens past the position
    check; the (B, N + new) output is then refused before it is allocated."""
    lm = tiny_lm(max_len=2**62)
    allocs: list[tuple] = []
    real_new_empty = torch.Tensor.new_empty

    def new_empty(self, *size, **kw):
        allocs.append(size)
        return real_new_empty(self, *size, **kw)

    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)
    with pytest.raises(
        ValueError, match=r"generated ids \(B, N \+ max_new_tokens\) = \(1, 1000000000003\) needs 7\.3 TiB"
    ):
        lm.generate(torch.tensor([[1, 2, 3]]), 10**12)
    assert not allocs
    with pytest.raises(ValueError, match=r"max_new_tokens must be at most 2\*\*62"):
        lm.generate(torch.tensor([[1, 2, 3]]), 10**30)


@pytest.mark.parametrize(
    ("sizes", "pattern"),
    [
        (dict(positions="learned", max_len=10**30), r"TransformerLM max_len must be at most 2\*\*62"),
        (
            dict(positions="sinusoidal", max_len=10**12),
            r"max_len=1000000000000\) has at least .* TiB, but only",
        ),
        (dict(vocab_size=10**12), r"vocab_size=1000000000000, .* TiB, but only .* lower vocab_size"),
        (dict(d_ff=10**30), r"d_ff=10{30}\) has at least .* TiB, but only"),
    ],
)
def test_model_sizes_past_memory_are_refused_before_building(sizes, pattern):
    """An embedding, position table or feed-forward that cannot fit is refused with the sizes named,
    not by torch's allocator (or an overflow) halfway through building the model."""
    kw = dict(vocab_size=11, d_model=8, n_layers=1, n_heads=2, d_ff=16) | sizes
    with pytest.raises(ValueError, match=pattern):
        TransformerLM(**kw)
