"""Hypothesis property test: random shapes and random mask compositions, every backend equals reference."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead.backends.registry import get as get_backend
from multihead.core.problem import make_problem
from tests.numerics import TOL, max_err


@st.composite
def masks(draw, B: int, Nk: int):
    leaf = draw(st.sampled_from(["causal", "window", "padding", "document", "prefix", "none"]))
    if leaf == "causal":
        m = mh.causal()
    elif leaf == "window":
        m = mh.sliding_window(draw(st.integers(1, Nk + 2)))
    elif leaf == "padding":
        m = mh.padding(draw(st.lists(st.integers(0, Nk), min_size=B, max_size=B)))
    elif leaf == "document":
        ids = sorted(draw(st.lists(st.integers(0, 3), min_size=Nk, max_size=Nk)))
        m = mh.document(ids)
    elif leaf == "prefix":
        m = mh.prefix_lm(draw(st.integers(0, Nk)))
    else:
        return None
    op = draw(st.sampled_from(["leaf", "and", "or", "not"]))
    if op == "and":
        return m & mh.causal()
    if op == "or":
        return m | mh.sliding_window(2)
    if op == "not":
        return ~m
    return m


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_problems_agree_with_reference(data):
    B = data.draw(st.integers(1, 2))
    Hkv = data.draw(st.integers(1, 3))
    G = data.draw(st.integers(1, 3))
    Nq = data.draw(st.integers(1, 40))
    Nk = data.draw(st.integers(1, 40))
    D = data.draw(st.integers(1, 20))
    Dv = data.draw(st.integers(1, 20))
    mask = data.draw(masks(B, Nk))
    use_alibi = data.draw(st.booleans())
    bias = mh.alibi(Hkv * G) if use_alibi else None
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q = torch.randn(B, Hkv * G, Nq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, Nk, Dv, generator=g, dtype=torch.float64)
    gold = mh.attention(q, k, v, mask=mask, bias=bias, backend="reference")
    assert torch.isfinite(gold).all()
    for name in ["matrix", "sdpa", "tiled", "auto"]:
        if name != "auto" and get_backend(name).why_not(make_problem(q, k, v, mask=mask, bias=bias)):
            continue
        out = mh.attention(q, k, v, mask=mask, bias=bias, backend=name)
        assert max_err(out, gold) < TOL[torch.float64], name
