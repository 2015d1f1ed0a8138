"""Hidden keys are found from what a mask allows, however it is written.

A key that a mask hides from every query of its (batch, head) never influences the output or the
gradients, NaN in it included, and two spellings of the same mask (``~``, ``&``, ``|``, double negation,
De Morgan rewrites) give identical outputs on every CPU backend. The expected hidden keys come from the
dense mask (``mask.dense(...)`` reduced over its query rows), never from the library's own analysis.

Shape legend: B batch, HQ query heads, HKV kv heads, NQ queries, NK keys, D head dim.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead.core.dead_keys import seen_keys
from multihead.core.masks import MaskContext

B, HQ, HKV, D = 2, 2, 1, 4
BACKENDS = ("reference", "matrix", "sdpa", "tiled")


def _leaves(nq: int, nk: int) -> st.SearchStrategy:
    lengths = st.lists(st.integers(0, nk), min_size=B, max_size=B)
    real = st.lists(st.lists(st.booleans(), min_size=nk, max_size=nk), min_size=B, max_size=B)
    ids = st.lists(st.integers(0, 2), min_size=nk, max_size=nk).map(sorted)
    return st.one_of(
        st.just(mh.causal()),
        st.integers(1, nk + 2).map(mh.sliding_window),
        st.integers(0, nk).map(mh.prefix_lm),
        lengths.map(mh.padding),
        real.map(lambda r: mh.key_padding(torch.tensor(r))),
        ids.map(mh.document),
        real.map(lambda r: torch.tensor(r)[:, None, None, :]),  # a bool tensor mask (B, 1, 1, Nk)
        st.just(mh.custom(lambda b, h, q, k: (q + k) % 3 != 0)),
    )


@st.composite
def masks(draw, nq: int, nk: int, depth: int = 3):
    """A random composition of masks with ~, & and |."""
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        return mh.core.masks.as_mask(draw(_leaves(nq, nk)))
    op = draw(st.sampled_from(["not", "and", "or"]))
    a = draw(masks(nq, nk, depth - 1))
    if op == "not":
        return ~a
    b = draw(masks(nq, nk, depth - 1))
    return a & b if op == "and" else a | b


def respell(m):
    """The same mask written differently: double negation, and De Morgan's laws on every & and |."""
    from multihead.core.masks import AndMask, NotMask, OrMask

    def nn(x):  # a double negation built as such (``~~x`` is x itself)
        return NotMask(NotMask(x))

    if isinstance(m, OrMask):
        return NotMask(AndMask(NotMask(respell(m.a)), NotMask(respell(m.b))))
    if isinstance(m, AndMask):
        return NotMask(OrMask(NotMask(respell(m.a)), NotMask(respell(m.b))))
    if isinstance(m, NotMask):
        return NotMask(nn(respell(m.a)))
    return nn(m)


def hidden(mask, nq: int, nk: int) -> torch.Tensor:
    """(B, HKV, NK) the keys no query of any head of a kv head may see, from the dense mask."""
    dense = mask.dense(B, HQ, nq, nk)  # (B, HQ, NQ, NK)
    dead = ~dense.any(dim=-2)  # (B, HQ, NK)
    return dead.reshape(B, HKV, HQ // HKV, nk).all(dim=2)  # (B, HKV, NK)


def _run(q, k, v, mask, backend):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = mh.attention(q, k, v, mask=mask, backend=backend)
    out.backward(torch.ones_like(out))
    return out.detach(), q.grad, k.grad, v.grad


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), nq=st.integers(1, 9), nk=st.integers(1, 9))
def test_nan_in_hidden_keys_never_reaches_outputs_or_gradients(data, nq, nk):
    mask = data.draw(masks(nq, nk))
    torch.manual_seed(0)
    q, k, v = torch.randn(B, HQ, nq, D), torch.randn(B, HKV, nk, D), torch.randn(B, HKV, nk, D)
    pad = hidden(mask, nq, nk)[..., None]  # (B, HKV, NK, 1)
    dirty_k, dirty_v = k.masked_fill(pad, float("nan")), v.masked_fill(pad, float("nan"))
    for backend in BACKENDS:
        clean = _run(q, k, v, mask, backend)
        dirty = _run(q, dirty_k, dirty_v, mask, backend)
        for what, a, b in zip(("out", "dq", "dk", "dv"), clean, dirty):
            assert torch.isfinite(b).all(), f"{backend} {mask!r}: NaN in {what}"
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=f"{backend} {mask!r} {what}")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), nq=st.integers(1, 9), nk=st.integers(1, 9))
def test_equivalent_spellings_give_identical_outputs(data, nq, nk):
    """Identical to the bit: the spellings have the same tile kinds and values, so every kernel takes the
    same path (the plain causal mask keeps SDPA's causal kernel as ``~~causal()`` is ``causal()``)."""
    mask = data.draw(masks(nq, nk))
    other = respell(mask)
    assert torch.equal(other.dense(B, HQ, nq, nk), mask.dense(B, HQ, nq, nk))  # the rewrite is sound
    torch.manual_seed(1)
    q, k, v = torch.randn(B, HQ, nq, D), torch.randn(B, HKV, nk, D), torch.randn(B, HKV, nk, D)
    pad = hidden(mask, nq, nk)[..., None]
    k, v = k.masked_fill(pad, float("nan")), v.masked_fill(pad, float("inf"))
    for backend in BACKENDS:
        a = mh.attention(q, k, v, mask=mask, backend=backend)
        b = mh.attention(q, k, v, mask=other, backend=backend)
        assert torch.isfinite(a).all(), f"{backend} {mask!r}"
        assert torch.equal(a, b), f"{backend}: {mask!r} and {other!r} differ"


