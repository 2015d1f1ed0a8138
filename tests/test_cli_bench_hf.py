"""``multihead bench hf``: a tiny run (N=256, one round, 4 decode tokens) through the CLI; every
implementation appears with finite numbers (or, for flex_attention, the reason it did not run), and the
decode rows agree token for token. No timed assertions: the speed goals live in BENCHMARKS.md."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

pytest.importorskip("transformers", reason="multihead bench hf measures models built with transformers")

from multihead.bench.hf import IMPLS
from multihead.cli.main import main

TINY = ["bench", "hf", "--lengths", "256", "--repeats", "1", "--new-tokens", "4", "--prompt", "32"]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.fixture(scope="module")
def doc():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([*TINY, "--json"]) == 0
    return json.loads(buf.getvalue())


def test_json_has_every_impl_with_finite_numbers(doc):
    rows = {r["impl"]: r for r in doc["prefill"]}
    assert set(rows) == set(IMPLS)
    for impl, r in rows.items():
        assert r["n"] == 256
        if impl == "flex_attention" and r["seconds"] is None:  # refused on this machine: say why
            assert r["note"], r
            continue
        assert r["note"] is None, r
        assert _finite(r["seconds"]) and r["seconds"] > 0
        assert _finite(r["speed_vs_sdpa"]) and r["speed_vs_sdpa"] > 0
        assert r["peak_mib"] is None or _finite(r["peak_mib"])  # None off Linux
        assert _finite(r["max_abs_diff"]) and r["max_abs_diff"] < 1e-4  # fp32, same weights as sdpa
    assert rows["sdpa"]["speed_vs_sdpa"] == 1.0 and rows["sdpa"]["max_abs_diff"] == 0.0
    assert rows["multihead"]["calls"] == 2  # both layers ran through multihead's attention function
    assert rows["sdpa"]["calls"] == 0


def test_decode_rows_agree_token_for_token(doc):
    d = doc["decode"]
    assert (d["prompt"], d["new_tokens"]) == (32, 4)
    rows = {r["impl"]: r for r in d["rows"]}
    assert set(rows) == {"multihead", "sdpa"}
    assert all(_finite(r["tok_s"]) and r["tok_s"] > 0 and _finite(r["vs_sdpa"]) for r in rows.values())
    assert d["tokens_identical"] is True
    assert rows["multihead"]["calls"] == 4 * 2  # 4 tokens: the prefill and 3 decode steps, 2 layers each


def test_eager_above_the_cap_is_skipped_with_a_reason_and_the_floor_row(capsys):
    argv = ["bench", "hf", "--lengths", "128", "--repeats", "1", "--new-tokens", "0"]
    assert main([*argv, "--impls", "multihead,eager", "--eager-cap", "64", "--floor"]) == 0
    out = capsys.readouterr().out
    assert "skipped: N > 64" in out
    for impl in ("multihead", "sdpa", "eager", "floor (no attention)"):
        assert impl in out
    assert "decode" not in out  # --new-tokens 0 skips the decode table


def test_bad_arguments_exit_2(capsys):
    assert main(["bench", "hf", "--lengths", "0"]) == 2
    assert "positive lengths" in capsys.readouterr().err
    assert main(["bench", "hf", "--impls", "sdpa,nope"]) == 2
    assert "flex_attention" in capsys.readouterr().err
