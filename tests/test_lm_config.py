"""``LMConfig``: a TransformerLM's shape in one object that the model takes, keeps and a converted
checkpoint stores."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import multihead as mh
from multihead import heads
from multihead.pretrained.llama import PRESETS, llama_kwargs

CFG = mh.LMConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, d_ff=128, n_kv_heads=2, norm_eps=1e-6)


def test_the_config_and_the_keyword_constructor_build_the_same_model():
    torch.manual_seed(0)
    a = mh.TransformerLM(CFG)
    torch.manual_seed(0)
    b = mh.TransformerLM(97, 64, 2, 4, 128, n_kv_heads=2, norm_eps=1e-6)
    assert a.config == b.config == CFG
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.n_kv_heads == 2 and a.head_dim == 16 and a.layers[0].self_attn.n_kv_heads == 2


def test_a_default_n_kv_heads_is_n_heads_and_the_config_is_json_ready():
    cfg = dataclasses.replace(CFG, n_kv_heads=None)
    assert mh.TransformerLM(cfg).n_kv_heads == 4
    text = json.dumps(cfg.to_dict())
    assert mh.LMConfig.from_dict(json.loads(text)) == cfg


def test_every_preset_round_trips_through_its_config():
    for name in ("llama-tiny", "llama-155m"):
        kwargs = llama_kwargs(PRESETS[name])
        cfg = mh.LMConfig(**kwargs)
        assert mh.LMConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg, name


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: mh.TransformerLM(CFG, 64), "d_model"),
        (lambda: mh.TransformerLM(CFG, n_kv_heads=1), "dataclasses.replace"),
        (lambda: mh.TransformerLM(97, 64), "needs vocab_size, d_model"),
        (lambda: mh.TransformerLM(97, 64, 2, 4, 128, n_kv_head=2), "no options ['n_kv_head']"),
        (lambda: mh.TransformerLM(dataclasses.replace(CFG, n_heads=5)), "divisible by n_heads"),
        (lambda: mh.LMConfig.from_dict({**CFG.to_dict(), "heads": 3}), "no fields ['heads']"),
        (lambda: mh.LMConfig.from_dict({"vocab_size": 3}), "missing the required fields"),
        (lambda: mh.LMConfig.from_dict([1, 2]), "needs a dict"),
    ],
)
def test_bad_configs_name_what_is_wrong(build, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        build()


def test_surgery_that_changes_every_layers_kv_heads_updates_the_config():
    model = mh.TransformerLM(dataclasses.replace(CFG, n_kv_heads=None))
    heads.to_gqa(model, 2)
    assert model.config.n_kv_heads == 2 == model.n_kv_heads
    assert model.make_cache(1, 8)[0].k.shape[1] == 2  # the cache follows it


def test_from_hf_refuses_a_multihead_model_that_now_has_a_config():
    with pytest.raises(ValueError, match="already one"):
        mh.pretrained.from_hf(mh.TransformerLM(CFG))


def test_a_converted_checkpoint_stores_the_config_and_refuses_a_base_that_changed(tmp_path):
    base = {"preset": "llama-tiny"}
    model = mh.TransformerLM(**llama_kwargs(PRESETS["llama-tiny"]))
    step = {"to": "gqa", "n_kv_heads": 1, "method": "mean"}
    heads.to_gqa(model, 1)
    folder = heads.save_converted(model, [step], tmp_path / "gqa", base=base)
    meta = json.loads((folder / "surgery.json").read_text())
    assert meta["config"] == model.config.to_dict() and meta["config"]["n_kv_heads"] == 1
    assert heads.load_converted(folder).config == model.config
    meta["config"]["norm_eps"] = 0.5  # what another base would rebuild
    (folder / "surgery.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="records the config"):
        heads.load_converted(folder)
