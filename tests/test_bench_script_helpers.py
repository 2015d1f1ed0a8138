"""The helpers benchmarks/ scripts import from ``multihead.bench`` (runs, encode, suite_markdown,
gpu_timing), driven with fake clocks and stand-in encoders: no real timing, no model."""

from __future__ import annotations

import math
import time

import pytest
import torch

from multihead.bench import encode, gpu_timing, runs, suite_markdown, timing
from tests.clocks import FakeClock

NAN = math.nan


# -- runs: figures over several runs, each with its own probe of the limit -------------------------------
def test_paired_limit_text_is_the_median_of_each_runs_own_fraction():
    # run by run: 50%, 80%, 60% of the limit probed in that run; the median of the pairs, not of each side
    assert runs.paired_limit_text([50.0, 40.0, 60.0], [100.0, 50.0, 100.0]) == "60%"


def test_paired_limit_text_skips_unmeasured_runs_and_says_dash_without_one():
    assert runs.paired_limit_text([NAN, 30.0], [100.0, 100.0]) == "30%"
    assert runs.paired_limit_text([30.0], [NAN]) == "-"
    assert runs.paired_limit_text([NAN, NAN], [1.0, 1.0]) == "-"
    assert runs.paired_limit_text([1.0], [0.0]) == "-"  # no limit: no fraction


def test_paired_limit_text_refuses_a_median_above_the_limit():
    assert runs.paired_limit_text([120.0, 130.0], [100.0, 100.0]) == timing.ABOVE
    assert runs.paired_limit_text([120.0], [100.0], "above its floor") == "above its floor"


def test_paired_limit_text_wants_one_limit_per_run():
    with pytest.raises(ValueError):
        runs.paired_limit_text([1.0, 2.0], [1.0])


def test_median_rate():
    assert runs.median_rate([NAN, 3.0, 1.0, 2.0]) == 2.0
    assert runs.median_rate([NAN]) is None and runs.median_rate([]) is None


# -- encode: multihead's encode against sentence-transformers' --------------------------------------------
class FakeEncoder:
    """``encode`` costs ``per_call`` seconds of ``clock`` (and of ``cpu``) and returns unit vectors."""

    def __init__(self, clock: FakeClock, per_call: float, cpu: FakeClock):
        self.clock, self.per_call, self.cpu = clock, per_call, cpu

    def encode(self, texts, **kw):
        self.clock.true += self.per_call
        self.cpu.true += self.per_call
        return torch.nn.functional.normalize(torch.ones(len(texts), 4), dim=-1)  # (n, 4)

    def tokenize(self, texts):
        return [t.split() for t in texts]


@pytest.mark.parametrize(
    ("per_call", "tick", "ok"),
    [(0.0, 0.0, False), (1e-12, 1e-6, False), (0.05, 0.0, True), (1e6, 0.0, True)],
    ids=["zero", "tiny", "50ms", "huge"],
)
def test_encode_bench_rates_ratios_or_too_short(per_call, tick, ok):
    per_read = 0.0 if per_call < 1e-9 else 1e-9
    wall, cpu = FakeClock(0.0, per_read=per_read, tick=tick), FakeClock(0.0, per_read=per_read, tick=tick)
    st, ours = FakeEncoder(wall, per_call, cpu), FakeEncoder(wall, per_call / 2, cpu)
    r = encode.bench(["a b", "c"], 3, 2, st, ours, ours, clock=wall, cpu_clock=cpu)
    assert r["tokens"] == {"real": 3, "sentence-transformers padded": 4, "multihead padded": 4}
    assert r["min_cosine_vs_st"]["multihead padded"] == pytest.approx(1.0)
    if ok:  # ours takes half the time: twice the texts/s, a ratio clear of the noise, in wall and CPU time
        assert r["texts_per_s"]["sentence-transformers"] == pytest.approx(2 / per_call, rel=1e-3)
        assert r["ratio_vs_st"]["multihead padded"] == pytest.approx(2.0, rel=1e-3)
        assert r["cpu_ratio_vs_st"]["multihead padded"] == pytest.approx(2.0, rel=1e-3)
        assert not r["ratio_vs_st_within_noise"]["multihead padded"]
        assert r["ratio_vs_st_within_noise"]["sentence-transformers"]  # itself: never a gain
    else:
        assert set(r["texts_per_s"].values()) == {None} and set(r["ratio_vs_st"].values()) == {None}
        assert all(w.startswith(timing.TOO_SHORT) for w in r["why_no_rate"].values())


def test_encode_texts_and_tokens():
    assert encode.short_texts(["First. Second.", "one line\nnext", ".hidden"]) == [
        "First",
        "one line",
        ".hidden",
    ]
    # batches of 2 over lengths [3, 1, 2] in the order given: max 3 x 2, then 2 x 1
    assert encode.padded_tokens([3, 1, 2], [0, 1, 2], 2) == 8
    assert encode.ratio_text(None, False) == timing.TOO_SHORT
    assert encode.ratio_text(1.01, True) == timing.SAME
    assert encode.ratio_text(2.0, False) == "2.00x"


