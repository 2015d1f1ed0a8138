"""flex block masks: equal to torch's create_block_mask, built once per mask and shape, never stale.

Nothing here compiles: block masks are built eagerly on the CPU, and the flex call is replaced by a
recorder where the backend's path is followed.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import multihead as mh
from multihead.backends import flex as flex_mod
from multihead.backends import flex_blocks
from multihead.core.mask_keys import KeyedCache
from multihead.core.masks import MaskContext
from multihead.core.problem import make_problem

flex_api = pytest.importorskip("torch.nn.attention.flex_attention", reason="this torch has no flex_attention")
CPU = torch.device("cpu")

EXACT = [  # analytic tile kinds that are exact: the same block mask as torch builds element by element
    (mh.causal(), MaskContext(1, 2, 300, 300)),
    (mh.causal(), MaskContext(1, 2, 200, 700)),  # bottom-right, ragged
    (mh.sliding_window(150), MaskContext(1, 2, 700, 700)),
    (mh.prefix_lm(200), MaskContext(1, 2, 512, 512)),
    (mh.document(torch.tensor([0] * 300 + [1] * 100 + [2] * 240)) & mh.causal(), MaskContext(2, 2, 640, 640)),
    (mh.padding([640, 130]) & mh.causal(), MaskContext(2, 2, 640, 640)),
    (mh.key_padding(torch.arange(1500).reshape(3, 500) % 7 != 3), MaskContext(3, 2, 256, 500)),
]


def torch_block_mask(mask, ctx):
    def mask_mod(b, h, q, k):
        return mask.evaluate(b, h, q, k, ctx)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex_api.create_block_mask(mask_mod, ctx.B, ctx.H, ctx.Nq, ctx.Nk, device="cpu")


def split(bm, like):
    """(non-empty tiles, full tiles) as dense (B, H, nqb, nkb) bools, broadcast to ``like``'s shape."""
    shape = (*like.kv_num_blocks.shape, like.kv_indices.shape[-1])
    nonempty = bm.to_dense().bool().expand(shape)
    full = flex_api.BlockMask.from_kv_blocks(
        bm.full_kv_num_blocks, bm.full_kv_indices, BLOCK_SIZE=bm.BLOCK_SIZE, seq_lengths=bm.seq_lengths
    ).to_dense()
    return nonempty, full.bool().expand(shape)


@pytest.mark.parametrize("mask, ctx", EXACT, ids=[repr(m)[:40] for m, _ in EXACT])
def test_analytic_block_masks_equal_torchs(mask, ctx):
    ours, theirs = flex_blocks.build(mask, ctx, CPU), torch_block_mask(mask, ctx)
    (a_any, a_full), (b_any, b_full) = split(ours, theirs), split(theirs, theirs)
    assert torch.equal(a_any, b_any) and torch.equal(a_full, b_full)


def test_conservative_kinds_never_skip_a_needed_tile():
    mask, ctx = ~mh.sliding_window(200) & mh.causal(), MaskContext(1, 2, 640, 640)
    ours, theirs = flex_blocks.build(mask, ctx, CPU), torch_block_mask(mask, ctx)
    (a_any, a_full), (b_any, b_full) = split(ours, theirs), split(theirs, theirs)
    assert bool((a_any | ~b_any).all()), "a tile torch needs is missing"
    assert bool((b_full | ~a_full).all()), "a tile is marked full that torch must mask"


def test_batch_and_head_dims_are_built_only_when_the_mask_reads_them():
    assert flex_blocks.build(mh.causal(), MaskContext(4, 8, 256, 256), CPU).kv_num_blocks.shape == (1, 1, 2)
    padded = flex_blocks.build(mh.padding([256, 100, 3, 256]), MaskContext(4, 8, 256, 256), CPU)
    assert padded.kv_num_blocks.shape == (4, 1, 2)
    assert padded.full_kv_num_blocks[:, 0, 0].tolist() == [2, 0, 0, 2]  # rows 1 and 2 end inside tile 0
    by_head = mh.custom(lambda b, h, q, k: (k <= q) | (h == 0))  # no analytic kinds: torch builds it
    bm = flex_blocks.build(by_head, MaskContext(2, 3, 256, 256), CPU)
    assert bm.kv_num_blocks.shape == (1, 3, 2)
    assert bm.to_dense()[0, :, 0].tolist() == [[1, 1], [1, 0], [1, 0]]


