"""The paged KV cache: block accounting, sharing with copy-on-write, and attention over pages exact
against the dense KVCache of each sequence."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.serve import (
    BlockAllocator,
    OutOfBlocks,
    PagedKVCache,
    paged_attention,
    paged_attention_batched,
)
from tests.numerics import allowed, max_err

F32, F64 = torch.float32, torch.float64
HQ, HKV, D = 4, 2, 59  # GQA, an odd head dim


def tokens(n: int, seed: int, dtype=F32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HKV, D, generator=g, dtype=dtype), torch.randn(n, HKV, D, generator=g, dtype=dtype)


def fill(cache: PagedKVCache, lengths: dict[str, int], chunk: int = 7, layers: int = 1) -> dict:
    """Write each sequence's tokens in interleaved chunks (sequences grow side by side, as in serving);
    return seq -> (k, v) of all its tokens, (L, Hkv, D) each."""
    data = {s: tokens(n, seed=i, dtype=cache.dtype) for i, (s, n) in enumerate(lengths.items())}
    done = dict.fromkeys(lengths, 0)
    for s in lengths:
        cache.add_sequence(s)
    while any(done[s] < n for s, n in lengths.items()):
        for s, n in lengths.items():
            a, b = done[s], min(n, done[s] + chunk)
            if a == b:
                continue
            slots = cache.append_slots(s, b - a)
            for layer in range(layers):
                cache.write(layer, slots, data[s][0][a:b], data[s][1][a:b])
            done[s] = b
    return data


def table(cache: PagedKVCache, seqs: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    tabs = [cache.block_table(s) for s in seqs]
    width = max(len(t) for t in tabs)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tabs])  # (B, nb)
    return bt, torch.tensor([cache.length(s) for s in seqs])


def test_allocator_counts_holders_and_frees_at_zero():
    a = BlockAllocator(4)
    x = a.allocate(3)
    assert x == [0, 1, 2] and a.num_free == 1
    a.share(x[:2])
    a.release(x)
    assert a.num_free == 2 and a.refcount(0) == 1 and a.refcount(2) == 0
    with pytest.raises(OutOfBlocks, match="3 blocks asked, 2 of 4 free"):
        a.allocate(3)
    assert a.num_free == 2  # a refused allocation takes nothing


@pytest.mark.parametrize("kind", ["dense", "int8"])
@pytest.mark.parametrize("n_q", [1, 3])
def test_attention_over_pages_has_the_bits_of_the_dense_cache(kind, n_q):
    lengths = {"a": 113, "b": 16, "c": 40, "d": 3}
    cache = PagedKVCache(1, HKV, D, 20, block_size=16, kind=kind, dtype=F32)
    data = fill(cache, lengths)
    seqs = list(lengths)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(len(seqs), HQ, n_q, D, generator=g)
    scales = {"k_scale": cache.k_scale[0], "v_scale": cache.v_scale[0]} if kind == "int8" else {}
    bt, lens = table(cache, seqs)
    paged = paged_attention(q, cache.k[0], cache.v[0], bt, lens, **scales)
    batched = paged_attention_batched(q, cache.k[0], cache.v[0], bt, lens, **scales)
    for i, s in enumerate(seqs):
        k, v = data[s]
        n = lengths[s]
        dense = mh.KVCache(1, HKV, D, n, kind=kind, dtype=F32)
        if n > n_q:
            dense.update(k[: n - n_q].transpose(0, 1)[None], v[: n - n_q].transpose(0, 1)[None])
        kd, vd = dense.update(k[n - n_q :].transpose(0, 1)[None], v[n - n_q :].transpose(0, 1)[None])
        kp, vp = cache.gather(0, s)
        assert torch.equal(kp, kd[0]) and torch.equal(vp, vd[0])  # the same numbers stored
        want = mh.attention(q[i : i + 1], kd, vd, mask=mh.causal())
        assert torch.equal(paged[i : i + 1], want)  # the same call: the same bits
        gold = mh.attention(
            q[i : i + 1].double(), kd.double(), vd.double(), mask=mh.causal(), backend="reference"
        )
        base = mh.attention(q[i : i + 1], kd, vd, mask=mh.causal(), backend="matrix")
        assert max_err(batched[i : i + 1], gold) <= allowed(max_err(base, gold))


def test_fork_shares_every_block_and_copies_the_last_on_write():
    cache = PagedKVCache(2, HKV, D, 8, block_size=4, dtype=F64)
    data = fill(cache, {"p": 6}, layers=2)  # blocks [0, 1], the second half full
    cache.fork("p", "c")
    assert cache.block_table("c") == cache.block_table("p") and cache.num_free_blocks == 6
    assert cache.blocks_needed("c", 1) == 1  # its shared, partly filled block is copied first
    k, v = tokens(3, seed=5, dtype=F64)
    slots = cache.append_slots("c", 3)  # positions 6..8: copied block + one new block
    for layer in range(2):
        cache.write(layer, slots, k, v)
    assert cache.block_table("c")[0] == cache.block_table("p")[0]  # the full block stays shared
    assert cache.block_table("c")[1] != cache.block_table("p")[1]
    for layer in range(2):
        kp, _ = cache.gather(layer, "p")
        kc, vc = cache.gather(layer, "c")
        assert torch.equal(kp, data["p"][0].transpose(0, 1))  # the parent never sees the child's tokens
        assert torch.equal(kc, torch.cat((data["p"][0], k)).transpose(0, 1))
        assert torch.equal(vc, torch.cat((data["p"][1], v)).transpose(0, 1))
    # the parent's next write finds its block held by it alone: no copy
    assert cache.blocks_needed("p", 2) == 0
    cache.free("p")
    cache.free("c")
    assert cache.num_free_blocks == 8 and cache.sequences == []


def test_share_prefix_mid_block_and_memory_of_real_lengths():
    bs = 16
    lengths = [16 * (i + 1) * 4 for i in range(16)]  # 64 .. 1024
    lengths[0] = 17
    cache = PagedKVCache(1, HKV, D, 600, block_size=bs, dtype=F32)
    fill(cache, {f"s{i}": n for i, n in enumerate(lengths)}, chunk=64)
    used = sum(-(-n // bs) for n in lengths)
    assert cache.used_bytes == used * cache.block_bytes  # the sum of the real lengths, block-rounded
    assert cache.block_bytes == bs * HKV * 2 * D * 4
    # a 512-token prompt shared by 8 sequences is stored once
    cache.add_sequence("system")
    cache.append_slots("system", 512)
    before = cache.num_free_blocks
    for j in range(8):
        cache.share_prefix("system", f"user{j}", 512)
    assert cache.num_free_blocks == before
    # a prefix that ends inside a block: that block is copied on the first write, the source unchanged
    k, v = tokens(30, seed=3)
    cache.free("system")
    cache.add_sequence("src")
    cache.write(0, cache.append_slots("src", 30), k, v)
    cache.share_prefix("src", "dst", 20)
    k2, v2 = tokens(2, seed=4)
    cache.write(0, cache.append_slots("dst", 2), k2, v2)
    assert torch.equal(cache.gather(0, "src")[0], k.transpose(0, 1))
    assert torch.equal(cache.gather(0, "dst")[0], torch.cat((k[:20], k2)).transpose(0, 1))


def test_refusals_name_the_values():
    with pytest.raises(ValueError, match=r"kind must be one of \['dense', 'int8'\], got 'sliding'"):
        PagedKVCache(1, 1, 8, 4, kind="sliding")
    with pytest.raises(ValueError, match="num_blocks must be an int >= 1, got 0"):
        PagedKVCache(1, 1, 8, 0)
    cache = PagedKVCache(1, 1, 8, 2, block_size=4)
    cache.add_sequence(0)
    with pytest.raises(ValueError, match="already holds a sequence 0"):
        cache.add_sequence(0)
    with pytest.raises(ValueError, match="no sequence seq=7"):
        cache.length(7)
    with pytest.raises(OutOfBlocks, match="needs 3 blocks for 9 tokens, 2 are free"):
        cache.append_slots(0, 9)
    assert cache.length(0) == 0 and cache.num_free_blocks == 2  # nothing changed
    with pytest.raises(ValueError, match=r"n_tokens must be an int in \[0, 0\], got 5"):
        cache.share_prefix(0, 1, 5)