# -- suite_markdown: multihead bench's results as markdown ------------------------------------------------
def test_suite_markdown_rows_goals_and_refusals():
    doc = {
        "machine": {"cpu": "test cpu", "threads": 2, "torch": "2.x", "matmul_gflops": 100,
                    "bandwidth_gbps": 10},
        "results": [
            {"case": "causal", "n": 64, "method": "tiled", "note": "", "ms": 1.25, "ms_spread": [1.0, 1.5],
             "gflops": 2.0, "matmul_frac": 0.02, "gbps": 0.5, "peak_mib": 3.0,
             "vs": {"sdpa": 0.5}, "vs_noise": {"sdpa": True}},
            {"case": "causal", "n": 64, "method": "sdpa", "note": "", "ms": 2.5, "ms_spread": None,
             "gflops": None, "matmul_frac": 0.0, "gbps": None, "peak_mib": None},
            {"case": "causal", "n": 64, "method": "eager", "note": f"{timing.TOO_SHORT}: 0 s", "ms": None},
        ],
        "goals": [{"goal": "tiled <= sdpa", "case": "causal", "n": 64, "value": 0.5, "within_noise": True,
                   "met": True}],
    }  # fmt: skip
    text = suite_markdown.markdown(doc)
    assert text.startswith("Machine: test cpu, 2 threads, torch 2.x")
    assert "| causal | 64 | tiled | 1.2 (1.0-1.5) | 2.0 | 2 | 0.50 | 3 | sdpa same within noise |" in text
    assert "| causal | 64 | sdpa | 2.5 | - | 0 | - | - |  |" in text
    assert f"| causal | 64 | eager | {timing.TOO_SHORT}: {timing.TOO_SHORT}: 0 s |" in text
    assert "| tiled <= sdpa | causal | 64 | same within noise | yes |" in text


# -- gpu_timing: budgets, first and warm calls, ratios ----------------------------------------------------
def test_budget_counts_down():
    b = gpu_timing.Budget(60.0)
    assert 0 <= b.spent() < 60 and b.left() > 0 and not b.over()
    spent = gpu_timing.Budget(0.0)
    time.sleep(0.001)
    assert spent.over() and spent.left() < 0
    assert b.allows(compiles=True) and b.allows(compiles=False)
    over = gpu_timing.Budget(10.0)
    over.start -= 11.0  # 1 s over: the methods that do not compile per case go on, up to half again
    assert over.over() and not over.allows(compiles=True) and over.allows(compiles=False)
    gone = gpu_timing.Budget(10.0)
    gone.start -= 16.0  # 6 s over: more than half the budget again
    assert not gone.allows(compiles=False) and not gone.allows(compiles=True)


@pytest.mark.parametrize(
    ("per_call", "tick", "ok"),
    [(0.0, 0.0, False), (1e-12, 1e-6, False), (0.01, 0.0, True), (1e6, 0.0, True)],
    ids=["zero", "tiny", "10ms", "huge"],
)
def test_first_and_warm_on_a_fake_clock(per_call, tick, ok):
    c = FakeClock(per_call, per_read=0.0 if per_call < 1e-9 else 1e-9, tick=tick)
    cpu = torch.device("cpu")
    cell = gpu_timing.first_and_warm(c.fn, cpu, 3, slow_ms=1e12, clock=c)
    if ok:
        assert cell["ms"] == pytest.approx(per_call * 1e3, rel=1e-3) == cell["first_ms"]
        assert gpu_timing.time_ratio({"ms": 2 * cell["ms"]}, cell) == 2.0
        assert gpu_timing.time_ratio(cell, cell) == timing.SAME
    else:  # no number the clock cannot tell: the cell says why instead
        assert "ms" not in cell and cell["skipped"].startswith(timing.TOO_SHORT)
        assert cell["first_ms"] is None and gpu_timing.time_ratio(cell, cell) is None
    assert gpu_timing.device_clock(cpu) is time.perf_counter


def test_a_slow_second_call_is_reported_alone():
    c = FakeClock(2.0, per_read=1e-9)  # 2 s a call: over slow_ms=1000
    cell = gpu_timing.first_and_warm(c.fn, torch.device("cpu"), 3, clock=c)
    assert cell["one_call"] is True and cell["ms"] == pytest.approx(2000.0, rel=1e-3) and c.calls == 2


def test_peer_ratios_are_peer_time_over_ours_and_keep_noise_out():
    cells = {"auto": {"ms": 2.0}, "triton": {"ms": 1.0}, "sdpa": {"ms": 3.0}, "torch flex": {"skipped": "x"}}
    got = gpu_timing.peer_ratios(cells, ("auto", "triton"), ("sdpa", "torch flex"))
    assert got == {"auto vs sdpa": 1.5, "triton vs sdpa": 3.0}
    noisy = {"auto": {"ms": 2.0, "spread_ms": [1.9, 2.1]}, "sdpa": {"ms": 2.05, "spread_ms": [2.0, 2.2]}}
    assert gpu_timing.peer_ratios(noisy, ("auto",), ("sdpa",)) == {"auto vs sdpa": timing.SAME}
