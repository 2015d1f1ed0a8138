"""Every head design learns a toy MQAR (mh.data.mqar) inside a 2-layer TransformerLM built with swap()."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import multihead as mh
from multihead import variants as V
from multihead.data import IGNORE_INDEX, mqar

SEQ, PAIRS, VOCAB, STEPS, BATCH = 32, 2, 64, 100, 16
CONTEXT_FREE = math.log(VOCAB // 2)  # the best loss without reading the context: uniform over the values


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls run several times faster on one thread than on two contended ones."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def train(name: str) -> list[float]:
    torch.manual_seed(0)
    lm = mh.TransformerLM(VOCAB, 32, 2, 4, 64, max_len=SEQ)
    torch.nn.init.normal_(lm.embed.weight, std=32**-0.5)  # rows of norm ~1, as multihead.train does
    model = V.swap(lm, name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        x, y = mqar(BATCH, SEQ, PAIRS, VOCAB, seed=step)
        asked = y != IGNORE_INDEX
        loss = F.cross_entropy(model(x)[asked], y[asked])
        opt.zero_grad(set_to_none=True)
        (loss + V.aux_loss(model)).backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["moh", "dcmha", "mohsa", "collab", "talking", "gated"])
def test_design_learns_mqar(name):
    losses = train(name)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert all(math.isfinite(v) for v in losses)
    assert last < first - 1.0, (first, last)
    assert last < CONTEXT_FREE - 0.25, (last, CONTEXT_FREE)  # it reads the pairs in its context
