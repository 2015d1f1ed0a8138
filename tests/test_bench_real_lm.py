"""The real-LM cost table's rows (multihead.bench.real_lm) on a tiny random GQA model with SmolLM2's
tokenizer: every row builds and scores, the KV bytes are the cache's, and the rows that cannot change the
function at these sizes (a window, top-k or rank covering every key) score what fp32 scores."""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from multihead.bench import real_lm

from . import smollm2_oracle

L, D, HQ, HKV = 2, 64, 6, 3
TINY = real_lm.Settings(
    texts=2, chars=400, context=64, stride=32, prompts=1, prompt_chars=120, new_tokens=4,
    calibration=(2, 32), recover_minutes=None, recover_steps=2, recover_sequences=8, recover_tokens=32,
    bootstrap=20,
)  # fmt: skip


#: every row without recovery, and one with it (the +rec rows share one build around recover)
NAMES = [n for n in real_lm.ROWS if not n.endswith("+rec")] + ["mla-48+rec"]


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    why = smollm2_oracle.missing("gensim")
    if why:
        pytest.skip(f"the real-LM rows need SmolLM2's tokenizer and the Wikipedia text: {why}")
    smollm2 = smollm2_oracle.pair()[0]
    torch.manual_seed(0)
    lm = mh.TransformerLM(smollm2.vocab_size, HQ * D, L, HQ, 256, n_kv_heads=HKV).eval()
    lm.tokenizer, lm.eos_token_ids = smollm2.tokenizer, []
    return {r["row"]: r for r in real_lm.measure(NAMES, TINY, base=lm, log=lambda line: None)}


def test_every_row_scores(rows):
    assert list(rows) == NAMES and all(f"{n}+rec" in real_lm.ROWS for n in ("gqa-1", "mla-80", "prune-group"))
    for r in rows.values():
        assert math.isfinite(r["perplexity"]) and r["low"] <= r["perplexity"] <= r["high"], r
        assert 0 <= r["greedy_same"] <= 1 and r["tokens"] == rows["fp32"]["tokens"]
    assert rows["fp32"]["greedy_same"] == 1


def test_kv_bytes_are_the_caches():
    fp32 = 2 * HKV * D * 4 * L
    assert fp32 == real_lm.kv_bytes(mh.TransformerLM(10, HQ * D, L, HQ, 64, n_kv_heads=HKV))


def test_kv_bytes_of_each_row(rows):
    fp32 = 2 * HKV * D * 4 * L
    want = {"fp32": fp32, "bf16": fp32 // 2, "gqa-1": fp32 // 3, "mla-48": (48 + HKV * 16) * 4 * L,
            "mla-80": (80 + HKV * 16) * 4 * L, "prune-group": fp32 * 2 // 3, "prune-3": fp32,
            "mla-48+rec": (48 + HKV * 16) * 4 * L, "window-64": fp32}  # fmt: skip
    assert {k: rows[k]["kv_bytes_per_token"] for k in want} == want
    assert rows["kv-int8"]["kv_bytes_per_token"] < fp32 // 3  # int8 values and a scale per token and head


def test_rows_covering_every_key_score_what_fp32_scores(rows):
    """The windows are at most the context (64): a window of 64 or 256, the top 64 keys, a rank of 128
    keep every key (or the whole weight matrix), so they are the exact function up to rounding."""
    for name in ("window-64", "window-256", "sinks-window-64", "sinks-window-256", "topk-64", "lowrank-128"):
        assert rows[name]["perplexity"] == pytest.approx(rows["fp32"]["perplexity"], rel=1e-4), name
    assert rows["topk-16"]["perplexity"] != pytest.approx(rows["fp32"]["perplexity"], rel=1e-6)


def test_recovered_rows_took_steps(rows):
    for name in (n for n in NAMES if n.endswith("+rec")):
        assert rows[name]["recover_steps"] == 2 and rows[name]["recover_sequences"] == 8, name


def test_table_and_bad_rows(rows):
    text = real_lm.table(list(rows.values()))
    assert all(r["what"] in text for r in rows.values()) and "(3.0x less)" in text
    with pytest.raises(ValueError, match="rows must be names"):
        real_lm.measure(["fp64"], TINY, base=torch.nn.Linear(1, 1))
