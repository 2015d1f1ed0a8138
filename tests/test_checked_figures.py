"""Every printed rate goes through one check (``timing.check_figure``): constructed numbers, no timing."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from multihead.bench import timing
from multihead.bench.timing import Timing, check_figure, rate_figure


def test_a_rate_above_its_limit_is_not_printed():
    got = check_figure(
        605.0, 590.0, 620.0, limit=199.0, limit_what="the bandwidth limit", fix="pass --rounds 9"
    )
    assert not got.ok and got.text().startswith("n/a (605 is above the bandwidth limit 199")
    assert got.text().endswith("; pass --rounds 9)")


def test_a_spread_reaching_above_the_limit_is_not_printed():
    got = check_figure(150.0, 140.0, 260.0, limit=199.0, limit_what="the bandwidth limit")
    assert not got.ok and "spread reaches 260" in got.why


def test_a_spread_wider_than_ten_times_is_not_printed():
    got = check_figure(22849.9, 7691.4, 4775843.6, fix="pass --max-new-tokens 128")
    assert "wider than 10x" in got.why and "22849" not in got.text()


def test_a_floor_slower_than_the_whole_is_not_printed():
    got = check_figure(20.0, at_least=600.0, at_least_what="the whole step's rate", fix="pass --rounds 9")
    assert not got.ok and "below the whole step's rate 600" in got.text()


def test_an_honest_figure_reads_with_its_spread():
    assert check_figure(605.0, 590.0, 620.0, limit=700.0).text(".0f", unit="tok/s") == "605 tok/s (590-620)"


def test_no_number_says_why_and_what_to_pass():
    assert check_figure(None, why="too short to measure: x", fix="pass --n 3").text() == (
        "n/a (too short to measure: x; pass --n 3)"
    )


def test_rate_figure_reads_the_timing_spread_as_rates():
    got = rate_figure(Timing(0.5, 0.4, 1.0, 5, 1), 10.0)
    assert got.ok and (got.value, got.low, got.high) == (20.0, 10.0, 25.0)
    assert not rate_figure(Timing(None, None, None, 0, 0, "too short to measure: y"), 1.0).ok


@given(
    st.floats(1e-6, 1e9),
    st.floats(1e-6, 1e9),
    st.floats(1e-6, 1e9),
    st.one_of(st.none(), st.floats(1e-6, 1e9)),
    st.one_of(st.none(), st.floats(1e-6, 1e9)),
)
def test_a_printed_figure_is_never_impossible(value, a, b, limit, least):
    low, high = min(a, b), max(a, b)
    got = check_figure(value, low, high, limit=limit, at_least=least)
    if got.ok:  # whatever is printed passes every check
        assert high / low <= timing.WIDE
        assert limit is None or (value <= limit and high <= limit)
        assert least is None or value >= least
    else:
        assert got.text().startswith("n/a (") and got.value is None


def test_bench_hf_prefill_seconds_are_checked():
    from multihead.bench import hf_tables

    assert hf_tables.seconds_text({"seconds": 0.5, "seconds_spread": [0.01, 0.9]}).startswith(
        "n/a (its spread"
    )
    assert hf_tables.seconds_text({"seconds": 0.5, "seconds_spread": [0.45, 0.55]}) == "0.500 (0.450-0.550)"
