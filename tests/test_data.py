"""The MQAR generator: layout, vocabularies, answers and the power law of the query gaps."""

from __future__ import annotations

import pytest
import torch

from multihead.data import IGNORE_INDEX, mqar


@pytest.fixture(scope="module")
def batch():
    return mqar(400, 64, 8, vocab=512, seed=3)


def test_shapes_dtypes_and_determinism(batch):
    x, y = batch
    assert x.shape == y.shape == (400, 64) and x.dtype == y.dtype == torch.long
    x2, y2 = mqar(400, 64, 8, vocab=512, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, mqar(400, 64, 8, vocab=512, seed=4)[0])


def test_keys_and_values_come_from_disjoint_vocabularies(batch):
    x, _ = batch
    keys, values = x[:, 0:16:2], x[:, 1:16:2]
    assert int(keys.min()) >= 1 and int(keys.max()) < 256
    assert int(values.min()) >= 256 and int(values.max()) < 512
    for row in (keys, values):  # each example draws its keys (values) without replacement
        assert all(len(set(r.tolist())) == 8 for r in row)


def test_labels_only_at_query_positions_and_each_answer_is_the_paired_value(batch):
    x, y = batch
    asked = y != IGNORE_INDEX
    assert bool((asked.sum(1) == 8).all())
    assert not bool(asked[:, :16].any())  # nothing is asked inside the key-value pairs
    pos = asked.nonzero()
    assert bool(((pos[:, 1] - 16) % 2 == 0).all())  # queries on even offsets of the query region
    for i, p in pos.tolist():
        key = int(x[i, p])
        pairs = x[i, :16].view(8, 2)
        j = (pairs[:, 0] == key).nonzero()
        assert len(j) == 1 and int(pairs[j[0, 0], 1]) == int(y[i, p])


def test_every_key_is_queried_exactly_once(batch):
    x, y = batch
    for i in range(20):
        asked = x[i][y[i] != IGNORE_INDEX]
        assert sorted(asked.tolist()) == sorted(x[i, 0:16:2].tolist())


def test_query_gaps_follow_the_power_law():
    """With one pair the gap is one draw of P(g) ~ g^(a - 1); more pairs draw without replacement."""
    _, y = mqar(20000, 256, 1, vocab=1024, power_a=0.01, seed=0)
    gaps = ((y != IGNORE_INDEX).nonzero()[:, 1] - 2) // 2  # slot index in the query region
    freq = torch.bincount(gaps, minlength=127).double() / 20000
    law = torch.arange(1, 128, dtype=torch.float64) ** (0.01 - 1)
    law /= law.sum()
    assert float((freq[:8] - law[:8]).abs().max()) < 0.01
    _, y4 = mqar(2000, 256, 4, vocab=1024, power_a=0.01, seed=0)
    hist = torch.bincount(((y4 != IGNORE_INDEX).nonzero()[:, 1] - 8) // 2, minlength=124).double()
    assert hist[0] > hist[1] > hist[3] > hist[20:].mean()  # short distances dominate
    flat = ((mqar(2000, 256, 4, vocab=1024, power_a=1.0, seed=0)[1] != IGNORE_INDEX).nonzero()[:, 1] - 8) // 2
    assert float(torch.bincount(flat, minlength=124).double().std()) < float(hist.std()) / 5  # a=1: uniform


def test_without_random_fill_the_filler_is_zero():
    x, y = mqar(5, 32, 4, vocab=64, random_fill=False)
    filler = torch.ones_like(x, dtype=torch.bool)
    filler[:, :8] = False
    filler &= y == IGNORE_INDEX
    assert bool((x[filler] == 0).all())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0}, r"mqar n must be an int >= 1, got 0"),
        ({"seq_len": 63}, r"seq_len must be even"),
        ({"n_pairs": 17}, r"seq_len >= 4 \* n_pairs .* got seq_len=64, n_pairs=17; use n_pairs <= 16"),
        ({"vocab": 10}, r"vocab=10 leaves 4 keys for n_pairs=8; use vocab >= 18"),
        ({"power_a": 0.0}, r"power_a must be in \(0, 1\]"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"n": 2, "seq_len": 64, "n_pairs": 8, "vocab": 512, **kwargs}
    with pytest.raises(ValueError, match=match):
        mqar(**args)
