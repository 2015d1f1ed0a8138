"""``multihead bench decode`` in-process: every row, finite figures, the HF rows skipped with a reason."""

from __future__ import annotations

import builtins
import json
import math
import re
import sys

import pytest
import torch

from multihead import native, pretrained
from multihead.bench import decode, decode_rows, timing, tokens
from multihead.cli.main import main
from multihead.models import quant

TINY = ["bench", "decode", "--preset", "llama-tiny", "--rounds", "1", "--new-tokens", "3", "--prompt", "8"]


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_row(r: dict) -> None:
    """A rate or "too short to measure"; a fraction of the limit at most 100% or the refusal."""
    assert _finite_positive(r["bytes_per_token"]) and _finite_positive(r["limit_tok_s"]), r
    if r["tok_s"] is None:
        assert r["why_no_rate"].startswith("n/a ("), r
        assert r["fraction_of_limit"] is None
    else:
        lo, hi = r["tok_s_spread"]
        assert 0 < lo <= r["tok_s"] <= hi, r
    x = r["fraction_of_limit"]
    assert x is None or x == "above limit: probe or byte count wrong" or 0 < x <= 1.0, r


def test_every_row_with_finite_figures(capsys, monkeypatch):
    pytest.importorskip("transformers", reason="the HF rows need the test extra (transformers)")
    threads = torch.get_num_threads()
    planned, said, real_run = [], [], decode.run

    def counted(*a, progress, plan, **kw):  # the progress bar's total: a lower bound of its steps
        return real_run(*a, progress=lambda w: (said.append(w), progress(w)), plan=planned.append, **kw)

    monkeypatch.setattr(decode, "run", counted)
    # the call that printed 3000000000.0 tok/s and 33459692% of the limit: no such figure comes back
    assert main([*TINY, "--new-tokens", "4", "--prompt", "16", "--threads", "1", "--json"]) == 0
    assert len(planned) == 1 and 0 < planned[0] <= len(said) - 1  # "building" comes before the plan
    assert torch.get_num_threads() == threads  # the run restores torch's thread count
    doc = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in doc["rows"]] == [name for name, _, _ in decode.ROWS]
    assert doc["threads"] == 1 and doc["skipped"] is None
    assert _finite_positive(doc["read_bandwidth_GBps"])
    assert doc["tokens_identical_fp32"] is True  # same weights, same greedy tokens as transformers
    assert doc["tokens_part_fp32"] is None
    rows = {r["name"]: r for r in doc["rows"]}
    for r in doc["rows"]:
        _check_row(r)
        assert r["vs_hf_fp32"] is None or _finite_positive(r["vs_hf_fp32"]), r
        if r["dtype"] not in ("fp32", "bf16", "fp16"):
            assert r["vs_hf_same_dtype"] is None  # transformers has no int8 row to compare with
    # the native int8 rows: within the stated logit tolerance of fp32 along its greedy tokens; the group
    # scales cost bytes (4 per group: 1/16 of a byte a weight at 64, 1/8 at 32)
    assert set(doc["int8_native"]) == set(decode.INT8_NATIVE)
    assert all(0 < v["logit_error"] <= 0.05 for v in doc["int8_native"].values()), doc["int8_native"]
    per_row, g64, g32 = (rows[k]["bytes_per_token"] for k in decode.INT8_NATIVE)
    assert per_row < g64 < g32 < rows["multihead fp32"]["bytes_per_token"] / 3.5
    # bytes per token: the same weights on both sides (buffers such as rotary tables differ a little);
    # bf16 halves them, int8 weights quarter them (plus fp32 scales and norms)
    for d in ("fp32", "bf16", "fp16"):
        ours, theirs = rows[f"multihead {d}"]["bytes_per_token"], rows[f"HF {d}"]["bytes_per_token"]
        assert ours == pytest.approx(theirs, rel=0.01)
    # the prepacked row reads the same bf16 weights and generates the same tokens as plain bf16
    assert rows["multihead bf16 prepacked"]["bytes_per_token"] == rows["multihead bf16"]["bytes_per_token"]
    assert doc["tokens_identical_prepacked"] is True
    assert doc["bf16_prepacked"] == (quant.bf16_prepack_unavailable() or "oneDNN prepacked")
    # the native rows: the same weights (shared, not copied), the same greedy tokens, the kernel named
    for d in ("fp32", "bf16", "fp16"):
        assert rows[f"multihead {d} native"]["bytes_per_token"] == rows[f"multihead {d}"]["bytes_per_token"]
        assert doc[f"tokens_identical_native_{d}"] is True
    assert rows["multihead fp16"]["bytes_per_token"] == rows["multihead bf16"]["bytes_per_token"]
    why = native.unavailable()
    assert doc["native"].startswith(f"F.linear ({why})" if why else "native, 1 thread(s)")
    fp32 = rows["multihead fp32"]["bytes_per_token"]
    assert rows["multihead bf16"]["bytes_per_token"] == pytest.approx(fp32 / 2, rel=0.02)
    assert 3.0 < fp32 / rows["multihead int8 (fp32 activations)"]["bytes_per_token"] < 4.0


