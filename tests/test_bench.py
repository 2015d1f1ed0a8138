"""``multihead bench``: a tiny smoke run of the suite (no timed assertions; goals live in BENCHMARKS.md)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from multihead.bench import suite as bench
from multihead.cli.main import main


def test_suites_are_fixed_and_named():
    full = bench.cases("full")
    names = {c.name for c in full}
    assert {"dense", "causal", "window 512", "8 causal documents", "GQA decode", "fwd+bwd causal"} <= names
    assert {c.n for c in full if c.family == "window"} == {16384, 32768}
    assert {c.n for c in full if c.family == "decode"} == {4096, 8192, 16384, 32768}
    with pytest.raises(ValueError, match="suite kind must be 'full', 'quick' or 'tiny', got 'huge'"):
        bench.cases("huge")


def test_tiny_run_reports_ratios_and_rates():
    doc = bench.run("tiny", repeats=1, only="GQA decode")
    assert doc["machine"]["bandwidth_gbps"] > 0 and doc["machine"]["matmul_gflops"]
    rows = {r["method"]: r for r in doc["results"]}
    assert {"auto", "decode", "sdpa"} <= set(rows)
    # the choice first; a busy machine may add the timing's own remark after it
    assert rows["auto"]["note"].split("; ")[0] == "auto -> decode"
    assert rows["auto"]["ms"] > 0 and rows["auto"]["gbps"] > 0 and rows["auto"]["bw_frac"] > 0
    assert set(rows["auto"]["vs"]) >= {"sdpa", "decode"}
    with pytest.raises(ValueError, match="no case matches 'nothing'"):
        bench.run("tiny", only="nothing")


def test_goals_are_checked_from_results():
    results = [
        {"family": "dense", "n": 4096, "method": "auto", "ms": 1.0, "vs": {"sdpa": 1.01}, "case": "dense"},
        {"family": "decode", "n": 16384, "method": "auto", "ms": 1.0, "vs": {"sdpa": 0.7}, "case": "d",
         "bw_frac": 0.6},
    ]  # fmt: skip
    goals = {(g["case"], g["goal"]): g["met"] for g in bench.check_goals(results)}
    assert goals[("dense", "auto <= 1.05x sdpa")] is True
    assert goals[("d", "auto <= 0.5x sdpa")] is False
    assert goals[("d", "auto >= 0.5x bandwidth")] is True


def test_cli_json_and_plot(tmp_path):
    png = tmp_path / "bench.png"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["bench", "--tiny", "--repeats", "1", "--only", "window", "--json", "--plot", str(png)])
    assert code == 0
    doc = json.loads(buf.getvalue())
    methods = {r["method"] for r in doc["results"]}
    assert {"auto", "tiled", "sdpa", "sdpa/block"} <= methods
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_help_and_bad_args(capsys):
    assert main(["bench", "--help"]) == 0
    assert "--full" in capsys.readouterr().out
    assert main(["bench", "--repeats", "0", "--tiny", "--only", "window"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("multihead bench: error: argument --repeats: expected an integer >= 1, got '0'")
    assert err.count("\n") == 1  # one line


def test_distributed_flag_runs_ring_attention_on_local_processes():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "--distributed", "2", "--seq", "256", "--json"]) == 0
    doc = json.loads(out.getvalue())
    sizes = [row["world_size"] for row in doc["rows"]]
    assert sizes == [1, 2]
    assert all(row["finite"] and row["peak_bytes"] >= 0 for row in doc["rows"])  # tiny: RSS may not grow


def test_only_picks_families_exactly_and_names_by_substring():
    """--only "causal" is the plain causal family (not ALiBi, documents or fwd+bwd); parts add up."""
    names = lambda only: sorted({c.name for c in bench.cases("full") if bench.selected(c, only)})  # noqa: E731
    assert names("causal") == ["causal"]
    assert names("ALiBi") == ["causal + ALiBi"]
    assert names("dense,documents") == ["8 causal documents", "dense"]
    assert names("fwd+bwd") == ["fwd+bwd causal", "fwd+bwd window 256"]
    assert names(None) == sorted({c.name for c in bench.cases("full")})


def test_a_ratio_inside_the_noise_is_no_gain_and_no_loss():
    row = {"family": "dense", "n": 4096, "method": "auto", "ms": 1.0, "case": "dense",
           "vs": {"sdpa": 1.19, "eager": 0.4}, "vs_noise": {"sdpa": True, "eager": False}}  # fmt: skip
    (goal,) = bench.check_goals([row])
    assert goal["met"] is True and goal["within_noise"] is True  # 1.19x inside the noise reads as 1.0x
    assert bench.vs_text(row) == "sdpa same within noise, eager 0.40x"
    assert "same within noise" in _text(bench.goals_table({"goals": [goal]}))


def test_no_goal_case_ran_says_so_instead_of_an_empty_table():
    text = _text(bench.goals_table({"goals": []}))
    assert text.startswith("goals of the CPU kernels: none checked, their cases did not run")
    assert "dense N=4096" in text


def _text(renderable) -> str:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(renderable)
    return console.export_text()


def test_the_suites_cells_refuse_a_wide_spread_and_a_rate_above_the_matmul_rate():
    row = {"ms": 2.0, "ms_spread": [0.1, 3.0], "gflops": 900.0, "matmul_gflops": 300.0}
    assert bench.ms_text(row).startswith("n/a (its spread 0.1-3 is wider than 10x")
    assert "pass a larger `multihead bench --repeats`" in bench.ms_text(row)
    assert bench.gflops_text(row).startswith("n/a (900 is above the matmul rate 300")
    fine = {"ms": 2.0, "ms_spread": [1.9, 2.1], "gflops": 100.0, "matmul_gflops": 300.0}
    assert bench.ms_text(fine) == "2.0 (1.9-2.1)" and bench.gflops_text(fine) == "100.0"