@pytest.fixture
def counted(monkeypatch):
    """A fresh cache, and a builder that counts its calls instead of building."""
    calls: list[tuple] = []
    monkeypatch.setattr(flex_blocks, "CACHE", KeyedCache(4))
    monkeypatch.setattr(flex_blocks, "build", lambda mask, ctx, device: calls.append((mask, ctx)) or object())
    return calls


def test_an_equal_mask_builds_nothing_and_another_window_builds_anew(counted):
    ctx = MaskContext(1, 4, 512, 512)
    first = flex_blocks.block_mask_for(mh.sliding_window(64), ctx, CPU)
    assert flex_blocks.block_mask_for(mh.sliding_window(64), ctx, CPU) is first
    assert flex_blocks.block_mask_for(mh.sliding_window(64), MaskContext(3, 2, 512, 512), CPU) is first
    assert flex_blocks.block_mask_for(mh.sliding_window(65), ctx, CPU) is not first
    assert flex_blocks.block_mask_for(mh.sliding_window(64), MaskContext(1, 4, 511, 511), CPU) is not first
    assert len(counted) == 3


def test_the_cache_stays_bounded(counted):
    ctx = MaskContext(1, 4, 512, 512)
    for w in range(1, 20):
        flex_blocks.block_mask_for(mh.sliding_window(w), ctx, CPU)
    assert len(flex_blocks.CACHE) == 4 and len(counted) == 19
    flex_blocks.block_mask_for(mh.sliding_window(1), ctx, CPU)  # long evicted
    assert len(counted) == 20


def test_an_in_place_edit_of_document_ids_is_not_served_a_stale_block_mask(counted):
    n = 5000  # past the size keyed by contents: keyed by the tensor and its version counter
    ids = torch.zeros(n, dtype=torch.long)
    ctx = MaskContext(1, 2, n, n)
    first = flex_blocks.block_mask_for(mh.document(ids) & mh.causal(), ctx, CPU)
    assert flex_blocks.block_mask_for(mh.document(ids) & mh.causal(), ctx, CPU) is first
    ids[2500:] = 1
    assert flex_blocks.block_mask_for(mh.document(ids) & mh.causal(), ctx, CPU) is not first
    assert len(counted) == 2


def test_masks_holding_large_tensors_are_not_cached(counted, monkeypatch):
    monkeypatch.setattr(flex_blocks, "MAX_HELD_BYTES", 100)
    lengths = torch.full((16,), 64)  # 128 bytes
    ctx = MaskContext(16, 2, 64, 64)
    flex_blocks.block_mask_for(mh.padding(lengths), ctx, CPU)
    flex_blocks.block_mask_for(mh.padding(lengths), ctx, CPU)
    assert len(counted) == 2 and len(flex_blocks.CACHE) == 0


def test_the_backend_reuses_the_cached_block_mask(monkeypatch):
    # Follow FlexBackend.run without compiling: the compiled flex call is replaced by a recorder.
    seen = []

    def fake_flex(q, k, v, *, block_mask, return_lse, **kw):
        seen.append(block_mask)
        out = torch.zeros_like(q)
        return (out, torch.zeros(q.shape[:3])) if return_lse else out

    monkeypatch.setattr(flex_blocks, "CACHE", KeyedCache(4))
    monkeypatch.setattr(flex_mod, "_compiled", lambda: fake_flex)
    monkeypatch.setattr(flex_mod.BACKEND, "unusable", lambda: None)
    q = torch.randn(2, 4, 300, 8)
    for _ in range(3):
        flex_mod.BACKEND.run(make_problem(q, q, q, mask=mh.sliding_window(100)))
    assert seen[0] is seen[1] is seen[2] and flex_blocks.CACHE.builds == 1
    flex_mod.BACKEND.run(make_problem(q, q, q, mask=mh.sliding_window(99)))
    assert seen[3] is not seen[0] and flex_blocks.CACHE.builds == 2
