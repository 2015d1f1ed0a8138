"""TransformerLM: causality, padding, KV-cache parity for every cache kind, greedy generate, sampling."""

from __future__ import annotations

import pytest
import torch

from multihead.models.lm import TransformerLM
from tests.numerics import TOL, max_err

F64 = torch.float64
V = 61


def make_lm(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_len=64)
    return TransformerLM(**(cfg | kw)).double().eval()


def ids_of(B, N, seed=1):
    return torch.randint(0, V, (B, N), generator=torch.Generator().manual_seed(seed))


def cached_logits(lm, ids, kind, first, attention_mask=None):
    """Prefill ``first`` tokens, then one token per call through a fresh cache; logits (B, N, V)."""
    cache = lm.make_cache(ids.shape[0], ids.shape[1], kind=kind)
    am = (lambda t: None) if attention_mask is None else (lambda t: attention_mask[:, :t])
    with torch.no_grad():
        parts = [lm(ids[:, :first], cache=cache, attention_mask=am(first))]
        for t in range(first, ids.shape[1]):
            parts.append(lm(ids[:, t : t + 1], cache=cache, attention_mask=am(t + 1)))
    assert cache[0].position == ids.shape[1]
    return torch.cat(parts, dim=1)


# -- forward --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("positions", ["rotary", "learned", "sinusoidal", "none"])
def test_forward_is_causal(positions):
    lm = make_lm(positions=positions)
    ids = ids_of(2, 10)
    logits = lm(ids)
    assert logits.shape == (2, 10, V) and logits.dtype == F64
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % V
    other = lm(changed)
    assert max_err(logits[:, :6], other[:, :6]) <= TOL[F64]
    assert max_err(logits[:, 6:], other[:, 6:]) > 1e-6


def test_tied_and_untied_embeddings():
    lm = make_lm()
    assert lm.lm_head.weight is lm.embed.weight
    untied = make_lm(tie_embeddings=False)
    assert untied.lm_head.weight is not untied.embed.weight


def test_gpt2_style_post_ln_learned_gelu_model_runs():
    lm = make_lm(positions="learned", norm="layernorm", norm_first=False, activation="gelu", bias=True)
    assert isinstance(lm.final_norm, torch.nn.Identity)
    assert lm(ids_of(1, 5)).shape == (1, 5, V)


def test_left_padding_with_rotary_equals_the_unpadded_sequence():
    # rotary scores depend only on relative positions, so masking the pad keys recovers the short row
    lm = make_lm()
    ids = ids_of(2, 9)
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, :3] = 0  # row 1: 3 pad tokens on the left
    padded = lm(ids, attention_mask=am)
    assert max_err(padded[1, 3:], lm(ids[1:, 3:])[0]) <= 1e-9
    assert max_err(padded[0], lm(ids[:1])[0]) <= TOL[F64]
    assert torch.equal(lm(ids, attention_mask=am.bool()), padded)


# -- KV cache ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "positions,n_kv_heads",
    [("rotary", None), ("rotary", 2), ("rotary", 1), ("learned", 2), ("sinusoidal", None)],
)
def test_dense_cache_equals_full_forward(positions, n_kv_heads):
    lm = make_lm(positions=positions, n_kv_heads=n_kv_heads)
    ids = ids_of(2, 12)
    assert max_err(cached_logits(lm, ids, "dense", 5), lm(ids)) <= TOL[F64]


def test_sliding_cache_equals_full_forward_with_sliding_window():
    lm = make_lm(n_kv_heads=2, sliding_window=4)
    ids = ids_of(2, 15)
    full = lm(ids)
    assert max_err(cached_logits(lm, ids, "sliding", 6), full) <= TOL[F64]
    assert max_err(full, make_lm(n_kv_heads=2)(ids)) > 1e-6  # the window does change the result


def test_int8_cache_is_close_to_full_forward():
    lm = make_lm(n_kv_heads=2)
    ids = ids_of(2, 12)
    full = lm(ids)
    err = max_err(cached_logits(lm, ids, "int8", 5), full)
    # Per-token int8 K/V is off by <= absmax / 254 per entry (0.4%); through two layers and the residual
    # stream that stays well under 2% of the logit scale, while a wrong cache is off by O(100%).
    assert 0 < err <= 0.02 * full.abs().max().item()


def test_cache_with_attention_mask_covering_past_tokens():
    lm = make_lm(n_kv_heads=2)
    ids = ids_of(2, 10)
    am = torch.ones(2, 10, dtype=torch.bool)
    am[0, :2] = False
    assert (
        max_err(cached_logits(lm, ids, "dense", 4, attention_mask=am), lm(ids, attention_mask=am)) <= TOL[F64]
    )


