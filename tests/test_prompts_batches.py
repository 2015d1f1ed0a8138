"""benchmarks/prompts_batches.py: its rows on a tiny model, llama-bench's JSON read as its prompt rows, and
its argument checks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import prompts_batches


def test_a_tiny_run_gives_every_row_for_every_model(capsys):
    result = prompts_batches.main(
        ["--preset", "llama-tiny", "--lengths", "3", "20", "--batches", "2", "--samples", "1"]
    )
    assert set(result["prompts"]) == {3, 20} and set(result["batches"]) == {2}
    for row in [*result["prompts"].values(), *result["batches"].values()]:
        assert set(row) == {"int8", "fp32", "bf16"} and all(v > 0 for v in row.values())
    out = capsys.readouterr().out
    assert "| 20 |" in out and "| 2 |" in out and "llama.cpp" in out


def test_llama_bench_json_gives_its_prompt_rows():
    out = json.dumps([
        {"n_prompt": 8, "n_gen": 0, "avg_ts": 287.0},
        {"n_prompt": 256, "n_gen": 0, "avg_ts": 588.6},
        {"n_prompt": 0, "n_gen": 32, "avg_ts": 90.0},  # a decode row: not a prompt's
    ])  # fmt: skip
    assert prompts_batches.parse_llama_bench(out) == {8: 287.0, 256: 588.6}


def test_bad_arguments_name_the_fix(capsys):
    with pytest.raises(SystemExit):
        prompts_batches.main(["--samples", "0"])
    assert "--samples must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prompts_batches.main(["--lengths", "0"])
    assert "--lengths and --batches must be at least 1" in capsys.readouterr().err
