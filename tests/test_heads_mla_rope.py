"""Rotary models -> MLA with partial RoPE (mh.heads.to_mla on LLaMA-style TransformerLMs): PartialRotary
against RotaryEmbedding, LatentAttention with one rotary key per kv head (absorbed = naive, cached decode),
exact when every rotary pair is kept at full rank (MHA, GQA, biases, interleaved pairs, from_hf LLaMA /
Mistral / Qwen2), the error falling with the rank, calibration helping, greedy decode, the cache size,
the pair choices, recovery, bad arguments."""

from __future__ import annotations

import itertools

import pytest
import torch

import multihead as mh
from multihead import heads
from multihead.nn.positions import PartialRotary
from multihead.variants import LatentAttention, LatentCache
from tests.numerics import TOL, max_err

from .test_heads_recover import _loss  # distillation loss of a student LM against its teacher

V = 97


def _lm(n_kv_heads=2, bias=True, seed=0, sharp=6.0) -> mh.TransformerLM:
    """A random rotary LM (d 64, 4 heads of 16) with non-zero biases and q/k weights scaled by ``sharp``
    so that attention is far from uniform and rotary matters."""
    torch.manual_seed(seed)
    lm = mh.TransformerLM(V, 64, 2, 4, 96, n_kv_heads=n_kv_heads, bias=bias).double().eval()
    Hkv = n_kv_heads or 4
    with torch.no_grad():
        for layer in lm.layers:
            attn = layer.self_attn
            attn.qkv_proj.weight[: (4 + Hkv) * 16].mul_(sharp)
            if bias:
                attn.qkv_proj.bias.normal_(0, 0.1)
                attn.o_proj.bias.normal_(0, 0.1)
    return lm