# -- generate ----------------------------------------------------------------------------------------
def greedy_by_full_forwards(lm, ids, n):
    for _ in range(n):
        ids = torch.cat([ids, lm(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("n_kv_heads,positions", [(None, "rotary"), (2, "rotary"), (1, "learned")])
def test_greedy_generate_equals_argmax_of_repeated_full_forwards(n_kv_heads, positions):
    lm = make_lm(n_kv_heads=n_kv_heads, positions=positions)
    prompt = ids_of(2, 5)
    with torch.no_grad():
        expected = greedy_by_full_forwards(lm, prompt, 8)
    got = lm.generate(prompt, 8)
    assert got.shape == (2, 13)
    assert torch.equal(got, expected)
    assert torch.equal(lm.generate(prompt, 8, cache=None), expected)


def test_greedy_generate_with_sliding_cache_matches_full_forwards():
    lm = make_lm(sliding_window=3)
    prompt = ids_of(1, 4)
    with torch.no_grad():
        expected = greedy_by_full_forwards(lm, prompt, 7)
    assert torch.equal(lm.generate(prompt, 7, cache="sliding"), expected)


def test_generate_stops_at_eos_and_pads_finished_rows():
    lm = make_lm()
    prompt = ids_of(1, 4)
    first = lm.generate(prompt, 1)[0, -1].item()
    out = lm.generate(prompt, 6, eos_token_id=first)
    assert out.shape == (1, 5) and out[0, -1].item() == first  # stopped after the eos
    two = torch.cat([prompt, ids_of(1, 4, seed=9)])
    out2 = lm.generate(two, 6, eos_token_id=first)
    assert (out2[0, 4:] == first).all()  # row 0 finished at once and is padded with eos
    free = lm.generate(two[1:], 6)[0, : out2.shape[1]]
    assert torch.equal(out2[1], free)  # row 1 is unaffected until it stops
    assert lm.generate(prompt, 0).shape == (1, 4)


def test_sampling():
    lm = make_lm()
    prompt = ids_of(2, 4)
    greedy = lm.generate(prompt, 5)
    assert torch.equal(lm.generate(prompt, 5, do_sample=True, top_k=1), greedy)
    assert torch.equal(lm.generate(prompt, 5, do_sample=True, top_p=1e-9), greedy)
    torch.manual_seed(3)
    a = lm.generate(prompt, 6, do_sample=True, temperature=5.0, top_k=10, top_p=0.9)
    torch.manual_seed(3)
    b = lm.generate(prompt, 6, do_sample=True, temperature=5.0, top_k=10, top_p=0.9)
    assert torch.equal(a, b) and a.shape == (2, 10)
    torch.manual_seed(4)
    samples = torch.stack([lm.generate(prompt[:1], 1, do_sample=True, top_k=3)[0, -1] for _ in range(30)])
    allowed = set(lm(prompt[:1])[0, -1].topk(3).indices.tolist())
    assert set(samples.tolist()) <= allowed


def test_generate_runs_in_eval_mode_and_restores_training():
    lm = make_lm(dropout=0.3)
    lm.train()
    prompt = ids_of(1, 4)
    assert torch.equal(lm.generate(prompt, 4), lm.generate(prompt, 4))
    assert lm.training


def test_dropout_is_stochastic_in_training_and_off_in_eval():
    lm = make_lm(dropout=0.3)
    ids = ids_of(2, 6)
    lm.train()
    assert not torch.equal(lm(ids), lm(ids))
    lm.eval()
    assert torch.equal(lm(ids), lm(ids))


# -- validation ----------------------------------------------------------------------------------------
def test_bad_arguments_raise():
    with pytest.raises(
        ValueError, match=r"positions must be one of \['rotary', 'learned', 'sinusoidal', 'none'\]"
    ):
        make_lm(positions="alibi")
    with pytest.raises(ValueError, match=r"d_model \(32\) must be divisible by n_heads \(5\)"):
        make_lm(n_heads=5)
    with pytest.raises(ValueError, match=r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"):
        make_lm(n_kv_heads=3)
    with pytest.raises(ValueError, match="norm must be one of"):
        make_lm(norm="scalenorm")
    with pytest.raises(ValueError, match="activation must be one of"):
        make_lm(activation="geglu")
    lm = make_lm(positions="learned")
    with pytest.raises(ValueError, match=r"ids must hold integer token ids, got dtype torch.float32"):
        lm(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"ids must have shape \(B, N\), got \(3,\); add a batch dim"):
        lm(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, vocab_size=61\), got min 0 and max 61"):
        lm(torch.tensor([[0, 61]]))
    with pytest.raises(ValueError, match=r"positions up to 65 exceed max_len=64"):
        lm(ids_of(1, 65))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(B, T\) = \(1, 4\)"):
        lm(ids_of(1, 4), attention_mask=torch.ones(1, 5))
    with pytest.raises(ValueError, match="attention_mask must be bool or hold only 0 and 1"):
        lm(ids_of(1, 4), attention_mask=torch.full((1, 4), 2))
    with pytest.raises(ValueError, match="a 'sliding' cache needs a model built with sliding_window"):
        lm.make_cache(1, 8, kind="sliding")
    with pytest.raises(ValueError, match="cache has 1 entries but the model has 2 layers"):
        lm(ids_of(1, 4), cache=lm.make_cache(1, 8)[:1])
    with pytest.raises(ValueError, match="only apply when sampling; pass do_sample=True"):
        lm.generate(ids_of(1, 4), 2, top_k=5)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        lm.generate(ids_of(1, 4), 2, do_sample=True, temperature=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        lm.generate(ids_of(1, 4), 2, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got -1"):
        lm.generate(ids_of(1, 4), -1)
