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

    wall, cpu = (
        FakeClock(0.0, per_read=0.0 if per_call < 1e-9 else 1e-9, tick=tick),
        FakeClock(0.0, tick=tick),
    )
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


def _clock(per_call: float, tick: float = 0.0) -> FakeClock:
    return FakeClock(0.0, per_read=0.0 if per_call < 1e-9 else 1e-9, tick=tick)


ZERO_TINY_HUGE = pytest.mark.parametrize(
    ("per_call", "tick", "ok"),
    [(0.0, 0.0, False), (1e-12, 1e-6, False), (0.01, 0.0, True), (1e6, 0.0, True)],
    ids=["zero", "tiny", "10ms", "huge"],
)


class FakeLM:
    """A forward costs ``per_call``, ``generate(ids, n)`` ``n * per_call`` seconds of ``clock``."""

    def __init__(self, clock: FakeClock, per_call: float):
        self.clock, self.per_call = clock, per_call

    def __call__(self, ids):
        self.clock.true += self.per_call

    def generate(self, ids, n):
        self.clock.true += n * self.per_call


@ZERO_TINY_HUGE
def test_bench_approx_quant_prefill_and_decode(per_call, tick, ok):
    import bench_approx

    c = _clock(per_call, tick)
    out = bench_approx.timed({"a": FakeLM(c, per_call), "b": FakeLM(c, 2 * per_call)}, None, 9, 3, clock=c)
    (pre_a, dec_a), (pre_b, dec_b) = out["a"], out["b"]
    if ok:  # 9 tokens: a prefill and 8 steps of per_call each
        assert pre_a.median == pytest.approx(per_call, rel=1e-3)
        assert dec_a.rate(8) == pytest.approx(1 / per_call, rel=1e-3)
        assert dec_b.rate(8) == pytest.approx(0.5 / per_call, rel=1e-3)
    else:
        assert dec_a.rate(8) is None and "too short to measure" in dec_a.why and pre_b.median is None


@ZERO_TINY_HUGE
def test_bench_heads_time_ratio(per_call, tick, ok):
    import bench_heads

    c = _clock(per_call, tick)
    half, full = FakeEncoder(c, per_call / 2), FakeEncoder(c, per_call)
    r = bench_heads.time_ratio(half, full, ["a"], 3, clock=c)
    if ok:
        assert r.ratio == pytest.approx(0.5, rel=1e-3) and str(r) == "0.50x"
        assert str(bench_heads.time_ratio(full, full, ["a"], 3, clock=c)) == "same within noise"
    else:
        assert r.ratio is None and str(r) == "too short to measure"


def _child_json(capsys) -> dict:
    import json

    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@ZERO_TINY_HUGE
def test_tiled_memory_child_time_or_too_short(per_call, tick, ok, capsys):
    import tiled_memory

    c = _clock(per_call, tick)
    c.per_call = per_call
    real = tiled_memory._mask
    try:  # every attention call advances the fake clock by per_call
        tiled_memory._mask = lambda spec: (c.fn(), real(spec))[1]
        tiled_memory._child(64, "tiled", 1, 8, "causal", False, clock=c)
    finally:
        tiled_memory._mask = real
    row = _child_json(capsys)
    if ok:
        assert row["seconds"] == pytest.approx(per_call, rel=1e-3) and row["finite"]
        assert tiled_memory.time_cell(row) == f"{per_call:.3g} s"
    else:
        assert row["seconds"] is None and row["why"].startswith("too short to measure")
        assert tiled_memory.time_cell(row) == "too short to measure"


@ZERO_TINY_HUGE
def test_sinks_child_time_and_ratio(per_call, tick, ok, capsys, monkeypatch):
    import sinks

    import multihead as mh

    c = _clock(per_call, tick)
    real = mh.attention
    monkeypatch.setattr(mh, "attention", lambda *a, **kw: (c.fn(), real(*a, **kw))[1])
    c.per_call = per_call
    sinks._child("tiled", 32, 3, clock=c)
    row = _child_json(capsys)
    if ok:
        assert row["seconds"] == pytest.approx(per_call, rel=1e-3) and row["samples"] >= 3
        slower = {**row, "seconds": 2 * per_call, "spread": [2 * per_call, 2 * per_call]}
        assert sinks.time_ratio(slower, row) == "2.00x" and sinks.time_ratio(row, row) == "same within noise"
    else:
        assert row["seconds"] is None and sinks.time_ratio(row, row) == "too short to measure"


