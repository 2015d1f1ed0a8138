"""The optional ``flex`` backend: compiled flex_attention, checked against the oracle where it compiles."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.backends import flex as flex_mod
from multihead.core.problem import make_problem
from tests.numerics import max_err


def test_flex_is_opt_in_and_explains_itself():
    q = torch.randn(1, 2, 8, 4)
    p = make_problem(q, q, q, mask=mh.causal())
    why = flex_mod.BACKEND.why_not(p)
    assert why is not None  # auto never picks flex
    if not torch.cuda.is_available() and flex_mod.BACKEND.unusable() is None:
        assert ("flex" in mh.backends()) == flex_mod.should_register()


def test_flex_refuses_dropout_with_a_reason():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="backend 'flex' cannot serve this call"):
        flex_mod.BACKEND.run(make_problem(q, q, q, dropout_p=0.5))


def test_flex_matches_reference():
    why = flex_mod.BACKEND.unusable()
    if why is not None:
        print(f"skipping: {why}")
        pytest.skip(why)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 100, 16, generator=g)
    k, v = torch.randn(1, 2, 100, 16, generator=g), torch.randn(1, 2, 100, 16, generator=g)
    mask, bias = mh.sliding_window(17), mh.alibi(4)
    try:
        out = flex_mod.BACKEND.run(make_problem(q, k, v, mask=mask, bias=bias)).out
    except Exception as e:  # compile toolchain problems are the machine's, not the adapter's
        print(f"skipping: flex_attention did not compile here: {type(e).__name__}: {e}")
        pytest.skip(f"flex_attention did not compile here: {type(e).__name__}")
    gold = mh.attention(q.double(), k.double(), v.double(), mask=mask, bias=bias, backend="reference")
    assert max_err(out, gold) < 1e-5
