"""``multihead bench hf``'s rounds and ratios on made-up worker answers (no process, no real timing)."""

from __future__ import annotations

import pytest

from multihead.bench import hf


class FakeWorker:
    """Answers every decode request with the next of ``seconds`` (None: too short to measure)."""

    def __init__(self, seconds):
        self.seconds, self.asked = list(seconds), 0

    def ask(self, req):
        s = self.seconds[min(self.asked, len(self.seconds) - 1)]
        self.asked += 1
        why = "" if s is not None else "too short to measure: 4096 calls took 0 s"
        return {"seconds": s, "why": why, "tokens": [1, 2, 3, 4], "calls": 8}


def _rows(seconds_mh, seconds_sdpa, repeats=3):
    workers = {"multihead": FakeWorker(seconds_mh), "sdpa": FakeWorker(seconds_sdpa)}
    d = hf._decode(workers, prompt=8, new=4, repeats=repeats, say=lambda what: None)
    return {r["impl"]: r for r in d["rows"]}, workers


def test_huge_durations_take_the_rounds_asked_and_a_rate_per_second():
    rows, workers = _rows([1e6, 1.1e6, 0.9e6], [2e6])
    assert workers["sdpa"].asked == 3 and rows["multihead"]["tok_s"] == pytest.approx(4e-6)
    assert (
        rows["multihead"]["vs_sdpa"] == pytest.approx(2.0) and not rows["multihead"]["vs_sdpa_within_noise"]
    )
    assert rows["multihead"]["calls"] == 8  # one generate's calls, however many rounds


def test_tiny_durations_take_rounds_until_long_enough():
    rows, workers = _rows([1e-3], [1e-3], repeats=1)
    assert workers["sdpa"].asked == 200  # 200 x 1 ms: the 0.2 s of samples every timing needs
    assert rows["multihead"]["vs_sdpa_within_noise"]
    assert hf._vs(rows["multihead"], "vs_sdpa", "vs_sdpa_within_noise") == "same within noise"
    assert hf._vs(rows["sdpa"], "vs_sdpa", "vs_sdpa_within_noise") == "1.00x"  # the reference


def test_a_call_too_short_for_the_clock_is_a_note_not_a_rate():
    rows, workers = _rows([None], [0.5, 0.5, 0.5])
    assert rows["multihead"]["tok_s"] is None and rows["multihead"]["vs_sdpa"] is None
    assert rows["multihead"]["note"].startswith("too short to measure")
    assert workers["multihead"].asked == 1 and rows["sdpa"]["tok_s"] == pytest.approx(8.0)
