"""The optional ``flex`` backend: compiled flex_attention, checked against the oracle where it compiles."""

from __future__ import annotations

import os

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


def test_flex_gets_masks_and_biases_with_their_tensors_on_the_device_of_q():
    # Compiled flex code cannot move a captured tensor (CUDA: "Buffers cannot be created while lowering a
    # pointwise subgraph"), so the backend hands it copies whose tensors already live on q's device.
    from multihead.core.placement import on_device

    ids = torch.tensor([0, 0, 1, 1, 1])
    mask = (mh.document(ids) & mh.causal()) | ~mh.padding([3, 5])
    bias = mh.alibi(4) + mh.softcap(20.0)
    moved_mask, moved_bias = on_device(mask, "meta"), on_device(bias, "meta")

    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            return [obj]
        if isinstance(obj, list | tuple):
            return [t for x in obj for t in tensors(x)]
        if isinstance(obj, mh.Mask | mh.Bias):
            return [t for v in vars(obj).values() for t in tensors(v)]
        return []

    assert len(tensors(moved_mask)) == 2 and len(tensors(moved_bias)) == 1
    assert all(t.device.type == "meta" for t in tensors(moved_mask) + tensors(moved_bias))
    assert all(t.device.type == "cpu" for t in tensors(mask) + tensors(bias))  # the originals unchanged
    ctx = make_problem(torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)).ctx
    same = on_device(mask, "cpu")  # a tensor already on the device is shared, and the predicate unchanged
    assert tensors(same)[0] is tensors(mask)[0] and same is not mask
    assert torch.equal(same.natural(ctx), mask.natural(ctx))


def test_flex_stays_compiled_past_dynamos_default_recompile_limit():
    # dynamo recompiles flex_attention per shape; past its default limit of 8 torch silently runs flex's
    # unfused eager path (N x N scores). Ten sequence lengths must all run compiled.
    why = flex_mod.BACKEND.unusable()
    if why is not None:
        print(f"skipping: {why}")
        pytest.skip(why)
    import warnings

    mask = mh.causal() & mh.sliding_window(9)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for n in range(40, 120, 8):  # 10 shapes
            q, k, v = torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
            try:
                out = flex_mod.BACKEND.run(make_problem(q, k, v, mask=mask)).out
            except Exception as e:  # compile toolchain problems are the machine's, not the adapter's
                print(f"skipping: flex_attention did not compile here: {type(e).__name__}: {e}")
                pytest.skip(f"flex_attention did not compile here: {type(e).__name__}")
            gold = mh.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
            assert max_err(out, gold) < 1e-5
    unfused = [str(w.message) for w in seen if "without torch.compile" in str(w.message)]
    assert not unfused, unfused[0]


def test_flex_with_broadcast_and_per_row_block_masks_matches_reference():
    # One compiled call over two masks: a per-batch-row block mask (padding) combined with a broadcast
    # one (documents + causal); the cached block masks must serve flex exactly as built.
    if os.environ.get("MULTIHEAD_FLEX") != "1" or flex_mod.BACKEND.unusable() is not None:
        print("skipping: set MULTIHEAD_FLEX=1 to compile flex_attention on the CPU (about 30 s)")
        pytest.skip("set MULTIHEAD_FLEX=1 to compile flex_attention on the CPU")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 300, 16, generator=g) for _ in range(3))
    ids = torch.tensor([0] * 90 + [1] * 150 + [2] * 60)
    mask = mh.document(ids) & mh.causal() & mh.padding([300, 170])
    out = flex_mod.BACKEND.run(make_problem(q, k, v, mask=mask)).out
    gold = mh.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    assert max_err(out, gold) < 1e-5