def test_table_names_every_row(capsys):
    pytest.importorskip("transformers", reason="the HF rows need the test extra (transformers)")
    assert main(TINY) == 0
    out = capsys.readouterr().out
    for name, _, _ in decode.ROWS:
        assert name in out
    words = " ".join(out.split())  # the title wraps
    assert "read bandwidth" in words and "identical to transformers" in out
    assert "greedy 8 tokens identical to multihead bf16: yes" in out
    assert "native: " in out and "to multihead bf16: yes" in out


def test_without_transformers_the_hf_rows_are_skipped_with_a_reason(monkeypatch, capsys):
    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ModuleNotFoundError(name)
        return real_import(name, *args, **kwargs)

    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(builtins, "__import__", no_transformers)
    assert main([*TINY, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["impl"] for r in doc["rows"]] == ["multihead"] * 13
    assert "transformers is not installed" in doc["skipped"]
    for r in doc["rows"]:
        _check_row(r)
        assert r["vs_hf_fp32"] is None and r["vs_hf_same_dtype"] is None
    assert main(TINY) == 0
    assert "HF rows skipped: transformers is not installed" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--new-tokens", "1"], r"new_tokens must be .*2"),
        (["--prompt", "1100"], r"exceeds preset 'llama-tiny'.s max_position_embeddings=1024"),
        (["--preset", "gpt-5"], r"invalid choice: 'gpt-5'"),
        (["--rounds", "0"], r"expected an integer >= 1, got '0'"),
    ],
)
def test_bad_arguments_exit_2(extra, match, capsys):
    assert main([*TINY, *extra]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(match, err), err


def test_a_rate_above_its_limit_is_refused_and_noise_is_no_gain():
    # a step of 1 ms reading 1 MB against a 0.5 GB/s limit (500 tok/s) would be 200% of it: refused
    step = timing.Timing(0.003, 0.0029, 0.0031, 9, 1)  # 3 ms for 3 steps: 1000 tok/s
    peer = timing.Timing(0.0032, 0.0028, 0.0036, 9, 1)  # overlapping spread: no gain to report
    steps = {"multihead fp32": step, "HF fp32": peer}
    r = decode_rows.row("multihead fp32", "multihead", "fp32", 10**6, steps, 4, 0.5e9)
    assert r["tok_s"] == pytest.approx(1000.0)
    assert r["fraction_of_limit"] == "above limit: probe or byte count wrong"
    # the limit refused: 500 tok/s is below the 1000 tok/s measured against it (a probe under load)
    assert r["why_no_limit"].startswith("n/a (500 is below a rate measured against it 1000")
    assert "pass --rounds 6" in r["why_no_limit"]
    assert r["vs_hf_fp32"] == pytest.approx(0.0032 / 0.003) and r["vs_hf_fp32_within_noise"] is True
    doc = {"preset": "p", "prompt_len": 1, "new_tokens": 4, "threads": 1, "rounds": 1,
           "read_bandwidth_GBps": 0.5, "rows": [r]}  # fmt: skip
    from rich.console import Console

    console = Console(width=1000, record=True)  # wide: no cell wraps
    console.print(decode.render(doc))
    text = console.export_text()
    assert "above limit: probe or byte count wrong" in text and "same within noise" in text
    assert "200%" not in text and "1.07x" not in text and "500.0" not in text


def _one_row(step, bandwidth, rounds=3):
    steps = {"multihead fp32": step}
    return decode_rows.row("multihead fp32", "multihead", "fp32", 10**6, steps, 4, bandwidth, rounds)


def test_a_busy_machines_limit_below_the_measured_rate_is_refused_not_the_rate():
    # the run that read a limit of 199 tok/s for a model generate ran at 605
    step = timing.Timing(3 / 605, 3 / 620, 3 / 590, 9, 1)
    r = _one_row(step, 199e6, rounds=4)
    assert r["tok_s"] == pytest.approx(605.0) and r["why_no_limit"] is not None
    assert "199 is below a rate measured against it 605" in r["why_no_limit"]
    assert "run on an idle machine, or pass --rounds 8" in r["why_no_limit"]
    assert r["fraction_of_limit"] == timing.ABOVE


def test_a_rate_whose_spread_is_wider_than_ten_times_or_above_its_limit_is_refused():
    wide = timing.Timing(0.003, 0.00001, 0.0031, 9, 1)  # rates 968-300000 tok/s
    r = _one_row(wide, 10e9)
    assert r["tok_s"] is None and "wider than 10x" in r["why_no_rate"]
    assert "pass --new-tokens 16 (more steps a timed call) or --rounds 6" in r["why_no_rate"]
    above = timing.Timing(0.003, 0.0015, 0.0031, 9, 1)  # 1000 tok/s, spread up to 2000 over a 1500 limit
    r = _one_row(above, 1.5e9)
    assert r["why_no_limit"] is None and r["tok_s"] is None
    assert "spread reaches 2000, above the bandwidth limit 1500" in r["why_no_rate"]


def test_tokens_part_where_they_differ_with_the_margin_there():
    torch.manual_seed(0)
    lm = pretrained.random_lm("llama-tiny", seed=0).eval()
    prompt = torch.tensor([[1, 2, 3, 4]])
    ours = lm.generate(prompt, 5)  # (1, 9)
    theirs = ours.clone()
    theirs[0, 6:] = (ours[0, 6:] + 1) % 512  # part at the third new token
    part = tokens.parting(ours, theirs, 4, lm)
    assert part is not None and part["token"] == 3 and part["of"] == 5
    with torch.inference_mode():
        logits = lm(ours[:, :6])[0, -1]  # (vocab,)
    assert part["margin"] == pytest.approx(float(logits[ours[0, 6]] - logits[theirs[0, 6]]), rel=1e-5)
    assert part["margin"] > 0  # greedy chose ours: the reference prefers it
    assert tokens.parting(ours, ours, 4, lm) is None and tokens.parting_text(None) == "yes"
    assert "they part at new token 3 of 5" in tokens.parting_text(part)
    with pytest.raises(ValueError, match="parting needs two generations of one prompt"):
        tokens.parting(ours, ours[:, :5], 4, lm)


def test_help_states_what_the_default_costs_and_probes_group_sizes(capsys):
    assert main(["bench", "decode", "--help"]) == 0
    assert "4 CPU-minutes" in capsys.readouterr().out  # measured; it said "seconds" and took minutes
    assert decode._size_groups([100, 110, 124, 200, 260]) == [[100, 110, 124], [200], [260]]