@settings(max_examples=80, deadline=None)
@given(data=st.data(), nq=st.integers(1, 150), nk=st.integers(1, 150))
def test_seen_keys_equal_the_dense_masks_on_tile_boundaries(data, nq, nk):
    """The analysis by tiles (64 x 64, several key blocks, several row blocks) is exact."""
    mask = data.draw(masks(nq, nk, depth=2))
    ctx = MaskContext(B, HQ, nq, nk)
    got = seen_keys(mask, ctx, torch.device("cpu"))
    want = mask.dense(B, HQ, nq, nk).any(dim=-2)  # (B, HQ, NK)
    got = torch.ones_like(want) if got is None else got.expand_as(want)
    assert torch.equal(got, want), repr(mask)


# -- the spellings of the report -------------------------------------------------------------------------
PAD = torch.zeros(2, 12, dtype=torch.bool)
PAD[1, 9:] = True  # True = pad, the torch habit


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "spelling",
    [
        "key_padding(~pad)",
        "~key_padding(pad)",
        "~~padding([12, 9])",
        "~(~padding([12, 9]) | causal() & ~causal())",
        "NotMask(NotMask(padding([12, 9])))",
    ],
)
def test_negated_padding_spellings_hide_the_pad_keys(backend, spelling):
    from multihead.core.masks import NotMask

    names = {n: getattr(mh, n) for n in ("key_padding", "padding", "causal")}
    mask = eval(spelling, {"pad": PAD, "NotMask": NotMask, **names})
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    want = mh.attention(q, k, v, mask=mh.key_padding(~PAD), backend=backend)
    dirty = PAD[:, None, :, None]  # (B, 1, Nk, 1)
    k, v = k.masked_fill(dirty, float("nan")), v.masked_fill(dirty, float("nan"))
    got = mh.attention(q, k, v, mask=mask, backend=backend)
    assert torch.isfinite(got).all(), spelling
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_a_long_negated_mask_is_analysed_without_the_square():
    """~causal() at N=4096 hides key 0 from every query; finding it evaluates a few tiles, never the
    (N, N) mask."""
    sizes: list[int] = []

    def lower(b, h, q, k):
        out = q >= k
        sizes.append(out.numel())
        return out

    n = 4096
    mask = ~mh.causal() | (mh.padding([n]) & ~mh.custom(lower))
    ctx = MaskContext(1, 1, n, n)
    seen = seen_keys(~mh.causal(), ctx, torch.device("cpu"))
    assert seen is not None and seen.flatten().tolist() == [False] + [True] * (n - 1)
    seen = seen_keys(mask, ctx, torch.device("cpu"))  # the custom part is evaluated a block row at a time
    assert seen is not None and not bool(seen[..., 0].any()) and bool(seen[..., 1:].all())
    assert sizes and max(sizes) <= 64 * n


def test_the_models_own_cache_mask_opts_out():
    from multihead.core.dead_keys import clear_dead_keys
    from multihead.core.problem import make_problem
    from multihead.models.padding import TrailingKeyPadding

    q = torch.randn(1, 1, 1, 8)
    k = torch.randn(1, 1, 6, 8)
    real = torch.tensor([[False, False, True, True, True, True]])
    p = make_problem(q, k, k, mask=mh.causal() & TrailingKeyPadding(real))
    assert clear_dead_keys(p) is p  # the model wrote those slots: no copy of the cache
    p = make_problem(q, k, k, mask=mh.causal() & mh.key_padding(real))
    assert bool((clear_dead_keys(p).k[0, 0, :2] == 0).all())
