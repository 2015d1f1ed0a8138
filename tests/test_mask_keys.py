"""Mask cache keys: equal for equal masks, different after any change that changes the mask values."""

import gc

import pytest
import torch

import multihead as mh
from multihead.core.mask_keys import KeyedCache, mask_dims, mask_key, mask_tensors
from multihead.core.masks import MaskContext

CTX = MaskContext(2, 4, 16, 16)


def test_structural_masks_built_apart_share_a_key():
    assert mask_key(mh.causal(), CTX) == mask_key(mh.causal(), CTX)
    assert mask_key(mh.sliding_window(8), CTX) == mask_key(mh.sliding_window(8), CTX)
    both = mh.prefix_lm(3) & ~mh.sliding_window(4) | mh.causal()
    again = mh.prefix_lm(3) & ~mh.sliding_window(4) | mh.causal()
    assert mask_key(both, CTX) == mask_key(again, CTX)


def test_different_parameters_structure_shape_or_device_change_the_key():
    keys = {
        mask_key(mh.sliding_window(8), CTX),
        mask_key(mh.sliding_window(4), CTX),
        mask_key(mh.causal(), CTX),
        mask_key(~mh.causal(), CTX),
        mask_key(mh.prefix_lm(3), CTX),
        mask_key(mh.prefix_lm(4), CTX),
        mask_key(mh.causal() & mh.prefix_lm(3), CTX),
        mask_key(mh.causal() | mh.prefix_lm(3), CTX),
        mask_key(mh.causal(), MaskContext(2, 4, 8, 16)),
        mask_key(mh.causal(), MaskContext(2, 4, 16, 32)),
        mask_key(mh.causal(), CTX, "meta"),
    }
    assert len(keys) == 11


def test_batch_and_head_enter_the_key_only_when_the_mask_reads_them():
    assert mask_key(mh.causal(), CTX) == mask_key(mh.causal(), MaskContext(7, 9, 16, 16))
    lengths = torch.tensor([16, 9])
    assert mask_dims(mh.padding(lengths), CTX) == (True, False)
    assert mask_dims(mh.causal() & mh.padding(lengths), CTX) == (True, False)
    assert mask_dims(mh.padding([5]), MaskContext(1, 4, 16, 16)) == (False, False)  # B=1 broadcasts
    per_head = torch.ones(1, 4, 1, 1, dtype=torch.bool)
    assert mask_dims(mh.causal() & per_head, CTX) == (False, True)
    assert mask_dims(mh.document(torch.zeros(16, dtype=torch.long)), CTX) == (False, False)
    assert mask_dims(mh.document(torch.zeros(2, 16, dtype=torch.long)), CTX) == (True, False)


def test_mask_dims_of_unknown_masks_reads_the_broadcast_shape():
    by_head = mh.custom(lambda b, h, q, k: (h % 2 == 0) | (k <= q))
    by_none = mh.custom(lambda b, h, q, k: k <= q)
    assert mask_dims(by_head, CTX) == (False, True)
    assert mask_dims(by_none, CTX) == (False, False)


def test_custom_predicates_have_no_key():
    assert mask_key(mh.custom(lambda b, h, q, k: k <= q), CTX) is None
    assert mask_key(mh.causal() & mh.custom(lambda b, h, q, k: k <= q), CTX) is None


def test_small_cpu_tensors_are_keyed_by_contents():
    ctx = MaskContext(2, 1, 16, 16)
    assert mask_key(mh.padding([16, 9]), ctx) == mask_key(mh.padding(torch.tensor([16, 9])), ctx)
    assert mask_key(mh.padding([16, 9]), ctx) != mask_key(mh.padding([16, 8]), ctx)
    ids = torch.tensor([0] * 8 + [1] * 8)
    assert mask_key(mh.document(ids), CTX) == mask_key(mh.document(ids.clone()), CTX)
    assert mask_tensors(mh.document(ids)) == []  # nothing to keep alive


