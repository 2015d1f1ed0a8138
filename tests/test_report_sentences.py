"""Every sentence of the report that quotes numbers reads them off its own table's data; plots give each
design its own marker and colour and hide no point; named works have references."""

from __future__ import annotations

import re

import pytest

from multihead.study.context import Section, Table
from multihead.study.references import REFERENCES, named_works, references
from multihead.study.sections import approximations as approx
from multihead.study.sections import designs, designs_figures, performance
from multihead.study.sections.distributed import memory_note
from multihead.study.sections.heads import pruning_orders


def _pruning(values: dict[tuple[float, str], float]) -> list[dict]:
    return [{"fraction": f, "order": o, "mean_cos": c} for (f, o), c in values.items()]


# (mean cosines by (fraction, order), what the sentence must say, what it must not say)
PRUNING = [
    (  # the run in which "the estimate holds best for small fractions" was written next to a loss at 1/3
        {(1 / 3, "importance"): 0.832, (1 / 3, "random"): 0.877, (2 / 3, "importance"): 0.61,
         (2 / 3, "random"): 0.55},
        [r"keeps more at 2/3 \(0\.610 vs 0\.550\)", r"less at 1/3 \(0\.832 vs 0\.877\)"],
        "holds best",
    ),
    (
        {(1 / 3, "importance"): 0.9, (1 / 3, "random"): 0.8, (2 / 3, "importance"): 0.7,
         (2 / 3, "random"): 0.6},
        [r"keeps more at 1/3 \(0\.900 vs 0\.800\), 2/3 \(0\.700 vs 0\.600\)\."],
        "less at",
    ),
    ({(1 / 2, "importance"): 0.5, (1 / 2, "random"): 0.5}, [r"as much at 1/2"], "more at"),
]  # fmt: skip


@pytest.mark.parametrize("values, says, not_says", PRUNING)
def test_pruning_sentence_reads_its_numbers(values, says, not_says):
    line = pruning_orders(_pruning(values))
    assert line is not None
    for pattern in says:
        assert re.search(pattern, line), line
    assert not_says not in line, line


def test_pruning_sentence_needs_both_orders():
    assert pruning_orders(_pruning({(1 / 3, "importance"): 0.8, (0.0, "-"): 1.0})) is None


def _auto(case: str, n: int, vs: dict[str, float]) -> dict:
    return {"case": case, "n": n, "method": "auto", "ms": 1.0, "vs": vs}


SLOWER = [
    ([_auto("8 causal documents", 4096, {"sdpa": 0.4, "sdpa per block": 1.76})],
     r"8 causal documents N=4096: 1\.76x the time of sdpa per block"),
    ([_auto("causal", 1024, {"sdpa": 1.05}), _auto("dense", 1024, {"sdpa": 0.9})],
     r"auto is within 1\.10x of every peer's time in every case"),
    ([_auto("a", 1, {"p": 1.2}), _auto("b", 2, {"q": 3.0}), {**_auto("c", 3, {"r": 9.0}), "ms": None}],
     r"in: a N=1: 1\.20x the time of p; b N=2: 3\.00x the time of q\.$"),
]  # fmt: skip


@pytest.mark.parametrize("rows, says", SLOWER)
def test_slower_cases_are_said_from_the_ratios(rows, says):
    assert re.search(says, performance.slower_note(rows))


def test_a_ratio_the_table_calls_noise_is_never_called_slower():
    # the run whose table said "tiled same within noise" above "1.13x / 1.20x the time of tiled"
    rows = [
        {**_auto("causal", 1024, {"tiled": 1.13, "sdpa": 0.9}), "vs_noise": {"tiled": True}},
        {**_auto("causal", 2048, {"tiled": 1.20}), "vs_noise": {"tiled": False}},
    ]
    from multihead.bench import suite

    cells = [suite.vs_text(r) for r in rows]
    assert cells == ["tiled same within noise, sdpa 0.90x", "tiled 1.20x"]
    note = performance.slower_note(rows)
    assert "1.13x" not in note and "causal N=2048: 1.20x the time of tiled" in note


def test_performance_quotes_the_walk_sections_matmul_rate(monkeypatch):
    from multihead.study import context

    monkeypatch.setattr(context, "machine_rates", lambda: {"torch.float32": 200.0, "bandwidth": 10.0})
    doc = {
        "machine": {"matmul_gflops": {"torch.float32": 100.0}, "bandwidth_gbps": 9.0, "threads": 2},
        "results": [{"family": "causal", "n": 1024, "method": "auto", "ms": 1.0, "matmul_frac": 0.5}],
        "goals": [],
    }
    performance.one_rate(doc)
    assert doc["machine"]["matmul_gflops"] == {"torch.float32": 200.0}
    assert doc["machine"]["bandwidth_gbps"] == 10.0 and doc["machine"]["threads"] == 2
    assert doc["results"][0]["matmul_frac"] == pytest.approx(0.25)  # the same GFLOP/s against 200


