"""The analytic walk of eq. 9.31-9.43 against torch's own FLOP counter, plus bytes/intensity sanity.

The plain layer below is the post-LN layer of seed 000 written with bare torch ops (nn.Linear, matmul,
softmax, LayerNorm) - no multihead code - so ``FlopCounterMode`` counts what the equations cost.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from multihead import cost


class PlainLayer(nn.Module):
    """Eq. 9.31-9.43 with torch ops; GQA by repeating K/V (the FLOPs are the same as without)."""

    def __init__(self, d: int, h: int, hkv: int, d_ff: int):
        super().__init__()
        self.h, self.hkv, self.hd = h, hkv, d // h
        self.wq, self.wk, self.wv = nn.Linear(d, d), nn.Linear(d, hkv * self.hd), nn.Linear(d, hkv * self.hd)
        self.wo = nn.Linear(d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff1, self.ff2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def heads(self, t: torch.Tensor, n_heads: int) -> torch.Tensor:
        B, N, _ = t.shape
        return t.view(B, N, n_heads, self.hd).transpose(1, 2)  # (B, H, N, hd)

    def forward(self, x: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor) -> torch.Tensor:
        B, N, d = x.shape
        q = self.heads(self.wq(x), self.h)  # (B, Hq, N, hd)
        k = torch.cat([past_k, self.heads(self.wk(x), self.hkv)], dim=2)  # (B, Hkv, Nk, hd)
        v = torch.cat([past_v, self.heads(self.wv(x), self.hkv)], dim=2)  # (B, Hkv, Nk, hd)
        g = self.h // self.hkv
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, Hq, Nk, hd)
        nk = k.shape[2]
        s = q @ k.transpose(-1, -2) / math.sqrt(self.hd)  # (B, Hq, N, Nk)
        allowed = torch.ones(N, nk, dtype=torch.bool).tril(nk - N)  # bottom-right causal
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        a = (p @ v).transpose(1, 2).reshape(B, N, d)  # (B, N, d)
        t3 = self.ln1(x + self.wo(a))  # eq. 9.38-9.40
        return self.ln2(t3 + self.ff2(torch.relu(self.ff1(t3))))  # eq. 9.41-9.43


def _counted_flops(d, h, hkv, d_ff, batch, new, cached) -> int:
    layer = PlainLayer(d, h, hkv, d_ff)
    x = torch.randn(batch, new, d)
    past = torch.randn(batch, hkv, cached, d // h)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        layer(x, past, past)
    return counter.get_total_flops()


@pytest.mark.parametrize(
    "h, hkv, phase, cached",
    [
        (4, 4, "prefill", 0),
        (4, 2, "prefill", 0),
        (4, 1, "prefill", 7),
        (4, 4, "decode", 11),
        (8, 2, "decode", 30),
    ],
    ids=["mha-prefill", "gqa-prefill", "mqa-chunked-prefill", "mha-decode", "gqa-decode"],
)
def test_matmul_flops_match_flop_counter(h, hkv, phase, cached):
    d, d_ff, batch, seq = 64, 96, 2, 13
    ops = cost.layer_walk(d, h, hkv, d_ff, seq, batch, phase=phase, cached=cached)
    walk = sum(o.flops for o in ops if o.is_matmul)
    new = 1 if phase == "decode" else seq
    counted = _counted_flops(d, h, hkv, d_ff, batch, new, cached)
    assert counted > 0
    assert abs(walk - counted) <= 0.01 * counted, (walk, counted)


def test_gqa_narrows_kv_projections_not_scores():
    mha = {o.name: o for o in cost.layer_walk(n_heads=8, n_kv_heads=8)}
    gqa = {o.name: o for o in cost.layer_walk(n_heads=8, n_kv_heads=2)}
    assert gqa["K = X W^K"].flops * 4 == mha["K = X W^K"].flops
    assert gqa["V = X W^V"].flops * 4 == mha["V = X W^V"].flops
    assert gqa["Q = X W^Q"].flops == mha["Q = X W^Q"].flops
    assert gqa["S = Q K^T"].flops == mha["S = Q K^T"].flops  # scores for all 8 query heads
    assert gqa["S = Q K^T"].bytes < mha["S = Q K^T"].bytes  # but K is read once per kv head
    assert gqa["S = Q K^T"].out_shape == "1x8x1024x1024"


def test_walk_follows_the_equations():
    ops = cost.layer_walk()
    eqs = [o.eq for o in ops]
    for eq in ["9.31/9.33", "9.32", "9.35", "9.39", "9.40", "9.41", "9.42", "9.43"]:
        assert eq in eqs
    assert eqs.index("9.39") < eqs.index("9.40") < eqs.index("9.41") < eqs.index("9.42") < eqs.index("9.43")
    assert all(o.bytes > 0 for o in ops)
    assert ops[-1].out_shape == "1x1024x512"  # H has the shape of X


@pytest.mark.parametrize(
    "dtype, expected", [(torch.float16, 1.0), (torch.bfloat16, 1.0), (torch.float32, 0.5)]
)
def test_batch1_decode_projections_are_memory_bound(dtype, expected):
    ops = {o.name: o for o in cost.layer_walk(batch=1, dtype=dtype, phase="decode")}
    for name in ["Q = X W^Q", "K = X W^K", "V = X W^V", "T1 = concat W^O", "U = T3 W1 (FFN up)"]:
        assert ops[name].intensity == pytest.approx(expected, rel=0.02)  # 2 FLOPs per weight element


def test_batching_raises_projection_intensity_but_not_attention():
    def intensity(batch: int, name: str) -> float:
        ops = cost.layer_walk(batch=batch, dtype=torch.float16, phase="decode")
        return next(o.intensity for o in ops if o.name == name)

    assert intensity(64, "Q = X W^Q") > 30 * intensity(1, "Q = X W^Q")
    assert intensity(64, "S = Q K^T") == pytest.approx(intensity(1, "S = Q K^T"), rel=0.01)
    prefill = {o.name: o for o in cost.layer_walk(dtype=torch.float16)}
    assert prefill["Q = X W^Q"].intensity > 100


def test_decode_reads_the_cache():
    op = next(o for o in cost.layer_walk(phase="decode", cached=99, n_kv_heads=2) if o.name == "S = Q K^T")
    assert op.flops == 2 * 8 * 1 * 64 * 100
    assert "1x2x64x100" in op.in_shape
    default = next(o for o in cost.layer_walk(phase="decode", seq_len=1024) if o.name == "S = Q K^T")
    assert default.out_shape == "1x8x1x1024"  # cached defaults to seq_len - 1


def test_total_sums_rows():
    ops = cost.layer_walk()
    t = cost.total(ops)
    assert t.flops == sum(o.flops for o in ops) and t.bytes == sum(o.bytes for o in ops)
    assert not t.is_matmul
    assert cost.total([]).flops == 0 and cost.total([]).intensity == 0.0


def test_kv_cache_bytes_llama7b():
    nbytes = cost.kv_cache_bytes(32, 1, 4096, 32, 128, torch.float16)
    assert nbytes == 2 * 2**30  # the well-known 2 GiB of LLaMA-7B at 4K context
    rows = cost.compare_kv_heads(32, 1, 4096, 32, 128, torch.float16)
    assert [(r.name, r.n_kv_heads) for r in rows] == [("MHA", 32), ("GQA-8", 8), ("MQA", 1)]
    assert [r.mib for r in rows] == [2048.0, 512.0, 64.0]
    assert rows[2].vs_mha == pytest.approx(1 / 32)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_heads": 8, "n_kv_heads": 3}, r"n_heads \(8\) must be divisible by n_kv_heads \(3\)"),
        ({"d_model": 100, "n_heads": 8}, r"d_model \(100\) must be divisible by n_heads \(8\)"),
        ({"phase": "train"}, r"phase must be 'prefill' or 'decode', got 'train'"),
        ({"seq_len": 0}, r"seq_len must be an int >= 1, got 0"),
        ({"cached": -1}, r"cached must be >= 0"),
        ({"dtype": "float16"}, r"dtype must be a torch.dtype"),
    ],
)
def test_layer_walk_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cost.layer_walk(**kwargs)


def test_compare_kv_heads_rejects_non_divisor():
    with pytest.raises(ValueError, match=r"n_heads \(8\) must be divisible by n_kv_heads \(3\)"):
        cost.compare_kv_heads(1, 1, 16, 8, 64, kv_heads=(8, 3))
    with pytest.raises(ValueError, match="seq_len must be >= 0"):
        cost.kv_cache_bytes(1, 1, -5, 8, 64, torch.float16)
