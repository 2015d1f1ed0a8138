"""The command line: ``multihead study`` and ``multihead explain``, in-process and as ``python -m``."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import multihead as mh
from multihead.cli.main import main, parse_mask
from tests.numerics import allowed


@pytest.fixture(scope="module")
def study_json(tmp_path_factory) -> dict:
    """One in-process run of ``multihead study --json --out DIR`` shared by the tests below."""
    out = tmp_path_factory.mktemp("study")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["study", "--json", "--out", str(out)])
    assert code == 0
    report = json.loads(buf.getvalue())
    report["_out"] = out
    return report


def test_study_json_every_backend_within_the_numerics_rule(study_json):
    rows = study_json["sections"]["exactness"]["rows"]
    workload = study_json["sections"]["exactness"]["workload"]
    for case in workload["cases"]:  # prefill-sized: every backend but decode (at most 16 query rows)
        assert {r["backend"] for r in rows if r["case"] == case} == set(mh.backends()) - {"decode"}
    for case in workload["decode_cases"]:  # decode-shaped: decode measured on its own kernel
        assert {r["backend"] for r in rows if r["case"] == case} == set(mh.backends())
    assert len(rows) == len(workload["cases"]) * (len(mh.backends()) - 1) + len(
        workload["decode_cases"]
    ) * len(mh.backends())
    for r in rows:
        assert r["out_err"] <= allowed(r["matrix_out_err"]), r
        assert r["grad_err"] <= allowed(r["matrix_grad_err"], grad=True), r
        assert r["auto"] in mh.backends()


def test_study_json_walk_rows_are_positive(study_json):
    walk = study_json["sections"]["walk"]
    assert walk["config"] == {"d_model": 512, "n_heads": 8, "d_ff": 2048, "seq_len": 1024}
    for phase in ("prefill", "decode"):
        rows = walk[phase]
        assert len(rows) == 15
        assert all(r["bytes"] > 0 for r in rows)
        assert all(r["flops"] > 0 and r["intensity"] > 0 for r in rows if r["name"] != "concat heads")
    decode_q = next(r for r in walk["decode"] if r["name"] == "Q = X W^Q")
    assert decode_q["intensity"] == pytest.approx(0.5, rel=0.02)  # fp32, batch 1: memory-bound


def test_study_json_kv_cache(study_json):
    rows = study_json["sections"]["kv_cache"]["rows"]
    llama = [r for r in rows if r["model"].startswith("LLaMA")]
    assert [(r["name"], r["mib"]) for r in llama] == [("MHA", 2048.0), ("GQA-8", 512.0), ("MQA", 64.0)]


def test_study_writes_report(study_json):
    text = (study_json["_out"] / "report.md").read_text()
    assert study_json["report"].endswith("report.md")
    for heading in (
        "## Exactness",
        "## The layer, eq. (1)-(13)",
        "## KV cache",
        "## Performance against peers",
    ):
        assert heading in text
    assert "| (11) | U = T3 W1 (FFN up) |" in text
    page = (study_json["_out"] / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<td>U = T3 W1 (FFN up)</td>" in page
    for fig in study_json["figures"]:  # every figure is a PNG the page shows
        assert Path(fig).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f'src="{fig.rsplit("/", 1)[-1]}"' in page and f"]({fig.rsplit('/', 1)[-1]})" in text
    names = {f.rsplit("/", 1)[-1] for f in study_json["figures"]}
    assert {"walk-intensity.png", "roofline.png", "kv-cache.png", "performance.png"} <= names


def test_study_roofline_places_decode_on_the_memory_roof(study_json):
    roof = study_json["sections"]["walk"]["roofline"]
    assert roof["peak_gflops"] > 0 and roof["bandwidth_gbps"] > 0
    assert all(p["bound"] == "memory" for p in roof["points"]["decode B=1"])  # seed 001 §2.3
    b64 = {p["name"]: p for p in roof["points"]["decode B=64"]}
    assert b64["S = Q K^T"]["intensity"] < 1 and b64["Q = X W^Q"]["intensity"] > 20  # batching helps W only


def test_study_performance_rows_are_measured(study_json):
    perf = study_json["sections"]["performance"]
    auto = [r for r in perf["results"] if r["method"] == "auto"]
    assert {r["family"] for r in auto} >= {"causal", "window", "documents", "decode"}
    for r in auto:  # measured times and ratios against peers run in the same study
        assert r["ms"] > 0 and r["gflops"] > 0 and "sdpa" in r["vs"] and r["vs"]["sdpa"] > 0


def test_explain_mentions_chosen_backend(capsys):
    assert main(["explain", "--mask", "causal", "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert "auto -> " in out
    chosen = out.split("auto -> ")[1].split(":")[0]
    assert chosen in mh.backends()
    assert "causal()  (Nq=16, Nk=16)" in out  # the mask picture
    assert "(13)" in out and "H = LayerNorm(T5)" in out  # the walk table


def test_explain_json_decode_gqa(capsys):
    args = [
        "explain",
        "--json",
        "--heads",
        "8",
        "--kv-heads",
        "2",
        "--phase",
        "decode",
        "--mask",
        "sliding:4",
    ]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["backend"] in mh.backends()
    assert "Hq=8 Hkv=2 Nq=1 Nk=1024" in doc["explain"]
    assert doc["mask"].splitlines()[-1] == ". " * 12 + "# # # #"  # the one decode row sees its last 4 keys
    assert "drawn at 1x16 (the problem is 1x1024)" in doc["mask"]
    scores = next(r for r in doc["walk"] if r["name"] == "S = Q K^T")
    assert "1x2x64x1024" in scores["in_shape"]


@pytest.mark.parametrize("command", [[], ["study"], ["explain"]])
def test_help_exits_zero(command, capsys):
    assert main([*command, "--help"]) == 0
    assert "usage: multihead" in capsys.readouterr().out


def test_no_command_prints_help_and_version(capsys):
    assert main([]) == 0
    assert "study" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert mh.__version__ in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["explain", "--heads", "8", "--kv-heads", "3"], r"query heads Hq \(8\) must be divisible"),
        (["explain", "--mask", "diagonal"], r"unknown mask 'diagonal'"),
        (["explain", "--seq", "0"], r"expected an integer >= 1, got '0'"),
        (["bogus"], r"invalid choice: 'bogus'"),
    ],
)
def test_errors_exit_2_with_message(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(match, err), err


def test_parse_mask():
    assert parse_mask("none") is None
    assert repr(parse_mask("causal")) == "causal()"
    assert repr(parse_mask("sliding:64")) == "sliding_window(64)"
    assert repr(parse_mask("prefix:3")) == "prefix_lm(3)"
    with pytest.raises(ValueError, match="sliding_window size must be an int >= 1"):
        parse_mask("sliding:0")
    with pytest.raises(ValueError, match=r"unknown mask 'sliding:'"):
        parse_mask("sliding:")


def test_python_m_multihead_study_quick(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "multihead", "study", "--quick", "--only", "exactness,walk,kv_cache"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    for title in ("Exactness", "The layer, eq. (1)-(13)", "KV cache: MHA vs GQA vs MQA"):
        assert title in proc.stdout
    assert "Traceback" not in proc.stderr


# -- multihead explain --preset / --hf: a whole model's cost ------------------------------------------
def test_explain_preset_llama_prefill_tables(capsys):
    assert main(["explain", "--preset", "llama-7b", "--seq", "2048"]) == 0
    out = capsys.readouterr().out
    assert "llama-7b: 32 x d 4096, 32 heads of 128" in out
    assert "shape walk: llama-7b" in out and "Xn[1x2048x4096] @ W^Q[4096x4096]" in out
    assert "layer x32" in out and "G = T3 W1 (FFN gate)" in out and "logits = Hf W_out" in out
    for what in ("weights", "activations", "attention scores", "KV cache"):
        assert what in out
    assert "causal()  (Nq=16, Nk=16)" in out  # the mask in use, drawn small


def test_explain_preset_json_decode_sliding_window(capsys):
    argv = ["explain", "--preset", "mistral-7b", "--seq", "8192", "--phase", "decode", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["call"]["Nq"] == 1 and doc["call"]["Nk"] == 4096  # the sliding cache holds the window
    assert doc["memory"]["KV cache"] == 512 * 2**20
    assert doc["backend"] in mh.backends()
    assert doc["flops"] == pytest.approx(sum(r["flops"] * r["count"] for r in doc["rows"]))
    scores = next(r for r in doc["rows"] if r["name"] == "S = Q K^T")
    assert "1x8x128x4096" in scores["in_shape"] and scores["count"] == 32
    assert "sliding_window(4096)" in doc["masks"][0]
    assert doc["masks"][1].splitlines()[-1] == ". " * 8 + "# # # # # # # #"  # drawn to scale


def test_explain_preset_roof_places_every_row(capsys, tmp_path):
    png = tmp_path / "roof.png"
    argv = ["explain", "--preset", "gpt2", "--roof", "100:10", "--plot", str(png), "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["call"]["seq_len"] == 1024 and doc["call"]["dtype"] == "float32"
    assert doc["roof"]["ridge"] == pytest.approx(10.0)
    assert len(doc["roofline"]) == len(doc["rows"])
    assert {p["bound"] for p in doc["roofline"]} == {"memory", "compute"}  # prefill at B=1 has both
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and doc["plot"] == str(png)


def test_explain_preset_bert_defaults_to_its_positions(capsys):
    assert main(["explain", "--preset", "bert-base", "--phase", "prefill"]) == 0
    out = capsys.readouterr().out
    assert "Nq=512 new rows" in out  # default seq: min(1024, max_position_embeddings)
    assert "X = E + P + T" in out and "mask: none" in out


def test_explain_hf_dir_reads_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(mh.cost.PRESETS["minilm"]))
    assert main(["explain", "--hf", str(tmp_path), "--seq", "128", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["params"] == mh.cost.preset("minilm").params
    assert doc["call"]["Nk"] == 128


def test_explain_roof_measure_uses_the_bench_probes(monkeypatch, capsys):
    import multihead.cost.machine as bm

    monkeypatch.setattr(bm, "machine_rates", lambda dtypes: {next(iter(dtypes)): 80.0, "bandwidth": 8.0})
    argv = ["explain", "--preset", "llama-tiny", "--phase", "decode", "--roof", "measure"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ridge 10.0 FLOP/B" in out and "memory" in out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["explain", "--preset", "llama-70b"], r"unknown preset 'llama-70b'; choose one of"),
        (["explain", "--preset", "gpt2", "--seq", "2048"], r"max_len=1024; use seq_len <= 1024"),
        (["explain", "--preset", "gpt2", "--heads", "4"], r"--heads describe a single attention problem"),
        (["explain", "--preset", "gpt2", "--roof", "fast"], r"--roof must be 'measure' or GFLOPS:GBPS"),
        (["explain", "--cached", "3"], r"--cached, --roof and --plot need a model: add --preset"),
        (["explain", "--hf", "/nonexistent/dir"], r"'/nonexistent/dir' does not exist"),
        (["explain", "--preset", "gpt2", "--hf", "x"], r"argument --hf: not allowed with argument --preset"),
        (["explain", "--preset", "gpt2", "--cached", "-1"], r"argument --cached: expected an integer >= 0"),
    ],
)
def test_explain_model_errors_exit_2(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(match, err), err


def test_study_only_runs_the_named_sections(tmp_path, capsys):
    assert main(["study", "--json", "--only", "walk, kv_cache", "--out", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc["sections"]) == ["walk", "kv_cache"]
    assert main(["study", "--only", "walkk", "--out", str(tmp_path)]) == 2
    assert "unknown study section(s) ['walkk']; choose from exactness,walk" in capsys.readouterr().err