def _approx_row(name: str, peak: int | None, acc: float | None = None) -> dict:
    return {"name": name, "mqar_acc": acc, "cost": {1024: {"seconds": 0.1, "peak_bytes": peak}}}


def test_approximation_table_says_why_columns_are_empty():
    rows = [_approx_row("exact", 5 << 20), _approx_row("TopK(32)", 0), _approx_row("Performer", 0)]
    rows.append({"name": "LowRank(64)", "mqar_acc": None, "cost": {}})
    notes = approx.empty_column_notes(rows, (1024,))
    text = " ".join(notes)
    assert 'MQAR acc is "-" for every method' in text and "--mqar" in text
    assert re.search(r"peak MiB at N=1024 is n/a for TopK\(32\), Performer: ", text), text
    assert "N=1024 is n/a for LowRank(64)" in text
    filled = [_approx_row("exact", 5 << 20, acc=0.99)]
    assert approx.empty_column_notes(filled, (1024,)) == []


# -- distributed: the note reads the table ---------------------------------------------------------------
def _ring(peaks: list[float]) -> list[dict]:
    return [
        {
            "world_size": w,
            "tokens_per_rank": 4096 // w,
            "peak_bytes": p * 2**20,
            "input_bytes": 3 * 2**20 // w,
        }
        for w, p in zip((1, 2, 4), peaks)
    ]


@pytest.mark.parametrize(
    "peaks, says",
    [
        (
            [8.6, 7.8],
            r"W=2 is 0\.91x that of W=1 \(7\.8 vs 8\.6 MiB.*predicts 0\.80x: the measurement is close",
        ),
        ([3.0, 6.0], r"W=2 is 2\.00x that of W=1 .*predicts 0\.80x: the measurement is not"),
    ],
)
def test_ring_memory_note_reads_its_table(peaks, says):
    note = memory_note(_ring(peaks))
    assert re.search(says, note), note
    assert "fixed cost" not in note


# -- plots --------------------------------------------------------------------------------------------------
def test_every_design_has_its_own_marker_and_colour():
    from multihead.variants import NAMES

    styles = [designs.design_style(i) for i in range(len(NAMES) + 1)]
    assert len({m for m, _ in styles}) == len(styles), styles
    assert len({c for _, c in styles}) == len(styles), styles


def test_points_at_one_x_are_spread_and_none_hides_another():
    xs = [1024.0] * 10 + [256.0, 512.0, 2048.0]
    out = designs.dodge(xs)
    assert len(set(out)) == len(out)
    assert out[10:] == xs[10:]  # a point alone keeps its x
    assert min(out[:10]) < 1024 < max(out[:10]) and max(out[:10]) / min(out[:10]) < 2  # near their x


