"""The text LM's decode speed and ``multihead encode``'s texts/s time through the timing helper: each
driven with a fake clock (zero, tiny, huge durations) and stand-ins, so no real timing and no heavy model
runs."""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.clocks import FakeClock

ZERO_TINY_HUGE = pytest.mark.parametrize(
    ("per_call", "tick", "ok"),
    [(0.0, 0.0, False), (1e-12, 1e-6, False), (0.01, 0.0, True), (1e6, 0.0, True)],
    ids=["zero", "tiny", "10ms", "huge"],
)


def _clock(per_call: float, tick: float = 0.0) -> FakeClock:
    """A clock that moves only with the calls it times (and 1 ns a read where the calls take time)."""
    return FakeClock(per_call, per_read=0.0 if per_call < 1e-9 else 1e-9, tick=tick)


@ZERO_TINY_HUGE
def test_text_lm_decode_rate_or_too_short(per_call, tick, ok, monkeypatch):
    from multihead.study.sections import designs_text
    from multihead.train import text

    c = _clock(per_call, tick)
    monkeypatch.setattr(text, "generate", lambda *a, **kw: c.fn())
    t = text.decode_timing(None, torch.zeros(1, 4), 32, "dense", clock=c)  # type: ignore[arg-type]
    rate = t.rate(32)
    if ok:  # every generate of 32 tokens costs per_call
        assert rate == pytest.approx(32 / per_call, rel=1e-3) and t.samples >= 3
    else:
        assert rate is None and t.why.startswith("too short to measure")
    row = {"design": "mha", "bits_per_byte": 2.0, "decode_tok_s": rate, "decode_cached": True,
           "kv_bytes_per_token": 8, "first_token_share": None, "params": 10, "seconds": 1.0}  # fmt: skip
    cell = designs_text.text_table([row], text.TextConfig()).rows[0][2]
    assert cell == (f"{32 / per_call:,.0f}" if ok else "too short to measure")


class FakeEncoder:
    def __init__(self, clock: FakeClock):
        self.clock = clock

    def encode(self, texts, **kw):
        self.clock.fn()
        return torch.ones(len(texts), 4)  # (n, 4)


@ZERO_TINY_HUGE
def test_encode_command_rate_or_too_short(per_call, tick, ok):
    from multihead.cli import encode

    c = _clock(per_call, tick)
    args = argparse.Namespace(batch_size=32, packing=None)
    emb, took = encode._embed(args, FakeEncoder(c), ["a", "b"], clock=c)  # type: ignore[arg-type]
    assert emb.shape == (2, 4) and c.calls == 1  # the real work is never repeated
    fields, said = encode.speed(2, took)
    if ok:
        assert fields["docs_per_s"] == pytest.approx(2 / per_call, rel=1e-3)
        assert fields["seconds"] == pytest.approx(per_call, rel=1e-3) and "texts/s" in said
    else:
        assert fields == {"seconds": None, "docs_per_s": None}
        assert said == "; texts/s: too short to measure"
