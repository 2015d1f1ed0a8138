"""``multihead generate``'s speed, timed through the timing helper on a fake clock (no real timing)."""

from __future__ import annotations

import argparse
import functools
import json

import pytest
import torch

from multihead.bench import timing
from multihead.bench.timing import Timing
from multihead.cli import generate
from multihead.cli.main import main
from tests.clocks import FakeClock


class FakeLM:
    """``generate`` of n tokens costs ``per_token * n`` seconds of ``clock`` and returns zeros."""

    def __init__(self, clock: FakeClock, per_token: float):
        self.clock, self.per_token, self.calls = clock, per_token, 0

    def generate(self, ids: torch.Tensor, n: int, **kw) -> torch.Tensor:
        self.calls += 1
        self.clock.true += self.per_token * n
        return torch.cat([ids, torch.zeros(ids.shape[0], n, dtype=ids.dtype)], 1)  # (B, N + n)


def _args(new: int = 9) -> argparse.Namespace:
    return argparse.Namespace(
        cache="dense", sample=False, temperature=1.0, top_k=None, top_p=None, seed=0, max_new_tokens=new
    )


@pytest.mark.parametrize(
    ("per_token", "tick", "rate"),
    [(1e-3, 0.0, 1000.0), (1e3, 0.0, 1e-3), (0.0, 0.0, None), (1e-12, 1e-6, None)],
    ids=["1ms", "huge", "zero", "tiny"],
)
def test_decode_rate_is_measured_or_too_short(per_token, tick, rate):
    clock = FakeClock(0.0, per_read=0.0 if per_token < 1e-9 else 1e-9, tick=tick)
    lm = FakeLM(clock, per_token)
    ids = torch.ones(1, 4, dtype=torch.long)  # (1, 4)
    out, prefill, decode = generate._timed(lm, ids, _args(), clock=clock)
    assert out.shape == (1, 13)
    if rate is None:
        assert decode.rate(8) is None and "too short to measure" in decode.why
    else:  # 8 decode steps after the first token, each per_token seconds: never one run's accident
        assert decode.rate(8) == pytest.approx(rate, rel=1e-3) and prefill.median == pytest.approx(
            per_token, rel=1e-3
        )
        assert lm.calls >= 2 * 4  # warm-up and at least 3 samples of each of the two lengths
    assert lm.calls <= 2 * (1 + 4096 + 200)  # tiny calls are batched, but never without end


def test_generate_prints_too_short_instead_of_a_rate(monkeypatch, capsys):
    stopped = FakeClock(0.0, per_read=0.0)  # a clock that never moves: no rate can be read from it
    monkeypatch.setattr(generate, "_timed", functools.partial(generate._timed, clock=stopped))
    assert main(["generate", "--max-new-tokens", "3", "--prompt-len", "4"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" not in out and "too short to measure" in out
    assert main(["generate", "--json", "--max-new-tokens", "3", "--prompt-len", "4"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["decode_tokens_per_s"] is None and "too short to measure" in doc["decode_note"]
    assert doc["prefill_s"] is None and len(doc["tokens"][0]) == 3


def test_generate_refuses_a_rate_whose_spread_is_wider_than_ten_times():
    # the figure `multihead generate` printed: 22849.9 tokens/s (7691.4-4775843.6)
    t = Timing(31 / 22849.9, 31 / 4775843.6, 31 / 7691.4, 5, 1)
    fig = generate._decode_figure(t, 31, argparse.Namespace(max_new_tokens=32, batch=1))
    assert not fig.ok and fig.value is None
    text = fig.text(unit="tokens/s")
    assert text.startswith("n/a (") and "wider than 10x" in text and "--max-new-tokens 128" in text
    assert "22849" not in text


def test_generate_names_the_option_when_the_difference_is_inside_the_noise():
    four, one = Timing(4.0, 3.0, 5.0, 5, 1), Timing(1.0, 0.5, 3.5, 5, 1)
    fig = generate._decode_figure(
        timing.difference(four, one), 3, argparse.Namespace(max_new_tokens=4, batch=1)
    )
    assert "inside the noise" in fig.text() and "pass --max-new-tokens 64" in fig.text()


def test_generate_keeps_an_honest_rate_with_its_spread():
    t = Timing(0.031, 0.030, 0.032, 5, 1)  # 31 steps in 31 ms: 1000 tokens/s
    fig = generate._decode_figure(t, 31, argparse.Namespace(max_new_tokens=32, batch=2))
    assert fig.ok and fig.text(unit="tokens/s") == "2000.0 tokens/s (1937.5-2066.7)"


def test_one_new_token_names_the_option():
    fig = generate._decode_figure(
        Timing(None, None, None, 0, 0), 0, argparse.Namespace(max_new_tokens=1, batch=1)
    )
    assert fig.text() == "n/a (one token: no decode step; pass --max-new-tokens 2 or more)"


def test_the_suggested_tokens_fit_in_the_models_positions():
    noise = Timing(None, None, None, 0, 0, "too short to measure: inside the noise")
    fig = generate._decode_figure(noise, 99, argparse.Namespace(max_new_tokens=100, batch=1), room=240)
    assert "pass --max-new-tokens 240" in fig.text()