def test_text_plot_draws_every_design_apart_in_its_own_style():
    """The text-LM plot as drawn: 10 of 13 designs at 1024 KV bytes, moh and differential at the same
    bits/byte (it hid one under the other); every point is its own marker, colour and place."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kv = [1024.0] * 10 + [256.0, 512.0, 2048.0]
    rows = [{"design": d, "kv_bytes_per_token": x, "bits_per_byte": 2.5} for d, x in zip(designs.DESIGNS, kv)]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    designs_figures.text_plot(rows, ax)
    fig.canvas.draw()
    centres = [tuple(ax.transData.transform(c.get_offsets())[0].round(1)) for c in ax.collections]
    shapes = {tuple(map(tuple, c.get_paths()[0].vertices.round(3))) for c in ax.collections}
    colours = {tuple(c.get_facecolor()[0]) for c in ax.collections}
    plt.close(fig)
    assert len(centres) == len(set(centres)) == len(shapes) == len(colours) == len(rows)


def test_mqar_plot_states_its_floor():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from multihead.train.trainer import TrainConfig

    cfg = TrainConfig(eval_examples=1000, n_pairs=16)
    rows = [{"design": d, "accuracy": 1.0, "params": 1000} for d in ("mha", "gqa")]
    fig, ax = plt.subplots()
    designs_figures.mqar_plot(rows, cfg, ax)
    floor = designs.error_floor(cfg)
    labels = ax.get_legend_handles_labels()[1]
    plt.close(fig)
    assert floor == pytest.approx(0.003125)
    assert any(f"error 0 drawn here ({floor:.4g}%)" in lb for lb in labels), labels


# -- references ------------------------------------------------------------------------------------------
def test_every_named_work_in_the_report_has_a_reference():
    """The report's own text: every section module's notes name only works with a citation."""
    import inspect

    from multihead.study.sections import (
        approximations,
        designs,
        distributed,
        exactness,
        heads,
        kv_cache,
        minilm,
        performance,
        surgery,
        walk,
    )

    mods = (
        approximations,
        designs,
        distributed,
        heads,
        minilm,
        performance,
        exactness,
        kv_cache,
        surgery,
        walk,
    )
    works = set(named_works("\n".join(inspect.getsource(m) for m in mods)))
    assert {"Zoology", "Clark et al.", "Michel et al.", "Lee et al.", "WordSim-353", "Pang-Lee"} <= works
    assert not works - set(REFERENCES), works - set(REFERENCES)


def test_references_section_lists_cited_works_in_order():
    s = Section(
        "a", "A", {}, [Table("roles (Clark et al.'s statistics)", ["x"], [])], ["Zoology's generator"]
    )
    ref = references([s])
    assert ref is not None and ref.key == "references"
    assert [n.split(":")[0] for n in ref.notes] == ["Clark et al.", "Zoology"]
    assert "arXiv:1906.04341" in ref.notes[0]
    assert references([Section("b", "B", {}, [], ["no names here"])]) is None


def _t(median: float, low: float, high: float):
    from multihead.bench.timing import Timing

    return Timing(median, low, high, 5, 1)


PACKING = [  # (packed, padded seconds, what the sentence says)
    ((0.2, 0.19, 0.21), (0.1, 0.09, 0.11), r"yet packed rows take 2\.00x padded batches' time: the document"),
    ((0.1, 0.09, 0.12), (0.105, 0.1, 0.11), r"same speed within noise\.$"),
    ((0.05, 0.045, 0.055), (0.1, 0.09, 0.11), r"and packed rows take 0\.50x padded batches' time\.$"),
]  # fmt: skip


@pytest.mark.parametrize("packed, padded, says", PACKING)
def test_the_minilm_packing_sentence_reads_the_speed_tables_timings(packed, padded, says):
    from multihead.study.sections.minilm import packing_note

    positions = {"padded_positions": 1000, "packed_positions": 900}
    note = packing_note({"multihead packed": _t(*packed), "multihead padded": _t(*padded)}, positions)
    assert note.startswith("Packing saves 10% of the positions here (1000 padded, 900 packed)")
    assert re.search(says, note), note


def test_the_decode_note_says_why_designs_decode_slower_than_mha():
    rows = [{"design": "mha", "decode_tok_s": 1100.0}, {"design": "gqa", "decode_tok_s": 1000.0},
            {"design": "sinks", "decode_tok_s": 100.0}, {"design": "moh", "decode_tok_s": 200.0}]  # fmt: skip
    paths = {
        "mha": None, "gqa": None, "sinks": "layer 0's attention has sinks or a non-default score scale",
        "moh": "layer 0's attention is a MixtureOfHeads, not the textbook MultiHeadAttention",
    }  # fmt: skip
    note = designs.decode_note(rows, paths)
    assert "mha, gqa decode with native steps" in note
    assert "sinks (its attention has sinks or a non-default score scale)" in note
    assert "moh (its attention is not the textbook MultiHeadAttention)" in note
    assert "Time a token against mha's: sinks 11.0x, moh 5.5x." in note and "gqa 1.1x" not in note


def test_the_kv_note_says_why_the_two_tables_count_different_bytes():
    from multihead.cost.designs import DesignCost

    cfg = designs.TEXT_QUICK
    rows = [{"design": "mha", "kv_bytes_per_token": 1024, "decode_cached": True},
            {"design": "dcmha", "kv_bytes_per_token": designs.input_bytes_per_token(cfg),
             "decode_cached": False}]  # fmt: skip
    cost = [DesignCost("mha", 1, 1, 4096, True, 1), DesignCost("dcmha", 1, 1, 2048, False, 1)]
    note = designs.kv_note(rows, cfg, cost)
    assert f"{cfg.n_layers} layers at d_model {cfg.d_model} (mha 1,024)" in note
    assert "one attention sub-layer at d_model 512 (mha 4,096)" in note
    assert "dcmha cache no keys or values" in note and "marked (inputs)" in note
    assert designs.input_bytes_per_token(cfg) == cfg.n_layers * cfg.d_model * 4
