"""Unpadded (varlen) inference: the token-wise work on real tokens only equals the padded layer."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.nn.unpadded import Varlen, why_not_unpadded
from multihead.pretrained.bert import Bert

F64 = torch.float64
EXACT = 1e-12  # float64: the same sums in another grouping

CONFIG = {
    "vocab_size": 50,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 48,
    "max_position_embeddings": 24,
    "type_vocab_size": 2,
    "hidden_act": "gelu",
}


def _bert(**overrides) -> Bert:
    torch.manual_seed(0)
    model = Bert({**CONFIG, **overrides}).to(F64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    N = int(lengths.max())
    ids = torch.randint(0, CONFIG["vocab_size"], (len(lengths), N), generator=g)  # (B, N)
    real = torch.arange(N)[None] < lengths[:, None]  # (B, N)
    return ids, real, lengths


def test_varlen_layout():
    v = Varlen.from_lengths(torch.tensor([3, 1, 2]))
    assert v.batch.tolist() == [0, 0, 0, 1, 2, 2]
    assert v.position.tolist() == [0, 1, 2, 0, 0, 1]
    assert v.real.tolist() == [[True] * 3, [True, False, False], [True, True, False]]
    for bad in (
        torch.tensor([3, 0]),
        torch.tensor([[3]]),
        torch.tensor([2.0]),
        torch.tensor([], dtype=torch.long),
    ):
        with pytest.raises(ValueError, match="lengths must be a non-empty 1-d integer tensor of values >= 1"):
            Varlen.from_lengths(bad)


@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_new"])
@pytest.mark.parametrize("lengths", [[7, 7, 7], [11, 5, 1, 8], [1]], ids=["equal", "ragged", "one"])
def test_unpadded_equals_the_padded_forward_at_real_tokens(lengths, act):
    model = _bert(hidden_act=act)
    ids, real, lens = _batch(lengths)
    with torch.inference_mode():
        padded = model(ids, attention_mask=real)  # (B, N, d)
        got = model.forward_unpadded(ids[real], lens)  # (T, d)
    assert got.shape == (int(lens.sum()), CONFIG["hidden_size"])
    assert (got - padded[real]).abs().max() <= EXACT


@pytest.mark.parametrize("per_row", [False, True])
def test_unpadded_head_mask_equals_the_padded_one(per_row):
    model = _bert()
    ids, real, lens = _batch([9, 4, 6], seed=1)
    g = torch.Generator().manual_seed(2)
    shape = (2, 3, 4) if per_row else (2, 4)
    head_mask = (torch.rand(shape, generator=g) > 0.4).to(F64)
    with torch.inference_mode():
        padded = model(ids, attention_mask=real, head_mask=head_mask)
        got = model.forward_unpadded(ids[real], lens, head_mask=head_mask)
        assert (got - padded[real]).abs().max() <= EXACT
        with pytest.raises(ValueError, match=r"head_mask must be a float tensor of shape \(Hq,\) = \(4,\)"):
            model.forward_unpadded(ids[real], lens, head_mask=torch.ones(2, 5, dtype=F64))


def test_unpadded_refuses_what_it_cannot_compute():
    model = _bert()
    ids, real, lens = _batch([5, 3])
    assert model.why_not_unpadded() is None
    with pytest.raises(ValueError, match="lengths sum to 8 but ids has 7 tokens"):
        model.forward_unpadded(ids[real][:7], lens)
    with pytest.raises(ValueError, match=r"ids must be a 1-d integer tensor \(T,\)"):
        model.forward_unpadded(ids, lens)
    with pytest.raises(ValueError, match="a sequence of 30 tokens exceeds max_position_embeddings=24"):
        model.forward_unpadded(torch.zeros(30, dtype=torch.long), torch.tensor([30]))
    model.train()
    assert model.why_not_unpadded() == "the model is in training mode (dropout)"
    with pytest.raises(ValueError, match=r"forward_unpadded cannot run this model: the model is in training"):
        model.forward_unpadded(ids[real], lens)
    pre_ln = mh.TransformerLayer(32, 4, 48, norm_first=True).eval()
    assert why_not_unpadded(pre_ln) == "only post-LN layers without cross-attention are unpadded"
    swiglu = mh.TransformerLayer(32, 4, 48, activation="swiglu").eval()
    assert "not a plain FeedForward" in str(why_not_unpadded(swiglu))
