"""The tiny MQAR trainer: a few steps on a toy size (the real recipe is a benchmark, BENCHMARKS.md)."""

from __future__ import annotations

import pytest
import torch

from multihead import approx as A
from multihead.train.trainer import TrainConfig, build_model, forward_flops, train_mqar

TOY = {
    "seq_len": 32,
    "n_pairs": 4,
    "vocab": 64,
    "d_model": 32,
    "n_heads": 2,
    "d_ff": 64,
    "batch": 16,
    "short_steps": 0,
}


def _mean(xs):
    return sum(xs) / len(xs)


def test_loss_decreases_and_runs_are_reproducible():
    cfg = TrainConfig(**TOY, steps=25, warmup=3, lr=1e-2, eval_examples=50)
    seen = []
    r = train_mqar(cfg, progress=lambda step, loss: seen.append(step))
    assert seen == list(range(25))
    assert _mean(r.losses[-5:]) < _mean(r.losses[:5]) - 0.2
    assert 0.0 <= r.accuracy <= 1.0 and r.causal and r.approx == "exact"
    short = TrainConfig(**TOY, steps=3, eval_examples=10)
    assert train_mqar(short).losses == train_mqar(short).losses


@pytest.mark.parametrize(("approx", "causal"), [(A.Performer(16), True), (A.Nystrom(4), False)])
def test_trains_with_an_approximation(approx, causal):
    r = train_mqar(TrainConfig(**TOY, steps=3, eval_examples=20), approx)
    assert r.causal is causal  # no causal form: trained bidirectionally
    assert r.approx.startswith(type(approx).__name__)
    assert all(torch.isfinite(torch.tensor(r.losses)))


def test_build_model_applies_the_approximation():
    model = build_model(TrainConfig(**TOY), A.TopK(4))
    assert sum(getattr(m, "approx", None) is not None for m in model.modules()) == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, r"TrainConfig steps must be an int >= 1, got 0"),
        ({"lr": 0.0}, r"TrainConfig lr must be > 0"),
        ({"warmup": -1}, r"TrainConfig warmup must be an int >= 0"),
        ({"embed_std": 0.0}, r"TrainConfig embed_std must be > 0 or None"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


@pytest.mark.parametrize("design", ["gqa", "moh", "talking"])
def test_trains_a_head_design_and_reports_params_and_flops(design):
    r = train_mqar(TrainConfig(**TOY, steps=3, eval_examples=20, attention=design))
    base = train_mqar(TrainConfig(**TOY, steps=1, eval_examples=20))
    assert r.approx == design and 0.0 <= r.accuracy <= 1.0
    assert r.extra["params"] > 0 and r.extra["flops"] > 0
    if design == "gqa":  # fewer K/V projection rows than MHA
        assert r.extra["params"] < base.extra["params"]


def test_forward_flops_count_attention_matmuls():
    cfg = TrainConfig(**TOY)
    model = build_model(cfg)
    ids = torch.zeros(1, cfg.seq_len, dtype=torch.long)
    flops = forward_flops(model, ids, None)
    d, n, L, ff = cfg.d_model, cfg.seq_len, cfg.n_layers, cfg.d_ff
    per_layer = 2 * n * d * (3 * d) + 2 * n * d * d + 2 * 2 * n * n * d + 3 * 2 * n * d * ff
    assert flops == L * per_layer  # projections, QK^T and PV (counted via matrix), SwiGLU; no head


def test_design_and_approximation_together_are_refused():
    with pytest.raises(ValueError, match="attention must be one of"):
        TrainConfig(**TOY, attention="nope")
    with pytest.raises(ValueError, match="not both"):
        build_model(TrainConfig(**TOY, attention="moh"), A.Performer(8))


def test_curriculum_trains_short_sequences_first():
    cfg = TrainConfig(seq_len=256, n_pairs=16, short_steps=10)
    assert cfg.size_at(0) == (64, 4) and cfg.size_at(9) == (64, 4) and cfg.size_at(10) == (256, 16)
    assert TrainConfig(seq_len=8, n_pairs=2, short_steps=1).size_at(0) == (4, 1)  # >= 4 * pairs
    r = train_mqar(TrainConfig(**{**TOY, "short_steps": 2}, steps=4, eval_examples=10))
    assert len(r.losses) == 4
    assert TrainConfig(steps=100).size_at(39) == (64, 4) and TrainConfig(steps=100).size_at(40) == (256, 16)
    with pytest.raises(ValueError, match="short_steps must be an int >= 0"):
        TrainConfig(short_steps=-1)