def test_large_tensors_are_keyed_by_identity_and_version(monkeypatch):
    monkeypatch.setattr("multihead.core.mask_keys.CONTENT_KEY_NUMEL", 0)
    ids = torch.tensor([0] * 8 + [1] * 8)
    before = mask_key(mh.document(ids), CTX)
    assert mask_key(mh.document(ids), CTX) == before  # a new mask over the same tensor (a new view)
    assert mask_key(mh.document(ids.clone()), CTX) != before  # equal contents, other tensor
    ids[3] = 1  # in-place edit bumps the version counter
    assert mask_key(mh.document(ids), CTX) != before
    assert mask_tensors(mh.document(ids))[0] is ids  # the owner of the view is what must stay alive


def test_keyed_cache_reuses_bounds_and_rebuilds_after_edits(monkeypatch):
    monkeypatch.setattr("multihead.core.mask_keys.CONTENT_KEY_NUMEL", 0)
    cache: KeyedCache[int] = KeyedCache(maxsize=3)
    built = iter(range(100))
    assert cache.get(mh.sliding_window(4), CTX, "cpu", lambda: next(built)) == 0
    assert cache.get(mh.sliding_window(4), CTX, "cpu", lambda: next(built)) == 0  # hit
    for w in (5, 6, 7, 8):
        cache.get(mh.sliding_window(w), CTX, "cpu", lambda: next(built))
    assert len(cache) == 3 and cache.builds == 5
    assert cache.get(mh.sliding_window(4), CTX, "cpu", lambda: next(built)) == 5  # evicted: rebuilt
    ids = torch.zeros(16, dtype=torch.long)
    first = cache.get(mh.document(ids), CTX, "cpu", lambda: next(built))
    assert cache.get(mh.document(ids), CTX, "cpu", lambda: next(built)) == first
    ids[10:] = 1
    assert cache.get(mh.document(ids), CTX, "cpu", lambda: next(built)) != first


def test_keyed_cache_never_serves_an_entry_whose_tensor_died(monkeypatch):
    # a freed tensor's id and address can be reused by a new one: force such a collision of keys
    monkeypatch.setattr("multihead.core.mask_keys.CONTENT_KEY_NUMEL", 0)
    monkeypatch.setattr("multihead.core.mask_keys.cache_key", lambda mask, ctx, device: "same")
    cache: KeyedCache[str] = KeyedCache(maxsize=4)
    ids = torch.zeros(16, dtype=torch.long)
    assert cache.get(mh.document(ids), CTX, "cpu", lambda: "old") == "old"
    assert cache.get(mh.document(ids), CTX, "cpu", lambda: "new") == "old"
    del ids
    gc.collect()
    other = torch.ones(16, dtype=torch.long)
    assert cache.get(mh.document(other), CTX, "cpu", lambda: "new") == "new"
    assert len(cache) == 1 and cache.builds == 2


def test_custom_masks_are_built_every_time_and_not_stored():
    cache: KeyedCache[int] = KeyedCache(maxsize=2)
    m = mh.custom(lambda b, h, q, k: k <= q)
    cache.get(m, CTX, "cpu", lambda: 1)
    cache.get(m, CTX, "cpu", lambda: 1)
    assert cache.builds == 2 and len(cache) == 0


def test_keyed_cache_rejects_a_bad_size():
    with pytest.raises(ValueError, match="maxsize must be >= 1, got 0"):
        KeyedCache(0)


def test_mask_dims_evaluates_unknown_masks_on_the_device_of_their_tensors():
    # a predicate reading a tensor on another device (the meta device stands in for a GPU) cannot be
    # evaluated on CPU indices; flex asks on the device of the call
    per_head = torch.zeros(4, dtype=torch.long, device="meta")
    m = mh.custom(lambda b, h, q, k: (k <= q) | (per_head[h] > 0))
    assert mask_dims(m, CTX, "meta") == (False, True)
    with pytest.raises(RuntimeError):
        mask_dims(m, CTX)
