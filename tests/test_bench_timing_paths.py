"""Timing paths of ``bench hf`` (made-up worker answers) and ``bench --distributed`` (a fake clock):
no real timing."""

from __future__ import annotations

import pytest

from multihead.bench import hf, hf_tables


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
    assert hf_tables.vs_text(rows["multihead"], "vs_sdpa", "vs_sdpa_within_noise") == "same within noise"
    assert hf_tables.vs_text(rows["sdpa"], "vs_sdpa", "vs_sdpa_within_noise") == "1.00x"  # the reference


def test_a_call_too_short_for_the_clock_is_a_note_not_a_rate():
    rows, workers = _rows([None], [0.5, 0.5, 0.5])
    assert rows["multihead"]["tok_s"] is None and rows["multihead"]["vs_sdpa"] is None
    assert rows["multihead"]["note"].startswith("too short to measure")
    assert workers["multihead"].asked == 1 and rows["sdpa"]["tok_s"] == pytest.approx(8.0)


# -- multihead bench --distributed: every rank times the collective call on the slowest rank's samples
@pytest.mark.parametrize(
    ("per_call", "tick", "ok"), [(0.0, 0.0, False), (1e-12, 1e-6, False), (0.02, 0.0, True), (1e6, 0.0, True)]
)
def test_collective_timing_zero_tiny_huge(per_call, tick, ok):
    import torch

    from multihead.bench import distributed
    from tests.clocks import FakeClock

    c = FakeClock(per_call, per_read=0.0 if per_call < 1e-9 else 1e-9, tick=tick)
    agreed = []
    t = distributed.time_collective(c.fn, torch.device("cpu"), clock=c, sync=lambda s: agreed.append(s) or s)
    assert t.ok is ok and len(agreed) >= 1  # the tick is agreed on before any call
    if ok:
        assert t.median == pytest.approx(per_call, rel=1e-3) and t.samples >= 3
        assert len(agreed) == 1 + t.samples + (t.inner > 1)  # the tick and every sample, nothing local
    else:
        assert "too short to measure" in t.why
        row = distributed.summarise(1, [_rank(None, t.why)])
        assert "too short to measure" in distributed.render_distributed_bench({"config": _CFG, "rows": [row]})


_CFG = {
    "seq_len": 64, "heads": 1, "kv_heads": 1, "head_dim": 8, "dtype": "float32", "mask": "causal",
    "layout": "zigzag", "backward": False, "threads": 1,
}  # fmt: skip


def _rank(seconds, why=""):
    return {
        "rank": 0, "tokens": 64, "input_bytes": 1, "peak_bytes": None, "seconds": seconds,
        "seconds_spread": [seconds, seconds], "why": why, "sent_bytes": 0, "messages": 0, "finite": True,
    }  # fmt: skip
