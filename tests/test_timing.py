"""The timing helper of every benchmark, driven by fake clocks (no real timing here)."""

from __future__ import annotations

import pytest

from multihead.bench import timing
from multihead.cost import machine
from tests.clocks import FakeClock


def test_a_plain_call_gets_its_own_duration_and_enough_samples():
    c = FakeClock(0.003)
    t = timing.measure(c.fn, clock=c)
    assert t.ok and t.median == pytest.approx(0.003, rel=1e-3)
    assert t.samples >= 5 and t.samples * t.inner * 0.003 >= timing.MIN_TOTAL
    assert t.low is not None and t.high is not None and t.low <= t.median <= t.high


def test_a_zero_duration_is_too_short_to_measure():
    c = FakeClock(0.0, per_read=0.0)  # the clock never moves
    t = timing.measure(c.fn, clock=c)
    assert not t.ok and t.rate(1.0) is None
    assert "too short to measure" in t.why and "did not advance" in t.why
    assert timing.rate_text(t, 1.0) == "too short to measure"
    assert c.calls == 0


def test_a_tiny_duration_below_the_clock_is_too_short_not_a_huge_rate():
    c = FakeClock(1e-12, per_read=0.0, tick=1e-6)  # 4096 calls never move a microsecond clock
    t = timing.measure(c.fn, clock=c, resolution=1e-6)
    assert not t.ok and t.median is None and "too short to measure" in str(t)
    assert "4096 calls" in t.why


def test_a_tiny_duration_is_measured_by_batching_calls():
    c = FakeClock(2e-6)  # 2 us per call: one call is below the 0.1 ms floor of a sample
    t = timing.measure(c.fn, clock=c)
    assert t.ok and t.inner > 1 and t.median == pytest.approx(2e-6, rel=0.05)


def test_a_12ms_clock_is_read_as_coarse_and_still_gives_the_right_time():
    c = FakeClock(0.001, per_read=1e-6, tick=0.012)  # 1 ms calls, a clock that moves in 12 ms steps
    assert timing.clock_resolution(c) == pytest.approx(0.012)
    t = timing.measure(c.fn, clock=c)
    assert t.ok and t.median == pytest.approx(0.001, rel=0.03)  # not 0, 12 or 24 ms
    assert t.inner * 0.001 >= 50 * 0.012 * 0.99  # each sample spans 50 ticks


def test_a_huge_duration_stops_after_a_few_samples():
    c = FakeClock(1e6)
    t = timing.measure(c.fn, clock=c)
    assert t.ok and t.median == pytest.approx(1e6) and t.samples == 3 and t.inner == 1


def test_spread_and_interleaving_of_measure_all():
    order: list[str] = []
    c = FakeClock(0.0)
    durations = {"a": iter([0.01, 0.01, 0.01, 0.02, 0.01, 0.01, 0.03] * 40), "b": iter([0.02] * 300)}

    def call(k: str):
        def fn():
            order.append(k)
            c.true += next(durations[k])

        return fn

    out = timing.measure_all({"a": call("a"), "b": call("b")}, clock=c, warmup=0, min_total=0.1)
    assert out["a"].median == pytest.approx(0.01, abs=1e-6) and out["b"].median == pytest.approx(
        0.02, abs=1e-6
    )
    assert out["a"].high is not None and out["a"].high >= out["a"].median
    timed = order[2:]  # after each one's calibration call, a and b alternate, rotating the lead
    assert timed[:6] == ["a", "b", "b", "a", "a", "b"]


def test_same_within_noise_is_never_a_gain():
    slow = timing.Timing(0.0118, 0.0105, 0.0130, 9, 1)
    fast = timing.Timing(0.0107, 0.0100, 0.0121, 9, 1)
    c = timing.compare(fast, slow)
    assert c.same and str(c) == "same within noise"
    apart = timing.compare(timing.Timing(0.005, 0.0049, 0.0051, 9, 1), slow)
    assert not apart.same and str(apart) == "0.42x"
    assert str(timing.compare(timing.Timing(None, None, None, 0, 0, "x"), slow)) == "too short to measure"


def test_a_difference_inside_the_noise_is_too_short_to_measure():
    # generate(4) - generate(1): the 3e9 tok/s of a clamped, negative difference must not come back
    one = timing.Timing(0.050, 0.045, 0.060, 3, 1)
    four = timing.Timing(0.049, 0.047, 0.058, 3, 1)
    d = timing.difference(four, one)
    assert not d.ok and "inside the noise" in d.why and d.rate(3) is None
    clear = timing.difference(timing.Timing(0.150, 0.148, 0.152, 3, 1), one)
    assert clear.ok and clear.median == pytest.approx(0.100) and clear.low == pytest.approx(0.088)


def test_a_fraction_above_the_limit_is_refused():
    assert timing.fraction_of_limit(50.0, 100.0) == pytest.approx(0.5)
    assert timing.fraction_of_limit(None, 100.0) is None
    with pytest.raises(ValueError, match="probe of the limit or the bytes/FLOPs counted"):
        timing.fraction_of_limit(460.0, 100.0)
    assert timing.limit_text(460.0, 100.0) == "above limit: probe or byte count wrong"
    assert timing.limit_text(92.0, 100.0) == "92%"


def test_bad_options_name_themselves():
    with pytest.raises(ValueError, match="min_samples must be >= 1, got 0"):
        timing.measure(lambda: None, min_samples=0)
    with pytest.raises(ValueError, match="min_total, max_seconds and warmup must be >= 0"):
        timing.measure(lambda: None, min_total=-1.0)


