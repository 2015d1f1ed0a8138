"""mh.pretrained.to_hf: a multihead TransformerLM back to transformers (LLaMA family, GPT-2), with the
config edited after head surgery, saved and reloaded by plain transformers."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is the target of to_hf")

import multihead as mh  # noqa: E402

VOCAB = 97


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread avoids contention on a busy machine; restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _hf(kind: str):
    T = transformers
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        initializer_range=0.1,
    )
    configs = {
        "llama": lambda: T.LlamaConfig(**common, num_key_value_heads=2),
        "mistral": lambda: T.MistralConfig(**common, num_key_value_heads=2, sliding_window=5),
        "qwen2": lambda: T.Qwen2Config(**common, num_key_value_heads=2),
        "gpt2": lambda: T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    }
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(configs[kind](), attn_implementation="eager").eval()


def _ids():
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gpt2"])
def test_round_trip_logits_equal(kind, tmp_path):
    hf = _hf(kind)
    lm = mh.pretrained.from_hf(hf)
    back = mh.pretrained.to_hf(lm)
    assert type(back) is type(hf)
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
        got = back(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    back.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, atol=1e-5, rtol=1e-5)


def test_after_to_gqa_hf_runs_with_the_new_kv_heads(tmp_path):
    hf = _hf("llama")
    lm = mh.heads.to_gqa(mh.pretrained.from_hf(hf), 1)
    back = mh.pretrained.to_hf(lm)
    assert back.config.num_key_value_heads == 1
    assert back.model.layers[0].self_attn.k_proj.weight.shape == (8, 32)  # one kv head of dim 8
    ids = _ids()
    with torch.no_grad():
        want = lm(ids)
        torch.testing.assert_close(back(ids).logits, want, atol=1e-5, rtol=1e-5)
    back.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.num_key_value_heads == 1
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, atol=1e-5, rtol=1e-5)


def test_after_uniform_prune_hf_gets_the_new_head_count():
    hf = _hf("gpt2")
    lm = mh.heads.prune(mh.pretrained.from_hf(hf), {0: [1], 1: [3]})
    with pytest.raises(ValueError, match="GPT-2"):  # GPT-2 needs n_heads * head_dim = d_model
        mh.pretrained.to_hf(lm)
    hf = _hf("llama")
    lm = mh.heads.prune(mh.pretrained.from_hf(hf), {0: [0, 1], 1: [2, 3]})
    back = mh.pretrained.to_hf(lm)
    assert back.config.num_attention_heads == 2 and back.config.head_dim == 8
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, lm(ids), atol=1e-5, rtol=1e-5)


def test_uneven_prune_and_other_models_are_refused():
    lm = mh.heads.prune(mh.pretrained.from_hf(_hf("llama")), {0: [0, 1]})
    with pytest.raises(ValueError, match="different") as e:
        mh.pretrained.to_hf(lm)
    a0, a1 = lm.layers[0].self_attn, lm.layers[1].self_attn
    assert f"layer 1: {a1.n_heads}/{a1.n_kv_heads}/{a1.head_dim}" in str(e.value)  # every layer's counts
    assert f"layer 0: {a0.n_heads}/" in str(e.value) and "per_layer_config" in str(e.value)
    with pytest.raises(ValueError, match="TransformerLM"):
        mh.pretrained.to_hf(torch.nn.Linear(2, 2))
    # the reason holds: transformers' LLaMA modeling code does not take per-layer head counts from its config
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8)
    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    try:
        cfg = transformers.LlamaConfig(**small, **heads, per_layer_config={0: {"num_attention_heads": 2}})
        built = transformers.AutoModelForCausalLM.from_config(cfg)
    except Exception:  # refused (transformers 5.x), or no per-layer configs at all
        return
    assert [a.self_attn.q_proj.out_features for a in built.model.layers] == [32, 32]  # ignored, not honoured


def test_bert_round_trip(tmp_path):
    T = transformers
    cfg = T.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    hf = T.BertModel(cfg).eval()
    enc = mh.pretrained.from_hf(hf)
    back = mh.pretrained.to_hf(enc)
    ids = _ids()
    am = torch.ones_like(ids)
    am[1, -3:] = 0
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=am).last_hidden_state
        got = back(input_ids=ids, attention_mask=am).last_hidden_state
    real = am.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    back.save_pretrained(tmp_path)
    loaded = T.AutoModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids, attention_mask=am).last_hidden_state[real], want[real]
        )
