"""The scripts in benchmarks/ time through the timing helper: driven here with fake clocks (zero, tiny,
huge durations) and stand-in models, so no real timing and no heavy model runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.clocks import FakeClock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


class FakeEncoder:
    """``encode`` costs ``per_call`` seconds of ``clock`` (and of ``cpu``) and returns unit vectors."""

    def __init__(self, clock: FakeClock, per_call: float, cpu: FakeClock | None = None):
        self.clock, self.per_call, self.cpu = clock, per_call, cpu

    def encode(self, texts, **kw):
        self.clock.true += self.per_call
        if self.cpu is not None:
            self.cpu.true += self.per_call
        return torch.nn.functional.normalize(torch.ones(len(texts), 4), dim=-1)  # (n, 4)

    def tokenize(self, texts):
        return [t.split() for t in texts]


@pytest.mark.parametrize(
    ("per_call", "tick", "ok"), [(0.0, 0.0, False), (1e-12, 1e-6, False), (0.05, 0.0, True), (1e6, 0.0, True)]
)
def test_encode_speed_rates_or_too_short(per_call, tick, ok):
    import encode_speed

    wall, cpu = FakeClock(0.0, per_read=0.0 if per_call < 1e-9 else 1e-9, tick=tick), FakeClock(0.0, tick=tick)
    cpu.per_read = wall.per_read
    st, ours = FakeEncoder(wall, per_call, cpu), FakeEncoder(wall, per_call / 2, cpu)
    r = encode_speed.bench(["a b", "c"], 3, 2, st, ours, ours, clock=wall, cpu_clock=cpu)
    if ok:  # ours takes half the time: twice the texts/s, a ratio clear of the noise, in wall and CPU time
        assert r["texts_per_s"]["sentence-transformers"] == pytest.approx(2 / per_call, rel=1e-3)
        assert r["ratio_vs_st"]["multihead padded"] == pytest.approx(2.0, rel=1e-3)
        assert r["cpu_ratio_vs_st"]["multihead padded"] == pytest.approx(2.0, rel=1e-3)
        assert not r["ratio_vs_st_within_noise"]["multihead padded"]
        assert r["ratio_vs_st_within_noise"]["sentence-transformers"]  # itself: never a gain
    else:
        assert set(r["texts_per_s"].values()) == {None} and set(r["ratio_vs_st"].values()) == {None}
        assert all(w.startswith("too short to measure") for w in r["why_no_rate"].values())
    assert encode_speed._ratio(None, False) == "too short to measure"
    assert encode_speed._ratio(1.01, True) == "same within noise"
