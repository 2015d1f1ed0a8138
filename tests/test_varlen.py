"""mh.varlen_attention: packed sequences (cu_seqlens) against mh.attention of each sequence alone and the
float64 reference."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from tests.numerics import allowed, max_err


def packed(lengths: list[int], heads: int, d: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(lengths), heads, d, generator=g, dtype=dtype)


def cumulative(lengths: list[int]) -> list[int]:
    return [0, *torch.tensor(lengths).cumsum(0).tolist()]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_sequence_is_its_own_attention(causal, dtype):
    lq = [5, 1, 113, 0, 17]
    lk = [5, 40, 113, 3, 30]  # chunks of new queries against longer keys (a cache + the chunk)
    hq, hkv, d, dv = 6, 2, 59, 32
    q, k, v = packed(lq, hq, d, 0, dtype), packed(lk, hkv, d, 1, dtype), packed(lk, hkv, dv, 2, dtype)
    cq, ck = cumulative(lq), cumulative(lk)
    out = mh.varlen_attention(q, k, v, cq, torch.tensor(ck), causal=causal)
    assert out.shape == (sum(lq), hq, dv) and out.dtype == dtype
    mask = mh.causal() if causal else None
    for i in range(len(lq)):
        got = out[cq[i] : cq[i + 1]]
        if lq[i] == 0:
            continue
        qi = q[cq[i] : cq[i + 1]].transpose(0, 1).contiguous()[None]  # (1, Hq, n, D)
        ki = k[ck[i] : ck[i + 1]].transpose(0, 1).contiguous()[None]
        vi = v[ck[i] : ck[i + 1]].transpose(0, 1).contiguous()[None]
        alone = mh.attention(qi, ki, vi, mask=mask)[0].transpose(0, 1)
        assert torch.equal(got, alone)
        gold = mh.attention(qi.double(), ki.double(), vi.double(), mask=mask, backend="reference")
        base = mh.attention(qi, ki, vi, mask=mask, backend="matrix")
        assert max_err(got, gold[0].transpose(0, 1)) <= allowed(max_err(base, gold))


def test_a_sequence_without_keys_gives_zeros_and_none_sees_another():
    q, k, v = packed([2, 3], 2, 8, 0), packed([0, 4], 2, 8, 1), packed([0, 4], 2, 8, 2)
    out = mh.varlen_attention(q, k, v, [0, 2, 5], [0, 0, 4])
    assert torch.equal(out[:2], torch.zeros(2, 2, 8))
    k2 = k.clone()
    k2[:2] += 100.0  # moving sequence 1's keys changes sequence 1 only
    out2 = mh.varlen_attention(q, k2, v, [0, 2, 5], [0, 0, 4])
    assert torch.equal(out2[:2], out[:2]) and not torch.equal(out2[2:], out[2:])


def test_refusals_name_the_values_and_the_fix():
    q = packed([3], 2, 8, 0)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must start at 0.*got \[0, 2\]; build it as"):
        mh.varlen_attention(q, q, q, [0, 2], [0, 3])
    with pytest.raises(ValueError, match="cu_seqlens_q has 2 sequences but cu_seqlens_k has 1"):
        mh.varlen_attention(q, q, q, [0, 1, 3], [0, 3])
    with pytest.raises(
        ValueError, match=r"q must be a packed \(total, H, D\) tensor, got shape \(1, 3, 2, 8\)"
    ):
        mh.varlen_attention(q[None], q, q, [0, 3], [0, 3])
    with pytest.raises(ValueError, match="1-D integer tensor"):
        mh.varlen_attention(q, q, q, [0.0, 3.0], [0, 3])