def test_time_text():
    assert timing.time_text(timing.Timing(0.0123, 0.0119, 0.0128, 5, 1)) == "12.3 ms (11.9-12.8)"


def test_the_fastest_sample_is_kept_for_probes_of_a_limit():
    c = FakeClock(0.0)
    durations = iter([0.05, 0.04, 0.06, 0.05, 0.05, 0.07] * 10)

    def fn():
        c.true += next(durations)

    t = timing.measure(fn, clock=c, warmup=0)
    assert t.best == pytest.approx(0.04, abs=1e-6) and t.median == pytest.approx(0.05, abs=1e-6)
    assert timing.limit_text(2.0, 1.0, "above its floor") == "above its floor"


def test_sync_makes_every_process_take_the_same_decisions():
    # a rank whose own samples are short follows the slowest rank's (the synced) durations: it takes
    # as many calls as the others, so no rank waits forever in a collective call
    c = FakeClock(1e-6)
    slowest = []

    def agree(seconds: float) -> float:
        slowest.append(seconds)
        return seconds if len(slowest) == 1 else max(seconds, 0.05)  # the tick; another rank's 50 ms

    t = timing.measure(c.fn, clock=c, sync=agree, warmup=0)
    assert t.ok and t.inner == 1 and t.median == pytest.approx(0.05) and t.samples == 5
    assert len(slowest) == 1 + 5  # the tick, then every sample
    never = timing.measure(FakeClock(0.0, per_read=0.0).fn, clock=FakeClock(0.0, per_read=0.0), sync=float)
    assert not never.ok and "did not advance" in never.why


def test_enough_is_the_rule_of_measure_all():
    assert not timing.enough([0.01] * 4) and not timing.enough([0.01] * 5)  # 5 samples but 0.05 s
    assert timing.enough([0.05] * 5) and timing.enough([0.001] * 200)
    assert timing.enough([20.0] * 3) and not timing.enough([20.0] * 2)


@pytest.mark.parametrize(
    ("seconds", "ok"), [([], False), ([0.0, 0.0], False), ([1e-9, 0.5], False), ([1e6, 1e6, 2e6], True)]
)
def test_samples_taken_elsewhere_zero_tiny_huge(seconds, ok):
    t = timing.from_samples(seconds)
    assert t.ok is ok
    if ok:
        assert t.median == pytest.approx(1e6) and t.rate(1.0) == pytest.approx(1e-6)
    else:
        assert "too short to measure" in t.why and t.rate(1.0) is None
    with pytest.raises(ValueError, match="inner must be >= 1"):
        timing.from_samples(seconds, inner=0)


def test_samples_of_several_calls_are_per_call():
    t = timing.from_samples([0.4, 0.2, 0.3], inner=100)
    assert t.median == pytest.approx(0.003) and (t.low, t.high) == pytest.approx((0.002, 0.004))


def test_the_machine_probe_is_the_fastest_sample_or_refuses():
    c = FakeClock(0.5)
    assert machine.probe_time(c.fn, clock=c) == pytest.approx(0.5, rel=1e-3)
    stopped = FakeClock(0.0, per_read=0.0)
    with pytest.raises(RuntimeError, match="too short to measure"):
        machine.probe_time(stopped.fn, clock=stopped)
    tiny = FakeClock(1e-12, per_read=0.0, tick=1e-6)
    with pytest.raises(RuntimeError, match="too short to measure"):
        machine.probe_time(tiny.fn, clock=tiny)


@pytest.mark.parametrize(
    ("per_call", "tick", "ok", "calls"),
    [(0.5, 0.0, True, 1), (1e6, 0.0, True, 1), (2e-6, 0.0, True, None), (1e-12, 1e-6, False, None)],
    ids=["plain", "huge", "tiny-batched", "tiny-too-short"],
)
def test_the_first_call_is_the_sample_unless_too_short(per_call, tick, ok, calls):
    c = FakeClock(per_call, per_read=0.0 if tick else 1e-7, tick=tick)
    result, t = timing.first_call(lambda: (c.fn(), "out")[1], clock=c, resolution=tick or None)
    assert result == "out" and t.ok is ok
    if calls is not None:
        assert c.calls == calls and t.median == pytest.approx(per_call, rel=1e-3)
    elif ok:  # one call under the 0.1 ms floor: timed again as a batch of calls
        assert t.inner > 1 and t.median == pytest.approx(per_call, rel=0.05)
    else:
        assert "too short to measure" in t.why and t.rate(1.0) is None
    stopped = FakeClock(0.0, per_read=0.0)
    assert not timing.first_call(stopped.fn, clock=stopped)[1].ok


@pytest.mark.parametrize(
    ("per_call", "tick", "ok"), [(0.0, 0.0, False), (1e-12, 1e-6, False), (0.5, 0.0, True), (1e6, 0.0, True)]
)
def test_once_never_repeats_a_call(per_call, tick, ok):
    c = FakeClock(per_call, per_read=0.0 if per_call < 1e-9 else 1e-7, tick=tick)
    result, t = timing.once(lambda: (c.fn(), 7)[1], clock=c, resolution=tick or None)
    assert result == 7 and c.calls == 1 and t.ok is ok
    if ok:
        assert t.median == pytest.approx(per_call, rel=1e-3)
    else:
        assert "too short to measure" in t.why
