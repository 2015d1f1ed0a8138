"""TransformerLM.generate beyond the basics of test_lm.py: left-padded batches, every cache kind,
per-row positions, eos, and argument validation. The model is small and float64, so "equal" is exact."""

from __future__ import annotations

import pytest
import torch

from multihead.models.lm import TransformerLM
from multihead.models.padding import left_pad
from tests.numerics import TOL, max_err

F64 = torch.float64
V = 53


def make_lm(seed=0, **kw) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, d_ff=48, n_kv_heads=2, max_len=96)
    return TransformerLM(**(cfg | kw)).double().eval()


def prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


def alone(lm: TransformerLM, prompt: list[int], n: int, **kw) -> list[int]:
    return lm.generate(torch.tensor([prompt]), n, **kw)[0].tolist()


# -- left-padded batches ---------------------------------------------------------------------------------
@pytest.mark.parametrize("positions", ["rotary", "learned"])
@pytest.mark.parametrize("cache", ["dense", "int8", None])
def test_left_padded_batch_generates_what_each_prompt_generates_alone(positions, cache):
    lm = make_lm(positions=positions)
    ps = prompts(9, 3, 6)
    ids, mask = left_pad(ps, pad_id=0)
    out = lm.generate(ids, 10, attention_mask=mask, cache=cache)
    assert out.shape == (3, 9 + 10)
    for r, p in enumerate(ps):
        assert out[r, 9 - len(p) :].tolist() == alone(lm, p, 10, cache=cache)


def test_left_padded_batch_with_a_sliding_window_and_sliding_cache():
    lm = make_lm(sliding_window=4)
    ps = prompts(8, 2)
    ids, mask = left_pad(ps)
    out = lm.generate(ids, 12, attention_mask=mask, cache="sliding")
    for r, p in enumerate(ps):
        assert out[r, 8 - len(p) :].tolist() == alone(lm, p, 12, cache="dense")


def test_padded_forward_logits_equal_unpadded_at_real_tokens():
    lm = make_lm(positions="learned")  # learned positions: wrong positions would change the logits
    (p,) = prompts(7)
    ids, mask = left_pad([p, [1] * 10])
    padded = lm(ids, attention_mask=mask)[0, 3:]  # (7, V)
    assert max_err(padded, lm(torch.tensor([p]))[0]) <= TOL[F64]


def test_hidden_states_project_to_the_logits():
    lm = make_lm()
    ids = torch.tensor(prompts(6))
    assert max_err(lm.lm_head(lm.hidden_states(ids)), lm(ids)) <= TOL[F64]


# -- caches and stopping ---------------------------------------------------------------------------------
def test_int8_cache_generation_stays_close_to_dense():
    lm = make_lm()
    ids = torch.tensor(prompts(12))
    dense = lm.generate(ids, 16)
    int8 = lm.generate(ids, 16, cache="int8")
    assert int8.shape == dense.shape
    # per-token int8 K/V moves logits by ~0.4% of their scale: the first tokens agree
    assert torch.equal(int8[:, :14], dense[:, :14])


def test_eos_finished_rows_are_padded_and_generation_stops():
    lm = make_lm()
    ps = prompts(5, 5)
    ids = torch.tensor(ps)
    free = lm.generate(ids, 8)
    eos = int(free[0, 5])  # row 0 emits it first
    out = lm.generate(ids, 8, eos_token_id=eos)
    assert (out[0, 5:] == eos).all()
    row1 = free[1, 5:].tolist()
    stop = row1.index(eos) + 1 if eos in row1 else 8
    assert out.shape[1] == 5 + stop and out[1, 5:].tolist() == row1[:stop] + [eos] * (out.shape[1] - 5 - stop)


def test_sampling_is_reproducible_and_respects_top_k():
    lm = make_lm()
    ids, mask = left_pad(prompts(4, 7))
    torch.manual_seed(0)
    a = lm.generate(ids, 6, do_sample=True, temperature=0.7, top_k=5, attention_mask=mask)
    torch.manual_seed(0)
    b = lm.generate(ids, 6, do_sample=True, temperature=0.7, top_k=5, attention_mask=mask)
    assert torch.equal(a, b)
    assert torch.equal(lm.generate(ids, 6, do_sample=True, top_k=1, attention_mask=mask),
                       lm.generate(ids, 6, attention_mask=mask))  # fmt: skip


# -- validation -----------------------------------------------------------------------------------------
def test_generate_rejects_bad_masks_and_caches():
    lm = make_lm()
    ids = torch.tensor(prompts(4, 4))
    right = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with pytest.raises(ValueError, match=r"attention_mask rows \[1\] are not left-padded"):
        lm.generate(ids, 2, attention_mask=right)
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(B, T\) = \(2, 4\)"):
        lm.generate(ids, 2, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="attention_mask must be bool or hold only 0 and 1"):
        lm.generate(ids, 2, attention_mask=torch.full((2, 4), 3))
    with pytest.raises(ValueError, match=r"KVCache kind must be one of \['dense', 'sliding', 'int8'\]"):
        lm.generate(ids, 2, cache="paged")
    with pytest.raises(ValueError, match="a 'sliding' cache needs a model built with sliding_window"):
        lm.generate(ids, 2, cache="sliding")
    with pytest.raises(ValueError, match=r"left_pad needs at least one prompt and no empty prompt"):
        left_pad([[1, 2], []])


def test_all_real_mask_is_the_same_as_no_mask():
    lm = make_lm()
    ids = torch.tensor(prompts(5, 5))
    assert torch.equal(lm.generate(ids, 6, attention_mask=torch.ones(2, 5)), lm.generate(ids, 6))
