"""mh.variants: argument validation, build / swap / aux_loss, and the drop-in contract of every design."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead import variants as V

d, H = 32, 4


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: V.MixtureOfHeads(d, H, top_k=3),
            r"MixtureOfHeads top_k must be an int in \[1, 2\], got 3; top_k",
        ),
        (lambda: V.MixtureOfHeads(d, H, top_k=0), r"top_k must be an int in \[1, 2\], got 0"),
        (
            lambda: V.MixtureOfHeads(d, H, n_shared=4),
            r"n_shared must be an int in \[1, 3\], got 4; keep at least",
        ),
        (lambda: V.MixtureOfHeads(d, 1), r"MixtureOfHeads needs n_heads >= 2"),
        (
            lambda: V.MixtureOfHeads(d, H, 2, n_shared=1),
            r"n_shared \(1\) must be a multiple of the GQA group",
        ),
        (
            lambda: V.MixtureOfHeads(d, H, balance_weight=-1.0),
            r"balance_weight must be a number in \[0.0, inf\)",
        ),
        (
            lambda: V.MixtureOfHeads(d, H, skip="sometimes"),
            r"skip must be one of \['eval', 'always', 'never'\]",
        ),
        (
            lambda: V.OverlappingHeads(d, H, overlap=1.0),
            r"overlap must be a number in \[0.0, 1.0\), got 1.0; it is",
        ),
        (
            lambda: V.OverlappingHeads(d, H, overlap=-0.1),
            r"overlap must be a number in \[0.0, 1.0\), got -0.1",
        ),
        (lambda: V.OverlappingHeads(d, H, overlap=0.1), r"overlap=0.1 of head_dim=8 rounds to 0 features"),
        (
            lambda: V.DynamicComposition(d, H, rank=0),
            r"DynamicComposition rank must be an int in \[1, 4\], got 0",
        ),
        (lambda: V.DynamicComposition(d, H, rank=5), r"rank must be an int in \[1, 4\], got 5"),
        (
            lambda: V.DynamicComposition(d, H, hidden=0),
            r"DynamicComposition hidden must be an int >= 1, got 0",
        ),
        (
            lambda: V.CollaborativeHeads(d, H, d_shared=0),
            r"CollaborativeHeads d_shared must be an int >= 1, got 0",
        ),
        (
            lambda: V.CollaborativeHeads(d, H, d_shared=12, rotary=mh.RotaryEmbedding(8)),
            r"d_shared \(12\) must be a multiple of the rotary head_dim \(8\)",
        ),
        (
            lambda: V.GatedHeads(d, H, l0_weight=-1.0),
            r"GatedHeads l0_weight must be a number in \[0.0, inf\)",
        ),
        (lambda: V.GatedHeads(d, H, beta=0.0), r"GatedHeads beta must be a number in \(0, 1\]"),
        (lambda: V.GatedHeads(d, H, init_log_alpha=float("nan")), r"init_log_alpha must be a finite number"),
        (lambda: V.TalkingHeads(d, 3), r"TalkingHeads d_model \(32\) must be divisible by n_heads \(3\)"),
        (lambda: V.TalkingHeads(d, H, 3), r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"),
        (lambda: V.TalkingHeads(d, H, dropout=1.0), r"dropout must be a probability in \[0, 1\)"),
        (
            lambda: V.DynamicComposition(d, H, backend="nope"),
            r"unknown backend 'nope'; valid backends are: auto",
        ),
        (lambda: V.OverlappingHeads(0, H), r"OverlappingHeads d_model must be an int >= 1, got 0"),
        (lambda: V.build("flash", d, H), r"unknown attention design 'flash'; choose one of \['mha'"),
        (
            lambda: V.build("moh", d, H, topk=1),
            r"variants.build\('moh'\) got unknown arguments \['topk'\]; 'moh'",
        ),
        (lambda: V.build("mqa", d, H, n_kv_heads=2), r"got unknown arguments \['n_kv_heads'\]"),
        (lambda: V.swap(torch.nn.Linear(2, 2), "moh"), r"Linear contains no multihead.TransformerLayer"),
    ],
)
def test_bad_arguments_raise_value_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_collab_from_mha_bad_arguments():
    mha = mh.MultiHeadAttention(d, H)
    with pytest.raises(ValueError, match=r"from_mha d_shared must be an int in \[1, 32\], got 33; 32"):
        V.CollaborativeHeads.from_mha(mha, 33)
    with pytest.raises(ValueError, match=r"from_mha iters must be an int >= 1, got 0"):
        V.CollaborativeHeads.from_mha(mha, 8, iters=0)
    with pytest.raises(ValueError, match=r"from_mha d_shared=8 < 32 with rotary"):
        V.CollaborativeHeads.from_mha(mh.MultiHeadAttention(d, H, rotary=mh.RotaryEmbedding(8)), 8)
    with pytest.raises(ValueError, match=r"from_mha needs n_heads \* head_dim == d_model, got 4 \* 4 != 32"):
        V.CollaborativeHeads.from_mha(mh.MultiHeadAttention(d, H, head_dim=4))


@pytest.mark.parametrize(
    ("name", "match"), [("dcmha", "key-wise composition needs every key"), ("collab", "shared key")]
)
def test_designs_that_cannot_cache_say_why(name, match):
    m = V.build(name, d, H)
    cache = mh.KVCache(1, H, d // H, 8)
    with pytest.raises(ValueError, match=match):
        m(torch.randn(1, 3, d), cache=cache)


@pytest.mark.parametrize("name", V.NAMES)
def test_every_design_checks_the_shared_forward_contract(name):
    m = V.build(name, d, H)
    x = torch.randn(2, 5, d)
    with pytest.raises(ValueError, match=r"x has width 31"):
        m(torch.randn(2, 5, 31))
    with pytest.raises(ValueError, match=r"head_mask must be a float tensor of shape \(Hq,\) = \(4,\)"):
        m(x, head_mask=torch.ones(3))
    with pytest.raises(ValueError, match=r"positions are only used by rotary self-attention"):
        m(x, positions=torch.arange(5))
    with pytest.raises(ValueError, match=r"context batch 1 differs from x batch 2"):
        m(x, torch.randn(1, 3, d))
    assert m(x, mask=mh.causal()).shape == (2, 5, d)


def test_build_sets_kv_heads_by_name():
    assert V.build("mha", d, H).n_kv_heads == H
    assert V.build("gqa", d, H).n_kv_heads == 2
    assert V.build("gqa", 36, 6).n_kv_heads == 3
    assert V.build("gqa", 45, 9).n_kv_heads == 3  # largest divisor of 9 below 9 // 2
    assert V.build("gqa", d, H, n_kv_heads=1).n_kv_heads == 1
    assert V.build("mqa", d, H).n_kv_heads == 1
    assert isinstance(V.build("gated", d, H), mh.MultiHeadAttention)


@pytest.mark.parametrize("name", V.NAMES)
def test_swap_copies_the_model_and_keeps_the_settings(name):
    lm = mh.TransformerLM(50, d, 2, H, 2 * d, n_kv_heads=2, dropout=0.1).double()
    out = V.swap(lm, name)
    assert all(type(layer.self_attn) is mh.MultiHeadAttention for layer in lm.layers)  # original untouched
    rot = lm.layers[0].self_attn.rotary
    for layer in out.layers:
        a = layer.self_attn
        assert type(a) is V._CLASSES[name]
        assert (a.d_model, a.n_heads, a.dropout, a.backend) == (d, H, 0.1, "auto")
        assert a.rotary is out.layers[0].self_attn.rotary and a.rotary is not rot  # shared within the copy
        assert a.o_proj.bias is None and a.o_proj.weight.dtype == torch.float64
    assert out.n_kv_heads == {"mha": H, "gqa": 2, "mqa": 1}.get(name, out.layers[0].self_attn.n_kv_heads)
    ids = torch.randint(0, 50, (2, 6))
    assert out(ids).shape == (2, 6, 50)
    if name not in ("dcmha", "collab"):  # the KV cache of generate() follows the swapped design
        plain = out.generate(ids, 3, cache=None)
        assert torch.equal(out.generate(ids, 3), plain)


def test_swap_passes_design_arguments_and_init():
    lm = mh.TransformerLM(50, d, 2, H, 2 * d)
    seen = []
    out = V.swap(lm, "moh", top_k=2, n_shared=2, init=lambda m: seen.append(type(m).__name__))
    assert all(layer.self_attn.top_k == 2 for layer in out.layers)
    assert seen.count("MixtureOfHeads") == 2


def test_tools_for_the_textbook_layer_keep_refusing_designs_that_change_its_steps():
    lm = mh.TransformerLM(50, d, 2, H, 2 * d)
    with pytest.raises(ValueError, match=r"contains no multihead\.MultiHeadAttention to approximate"):
        mh.approx.apply(V.swap(lm, "talking"), mh.approx.TopK(2))
    with pytest.raises(ValueError, match=r"the cost model walks exact multihead\.MultiHeadAttention"):
        mh.cost.estimate(V.swap(lm, "moh"), 1, 8)
    gated = mh.approx.apply(V.swap(lm, "gated"), mh.approx.TopK(2))  # gates only scale the heads
    assert all(layer.self_attn.approx is not None for layer in gated.layers)


class _OutputGate(mh.MultiHeadAttention):
    """A design written against the template: a sigmoid gate from x on every head before W^O."""

    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        self.gate = torch.nn.Linear(d_model, n_heads)

    def mix_heads(self, a, x, head_mask):
        g = torch.sigmoid(self.gate(x)).transpose(1, 2).unsqueeze(-1)  # (B, Hq, N, 1)
        return super().mix_heads(a * g, x, head_mask)


def test_a_design_overrides_one_step_and_keeps_the_rest_of_the_layer():
    m = _OutputGate(d, H).double().eval()
    mha = mh.MultiHeadAttention(d, H).double().eval()
    mha.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("gate")})
    x = torch.randn(2, 5, d, dtype=torch.float64)
    with torch.no_grad():
        m.gate.weight.zero_()
        m.gate.bias.fill_(100.0)  # gates open: the textbook layer
    assert torch.allclose(m(x, mask=mh.causal()), mha(x, mask=mh.causal()))
    with torch.no_grad():
        m.gate.bias[1] = -100.0  # head 1 closed: as pruning it with head_mask
    hm = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    assert torch.allclose(m(x, mask=mh.causal()), mha(x, mask=mh.causal(), head_mask=hm))
    with pytest.raises(ValueError, match=r"head_mask must be a float tensor of shape \(Hq,\)"):
        m(x, head_mask=torch.ones(3))