def _ids(n=4, N=24, seed=1) -> torch.Tensor:
    return torch.randint(0, V, (n, N), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _rel(model, ref, ids) -> float:
    return float((model(ids) - ref).norm() / ref.norm())


# -- PartialRotary ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_partial_rotary_with_every_pair_in_order_is_the_rotary_bit_for_bit(dtype):
    D, G = 16, 2
    rot = mh.RotaryEmbedding(D, base=500.0)
    part = PartialRotary(torch.arange(D // 2).expand(G, D // 2), D, 500.0)
    assert part.head_dim == D and part.groups == G
    x = torch.randn(3, 2 * G, 7, D, dtype=dtype)  # 4 heads in 2 groups
    for pos in (torch.arange(5, 12), torch.arange(21).reshape(3, 7)):
        assert torch.equal(part(x, pos), rot(x, pos))


def test_partial_rotary_rotates_each_group_by_its_own_frequencies():
    D = 16
    pairs = torch.tensor([[0, 5], [2, 7]])  # group 0 keeps pairs 0, 5; group 1 pairs 2, 7
    part = PartialRotary(pairs, D, 100.0)
    x = torch.randn(1, 4, 6, 4, dtype=torch.float64)  # heads 0, 1 -> group 0; 2, 3 -> group 1
    pos = torch.arange(6)
    full = mh.RotaryEmbedding(D, base=100.0)
    for h in range(4):
        g = h // 2
        wide = torch.zeros(1, 1, 6, D, dtype=torch.float64)  # the head's features at their full-rotary seats
        seats = torch.cat([pairs[g], pairs[g] + D // 2])
        wide[..., seats] = x[:, h : h + 1]
        assert max_err(part(x, pos)[:, h : h + 1], full(wide, pos)[..., seats]) <= TOL[torch.float64]
    assert part(x, pos).shape == x.shape
    part.double()
    assert part.pairs.dtype == torch.long  # indices survive a dtype cast


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: PartialRotary(torch.tensor([0.0, 1.0]), 8), r"non-empty \(G, P\) integer tensor"),
        (lambda: PartialRotary(torch.tensor([[0, 4]]), 8), r"values in \[0, 4\), got min 0 and max 4"),
        (lambda: PartialRotary(torch.tensor([[0]]), 7), r"head_dim must be a positive even int"),
        (
            lambda: PartialRotary(torch.tensor([[0]]), 8)(torch.randn(1, 1, 3, 4), torch.arange(3)),
            r"\(B, H, N, 2\)",
        ),
        (
            lambda: PartialRotary(torch.tensor([[0], [1]]), 8)(torch.randn(1, 3, 3, 2), torch.arange(3)),
            r"2 head groups; x has 3 heads",
        ),
    ],
)
def test_partial_rotary_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# -- LatentAttention with a rotary key per kv head -----------------------------------------------------
def _latent(rope_heads=2, absorb=None, nope_dims=6, seed=0) -> LatentAttention:
    torch.manual_seed(seed)
    pairs = torch.stack([torch.randperm(8)[:3] for _ in range(rope_heads)])  # (G, 3): R = 6 of D = 16
    m = LatentAttention(
        32, 4, kv_rank=10, rope_dims=6, nope_dims=nope_dims, v_head_dim=5, rope_heads=rope_heads,
        rotary=PartialRotary(pairs, 16), absorb=absorb, bias=True,
    ).double()  # fmt: skip
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m.eval()


@pytest.mark.parametrize("rope_heads, nope_dims", [(2, 6), (4, 6), (2, 0)])
def test_rope_heads_absorbed_equals_naive_and_cached_decode_equals_one_pass(rope_heads, nope_dims):
    naive, absorbed = _latent(rope_heads, False, nope_dims), _latent(rope_heads, True, nope_dims)
    assert naive.cache_numbers_per_token == 10 + rope_heads * 6
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    ref = naive(x, mask=mh.causal())
    assert max_err(absorbed(x, mask=mh.causal()), ref) <= TOL[torch.float64]
    for m in (naive, absorbed):
        cache = m.make_cache(2, 9)
        assert isinstance(cache, LatentCache) and cache.k.shape[-1] == 10 + rope_heads * 6
        steps = [m(x[:, :5], mask=mh.causal(), cache=cache)]
        steps += [m(x[:, i : i + 1], mask=mh.causal(), cache=cache) for i in range(5, 9)]
        assert max_err(torch.cat(steps, 1), ref) <= TOL[torch.float64]


def test_rope_heads_bad_arguments():
    with pytest.raises(ValueError, match=r"rope_heads=3 must divide n_heads=4.*choose one of \[1, 2, 4\]"):
        LatentAttention(32, 4, rope_dims=4, rope_theta=1e4, rope_heads=3)
    with pytest.raises(ValueError, match=r"be 1 without rope features"):
        LatentAttention(32, 4, rope_dims=0, rope_heads=2)
    with pytest.raises(ValueError, match=r"nope_dims must be an int >= 1, got 0"):
        LatentAttention(32, 4, rope_dims=0, nope_dims=0)
    m = _latent(2)
    with pytest.raises(ValueError, match=r"kv_rank \+ rope_heads x rope_dims = 10 \+ 12"):
        m(torch.randn(1, 2, 32, dtype=torch.float64), cache=LatentCache(1, 10, 6, 4, dtype=torch.float64))


# -- the conversion ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_kv_heads, bias", [(None, True), (2, True), (2, False), (1, True)])
@pytest.mark.parametrize("select", ["norm", "high", "uniform"])
def test_every_pair_kept_at_full_rank_is_exact(n_kv_heads, bias, select):
    lm, ids = _lm(n_kv_heads, bias), _ids()
    ref = lm(ids)
    attn = lm.layers[0].self_attn
    top = heads.max_kv_rank(attn, 16)
    assert top == min((n_kv_heads or 4) * (2 * 16 - 16), 64)
    full = heads.to_mla(lm, top, rope_dims=16, rope_select=select)
    new = full.layers[0].self_attn
    assert isinstance(new, LatentAttention) and new.rope_heads == (n_kv_heads or 4) and new.nope_dims == 0
    assert max_err(full(ids), ref) <= TOL[torch.float64]
    assert max_err(lm(ids), ref) == 0.0  # the original is untouched


def test_interleaved_rotary_pairs_are_kept_exactly():
    lm, ids = _lm(), _ids()
    rot = mh.RotaryEmbedding(16, interleaved=True)
    for layer in lm.layers:
        layer.self_attn.rotary = rot
    ref = lm(ids)
    assert max_err(heads.to_mla(lm, 32, rope_dims=16)(ids), ref) <= TOL[torch.float64]
    # a partial keep of the interleaved pairs keeps the same scores as keeping them half-split would
    # after the row permutation: compare against the half-split model of the same weights
    half = _lm()
    perm = torch.cat([mh.RotaryEmbedding.permute_for_half_split(torch.arange(64.0), 4),
                      64 + mh.RotaryEmbedding.permute_for_half_split(torch.arange(32.0), 2),
                      torch.arange(96.0, 128.0)]).long()  # fmt: skip
    with torch.no_grad():
        for a, b in zip(half.layers, lm.layers):
            a.self_attn.qkv_proj.weight.copy_(b.self_attn.qkv_proj.weight[perm])
            a.self_attn.qkv_proj.bias.copy_(b.self_attn.qkv_proj.bias[perm])
    assert max_err(half(ids), ref) <= TOL[torch.float64]
    for sel in ("norm", "high"):
        a, b = (
            heads.to_mla(lm, 12, rope_dims=4, rope_select=sel),
            heads.to_mla(half, 12, rope_dims=4, rope_select=sel),
        )
        assert max_err(a(ids), b(ids)) <= 1e-8


@pytest.mark.parametrize("rope_dims", [4, 8])
def test_error_falls_as_the_rank_grows(rope_dims):
    lm, ids = _lm(), _ids()
    ref = lm(ids)
    top = heads.max_kv_rank(lm.layers[0].self_attn, rope_dims)
    errs = [_rel(heads.to_mla(lm, r, rope_dims=rope_dims), ref, ids) for r in (2, 8, 16, 24, top)]
    assert all(a > b for a, b in itertools.pairwise(errs)), errs
    assert errs[-1] > 1e-3  # the rotation removed from the other pairs is not free even at full rank
    # keeping more rotary pairs at full rank costs less
    assert (
        _rel(heads.to_mla(lm, heads.max_kv_rank(lm.layers[0].self_attn, 12), rope_dims=12), ref, ids)
        < errs[-1]
    )


def test_calibrated_beats_uncalibrated_on_calibration_like_tokens():
    lm = _lm()
    cal, held_out = _ids(16, 32, seed=2), _ids(4, 24, seed=3)  # the same token distribution
    ref = lm(held_out)
    for r in (4, 8, 16):
        plain = _rel(heads.to_mla(lm, r, rope_dims=4), ref, held_out)
        tuned = _rel(heads.to_mla(lm, r, rope_dims=4, calibration=cal), ref, held_out)
        assert tuned < 0.9 * plain, (r, tuned, plain)


def test_greedy_decode_with_the_latent_cache_and_its_size():
    lm = _lm()
    ids = _ids(2, 6)
    full = heads.to_mla(lm, 32, rope_dims=16)
    assert torch.equal(full.generate(ids, 16), lm.generate(ids, 16))
    assert torch.equal(full.generate(ids, 16), full.generate(ids, 16, cache=None))  # cache = no cache
    padded, mask = mh.left_pad([ids[0, :3].tolist(), ids[1].tolist()], pad_id=0)
    assert torch.equal(
        full.generate(padded, 8, attention_mask=mask), lm.generate(padded, 8, attention_mask=mask)
    )
    small = heads.to_mla(lm, 12, rope_dims=4)
    out = small.generate(ids, 10)
    assert out.shape == (2, 16) and torch.equal(out, small.generate(ids, 10, cache=None))
    # bytes per token and layer: 2 Hkv D before, r + Hkv R after (float64)
    assert heads.kv_cache_bytes_per_token(lm) == 2 * (2 * 2 * 16) * 8
    assert heads.kv_cache_bytes_per_token(small) == 2 * (12 + 2 * 4) * 8
    cache = small.make_cache(1, 40)
    assert all(c.k.shape == (1, 1, 40, 12 + 2 * 4) for c in cache)
    assert sum(c.nbytes for c in cache) == 40 * heads.kv_cache_bytes_per_token(small)


def test_norm_selection_keeps_each_kv_heads_strongest_pairs():
    lm = _lm(sharp=1.0)
    attn = lm.layers[0].self_attn
    strong = {0: [1, 6], 1: [3, 4]}  # per kv head, the pairs whose q and k rows are made large
    with torch.no_grad():
        w = attn.qkv_proj.weight
        for g, ps in strong.items():
            for p in ps:
                for f in (p, p + 8):
                    w[64 + g * 16 + f] *= 20  # the kv head's key rows
                    for i in (2 * g, 2 * g + 1):
                        w[i * 16 + f] *= 20  # its query heads' rows
    for x in (None, torch.randn(50, 64, dtype=torch.float64)):
        pairs = heads.mla.select_rope_pairs(attn, 4, "norm", x)
        assert pairs.tolist() == [strong[0], strong[1]]
    assert heads.mla.select_rope_pairs(attn, 4, "high").tolist() == [[0, 1], [0, 1]]
    assert heads.mla.select_rope_pairs(attn, 4, "low").tolist() == [[6, 7], [6, 7]]
    assert heads.mla.select_rope_pairs(attn, 8, "uniform").tolist() == [[0, 2, 4, 6], [0, 2, 4, 6]]
    conv = heads.to_mla(lm, 8, rope_dims=4)
    assert conv.layers[0].self_attn.rotary.pairs.tolist() == [strong[0], strong[1]]


def test_recover_lowers_the_loss_of_a_converted_rotary_lm():
    teacher = _lm().float()
    ids = _ids(24, 16)
    student = heads.to_mla(teacher, 6, rope_dims=4)
    assert all(".self_attn." in f".{n}" for n in heads.changed_parameters(student, teacher))
    before = _loss(student, teacher, ids)
    heads.recover(student, teacher, ids, steps=20, lr=3e-3, batch_size=8, progress=False)
    assert _loss(student, teacher, ids) < 0.8 * before


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda lm: heads.to_mla(lm, 8, rope_dims=5), r"rope_dims must be even.*got 5; pass 4 or 6"),
        (lambda lm: heads.to_mla(lm, 8, rope_dims=18), r"rope_dims must be an int in \[2, 16\], got 18"),
        (lambda lm: heads.to_mla(lm, 8, rope_dims=0), r"rope_dims must be an int in \[2, 16\], got 0"),
        (lambda lm: heads.to_mla(lm, 8, rope_dims=True), r"rope_dims must be an int in \[2, 16\], got True"),
        (lambda lm: heads.to_mla(lm, 0, rope_dims=4), r"kv_rank must be an int in \[1, 56\].*got 0"),
        (
            lambda lm: heads.to_mla(lm, 57, rope_dims=4),
            r"min\(kv heads \* \(2 \* head dim - rope_dims\).*got 57",
        ),
        (lambda lm: heads.to_mla(lm, 8, rope_select="random"), r"rope_select must be one of \['norm'"),
        (lambda lm: heads.to_mla(torch.nn.Linear(3, 3), 8), r"Linear has no TransformerLayer"),
        (lambda lm: heads.to_mla(heads.to_mla(lm, 8), 8), r"to_mla works on plain MultiHeadAttention"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call(_lm())


def test_unsupported_rotary_and_sinks_raise():
    lm = _lm()
    lm.layers[1].self_attn.rotary = PartialRotary(torch.arange(8)[None], 16)
    with pytest.raises(ValueError, match=r"RotaryEmbedding over the whole head dim 16; this layer has"):
        heads.to_mla(lm, 8)
    lm = _lm()
    lm.layers[0].self_attn = mh.MultiHeadAttention(64, 4, 2, rotary=lm.layers[1].self_attn.rotary, sinks=True)
    with pytest.raises(ValueError, match=r"cannot convert attention with sinks"):
        heads.to_mla(lm.double(), 8)


# -- Hugging Face LLaMA family through from_hf -----------------------------------------------------------
def _hf_lm(name: str):
    tf = pytest.importorskip(
        "transformers", reason="from_hf needs the test extra: pip install -e '.[oracles]'"
    )
    common = dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )  # fmt: skip
    config = {
        "llama": lambda: tf.LlamaConfig(**common, attention_bias=True),
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=16),
        "qwen2": lambda: tf.Qwen2Config(**common, tie_word_embeddings=True),
    }[name]()
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "q_proj" in n or "k_proj" in n:
                p.mul_(6)
    return model.double(), mh.pretrained.from_hf(model).double().eval()


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_from_hf_llama_family_exact_limit_and_decode(name):
    hf, lm = _hf_lm(name)
    ids = _ids(2, 24)
    ref = lm(ids)
    full = heads.to_mla(lm, heads.max_kv_rank(lm.layers[0].self_attn, 16), rope_dims=16)
    assert max_err(full(ids), ref) <= TOL[torch.float64]
    with torch.no_grad():  # and against transformers itself (float64; its rotary frequencies stay float32)
        assert max_err(full(ids), hf(ids).logits) <= 1e-6
    assert torch.equal(full.generate(ids[:, :6], 24), lm.generate(ids[:, :6], 24))
    errs = [_rel(heads.to_mla(lm, r, rope_dims=4, calibration=ids), ref, ids) for r in (4, 16, 56)]
    assert errs[0] > errs[1] > errs[2]
