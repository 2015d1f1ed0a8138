"""The report's key findings are read off the numbers of the sections they link to."""

from __future__ import annotations

from multihead.study.context import Section
from multihead.study.findings import key_findings
from multihead.study.render import render_html
from multihead.study.run import render_markdown


def _sections() -> list[Section]:
    exact = {
        "rows": [
            {"backend": "matrix", "case": "none", "dtype": "float32", "out_ratio": 1.0},
            {"backend": "tiled", "case": "causal", "dtype": "float32", "out_ratio": 1.37},
            {"backend": "sdpa", "case": "none", "dtype": "float32", "out_ratio": 0.9},
        ]
    }
    kv = {
        "rows": [
            {"model": "LLaMA-2-7B", "name": "MHA", "mib": 2048.0},
            {"model": "LLaMA-2-7B", "name": "MQA", "mib": 64.0},
        ]
    }
    designs = {
        "text_lm": {
            "rows": [
                {"design": "mha", "bits_per_byte": 3.5, "kv_bytes_per_token": 4096},
                {"design": "mla", "bits_per_byte": 3.25, "kv_bytes_per_token": 1024},
            ]
        }
    }
    return [
        Section("exactness", "Exactness", exact),
        Section("kv_cache", "KV cache", kv),
        Section("designs", "Head designs", designs),
        Section("minilm", "MiniLM", {"skipped": "not installed"}),
    ]


def test_findings_quote_their_sections_numbers():
    found = dict(key_findings(_sections()))
    assert set(found) == {"exactness", "kv_cache", "designs"}  # a skipped section gives none
    assert "within 1.37x" in found["exactness"] and "tiled, causal" in found["exactness"]
    assert "2,048 MiB" in found["kv_cache"] and "64 MiB with MQA (32x smaller)" in found["kv_cache"]
    assert "is mla (3.250 vs mha 3.500)" in found["designs"] and "4.0x fewer bytes" in found["designs"]


def test_findings_head_the_report_and_link_their_sections():
    sections = _sections()
    md = render_markdown(sections, quick=True)
    assert md.index("## Key findings") < md.index("## Exactness")
    assert "([Exactness](#exactness))" in md and '<a id="exactness"></a>' in md
    page = render_html(sections, "t", "s", key_findings(sections))
    assert page.index('id="key-findings"') < page.index('<section id="exactness">')
    assert page.count("<li>") >= 3 and '<a href="#designs">(Head designs)</a>' in page


def _surgery(mla_pct: float, gqa_pct: float) -> Section:
    def row(model: str, method: str, stage: str, kv: int, pct: float) -> dict:
        return {"model": model, "method": method, "stage": stage, "kv_bytes": kv, "lowest_pct": pct,
                "recover_steps": 6 if stage == "after" else 0}  # fmt: skip

    rows = [
        row("original MiniLM", "original", "original", 18432, 100.0),
        row("GQA-2 aligned", "GQA", "before", 3072, 80.0),
        row("GQA-2 aligned + recover", "GQA", "after", 3072, gqa_pct),
        row("MLA r=256 calibrated", "MLA", "before", 6144, 99.0),  # no GQA of its size: not compared
        row("MLA r=128 calibrated", "MLA", "before", 3072, 85.0),
        row("MLA r=128 calibrated + recover", "MLA", "after", 3072, mla_pct),
    ]
    return Section("heads", "Heads", {"surgery": {"rows": rows}})


def test_heads_finding_compares_mla_and_gqa_at_equal_bytes_after_recovery():
    won = dict(key_findings([_surgery(93.5, 90.25)]))["heads"]
    assert "At equal KV cache (3,072 bytes per token, 6x below MHA)" in won
    assert "MLA r=128 calibrated keeps 93.5% of MiniLM's human-judged score" in won
    assert "more than GQA-2 aligned (90.2%), after 6 recovery steps." in won
    lost = dict(key_findings([_surgery(88.0, 90.0)]))["heads"]
    assert "keeps 88.0%" in lost and "less than GQA-2 aligned (90.0%)" in lost
    skipped = Section("heads", "Heads", {"surgery": {"skipped": "gensim is not installed"}})
    assert key_findings([skipped]) == []


def test_recovery_that_moved_no_shown_score_is_not_credited():
    unmoved = _surgery(85.0, 90.0)  # MLA r=128: 85.0% before and after its 6 steps
    found = dict(key_findings([unmoved]))["heads"]
    assert "after 6 recovery steps" not in found
    assert "the same before and after its 6 recovery steps (they changed no score shown)" in found
    from multihead.study.sections.surgery import SurgerySizes, recovery_effect, surgery_notes

    rows = unmoved.data["surgery"]["rows"]
    assert recovery_effect(rows, rows[-1]) == (
        False, "6 recovery steps changed no score the table shows (85.0% before and after)"
    )  # fmt: skip
    assert recovery_effect(rows, rows[2]) == (True, "after 6 recovery steps (lowest 80.0% before them)")
    notes = surgery_notes(rows, SurgerySizes((2,), (128,), (), 6, True, 8, 2, 16, None), 1.0)
    assert "MLA r=128 calibrated: 6 recovery steps changed no score the table shows" in notes[-1]
    assert "its 6 recovery steps changed no score" in notes[1] and "after recovery" not in notes[1]


def test_performance_finding_reads_the_sections_results_and_their_noise():
    rows = [
        {"method": "auto", "ms": 1.0, "vs": {"sdpa": 0.5}, "vs_noise": {"sdpa": False}},
        {"method": "auto", "ms": 1.0, "vs": {"sdpa": 1.05}, "vs_noise": {"sdpa": True}},
        {"method": "sdpa", "ms": 1.0, "vs": {"auto": 2.0}},
    ]
    found = dict(key_findings([Section("performance", "Performance", {"results": rows})]))
    assert "median over 2 cases" in found["performance"]
    assert "1 of them the same within noise" in found["performance"]