@ZERO_TINY_HUGE
def test_mla_decode_rates_ratios_or_too_short(per_call, tick, ok):
    import mla_decode

    import multihead as mh

    c = _clock(per_call, tick)
    c.per_call = per_call
    models = {}
    for name, cost in (("MHA", 1), ("MLA absorbed", 2)):
        torch.manual_seed(0)
        m = mh.TransformerLM(64, 16, 1, 2, 32).eval()
        for _ in range(cost):  # every token's lm_head costs `cost` calls of the fake clock
            m.lm_head.register_forward_hook(lambda *a: c.fn())
        models[name] = m
    prompt = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(0))  # (1, 4)
    times, tokens = mla_decode.measure(models, prompt, 5, 3, clock=c)
    assert torch.equal(tokens["MHA"], tokens["MLA absorbed"])  # the same weights
    row = {"attention": "MLA absorbed", "tokens_per_s": times["MLA absorbed"].rate(4)}
    vs = mla_decode.timing.compare(times["MHA"], times["MLA absorbed"])
    row.update(vs_mha=vs.ratio, vs_mha_within_noise=vs.same)
    if ok:  # 4 timed steps of 2 * per_call each
        assert row["tokens_per_s"] == pytest.approx(0.5 / per_call, rel=1e-3)
        assert mla_decode.vs_cell(row) == "0.50x" and times["MHA"].samples >= 3
    else:
        assert mla_decode.rate_cell(row) == mla_decode.vs_cell(row) == "too short to measure"
        assert times["MHA"].samples == 1  # no more rounds once a loop is too short for the clock


@pytest.mark.parametrize(
    ("kernel_s", "sum_s", "tick", "of_sum"),
    [
        (0.0, 0.0, 0.0, "-"),  # a clock that never moves: no rate, no fraction
        (1e-12, 1e-12, 1e-6, "-"),  # both too short for a microsecond clock
        (0.02, 0.01, 0.0, "50%"),  # the kernel reads its bytes at half the sum's rate
        (1e6, 2e6, 0.0, "above limit: probe or byte count wrong"),  # a kernel faster than the sum: refused
    ],
    ids=["zero", "tiny", "half", "above"],
)
def test_native_gemv_rates_never_above_the_sum(kernel_s, sum_s, tick, of_sum):
    import native_gemv

    c = _clock(max(kernel_s, sum_s), tick)

    class Probe:  # 256 fp32 numbers: the same 1024 bytes as the kernel reads
        def numel(self):
            return 256

        def sum(self):
            c.true += sum_s

    r = native_gemv.rates(lambda: setattr(c, "true", c.true + kernel_s), 1024, Probe(), 3, clock=c)
    assert r["of_sum"] == of_sum
    if of_sum == "-":
        assert r["GBps"] is None and r["sum_GBps"] is None
    else:
        assert r["GBps"] == pytest.approx(1024 / kernel_s / 1e9, rel=1e-3)


def test_compare_commits_verdicts_zero_tiny_huge():
    import compare_commits

    rounds = lambda *xs: [{"w": x} for x in xs]  # noqa: E731
    assert compare_commits.verdicts(rounds(1.0, 1.1, 0.9), rounds(0.5, 0.52, 0.48)) == {"w": "0.50x"}
    assert compare_commits.verdicts(rounds(1e6, 1.1e6), rounds(1.05e6, 0.95e6)) == {"w": "same within noise"}
    assert compare_commits.verdicts(rounds(1.0, None), rounds(1.0, 1.0)) == {"w": "too short to measure"}
    assert compare_commits.verdicts(rounds(0.0, 0.0), rounds(0.0, 0.0)) == {"w": "too short to measure"}
    assert compare_commits.verdicts(rounds(1e-9), rounds(1e-9)) == {"w": "too short to measure"}


def test_compare_commits_child_times_through_the_helper(monkeypatch):
    import compare_commits

    src = str(Path(__file__).resolve().parents[1] / "src")
    line = 'print(json.dumps({"sum": timing.measure(lambda: sum(range(20000))).median}))'
    monkeypatch.setattr(
        compare_commits, "CHILD", compare_commits.CHILD.split("g = torch.Generator")[0] + line
    )
    res = compare_commits.run(src)
    # the helper loaded by path ran in the child (a call of ~0.2 ms: measurable on a busy machine, where
    # an empty call's spread can exceed what the helper accepts)
    assert set(res) == {"sum"} and res["sum"] > 0


@ZERO_TINY_HUGE
def test_gpu_timing_first_and_warm_on_a_fake_clock(per_call, tick, ok):
    import gpu_timing

    c = _clock(per_call, tick)
    c.per_call = per_call
    cell = gpu_timing.first_and_warm(c.fn, torch.device("cpu"), 3, slow_ms=1e12, clock=c)
    if ok:
        assert cell["ms"] == pytest.approx(per_call * 1e3, rel=1e-3) == cell["first_ms"]
        assert gpu_timing.time_ratio({"ms": 2 * cell["ms"]}, cell) == 2.0
        assert gpu_timing.time_ratio(cell, cell) == "same within noise"
    else:  # no number the clock cannot tell: the cell says why instead
        assert "ms" not in cell and cell["skipped"].startswith("too short to measure")
        assert cell["first_ms"] is None and gpu_timing.time_ratio(cell, cell) is None
    assert gpu_timing.device_clock(torch.device("cpu")) is gpu_timing.time.perf_counter


def test_gpu_speed_ratios_keep_noise_out():
    import gpu_speed

    cells = {"auto": {"ms": 2.0, "spread_ms": [1.9, 2.1]}, "sdpa": {"ms": 2.05, "spread_ms": [2.0, 2.2]}}
    assert gpu_speed.ratios(cells) == {"auto vs sdpa": "same within noise"}
