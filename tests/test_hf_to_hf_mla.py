"""mh.pretrained.to_hf of a LLaMA-family model converted by mh.heads.to_mla: a DeepSeek-V3 checkpoint that
plain transformers loads, with our logits (fp32, 1e-4) and greedy tokens; and the refusals that say why."""

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


def _lm(kind: str, n_kv_heads: int = 2, **extra) -> mh.TransformerLM:
    """A tiny random transformers model of ``kind`` through from_hf (Qwen2 with non-zero q/k/v biases)."""
    T = transformers
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=n_kv_heads, max_position_embeddings=64, initializer_range=0.1, **extra,
    )  # fmt: skip
    config = {"llama": T.LlamaConfig, "mistral": T.MistralConfig, "qwen2": T.Qwen2Config}[kind](**common)
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(config).eval()
    if kind == "qwen2":  # transformers initialises the biases to zero: make them matter
        with torch.no_grad():
            for layer in hf.model.layers:
                a = layer.self_attn
                for proj in (a.q_proj, a.k_proj, a.v_proj):
                    proj.bias.normal_(0, 0.3)
    lm = mh.pretrained.from_hf(hf)
    assert isinstance(lm, mh.TransformerLM)
    return lm


def _ids(B=2, N=12, seed=1):
    return torch.randint(0, VOCAB, (B, N), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("kind", "n_kv_heads", "rope_dims"),
    [("llama", 2, None), ("llama", 1, 8), ("mistral", 4, 4), ("qwen2", 2, 6)],
)
def test_converted_lm_round_trips_through_transformers(kind, n_kv_heads, rope_dims, tmp_path):
    lm = _lm(kind, n_kv_heads, **({"sliding_window": None} if kind == "mistral" else {}))
    ids = _ids()
    mla = mh.heads.to_mla(lm, 20, rope_dims, calibration=ids, rope_select="disjoint").eval()
    hf = mh.pretrained.to_hf(mla)
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    c = hf.config
    assert c.first_k_dense_replace == c.num_hidden_layers == 2 and c.qk_rope_head_dim == 16  # D = 64 / 4
    assert c.kv_lora_rank == 21  # the latent and its constant channel
    assert c.q_lora_rank == (65 if kind == "qwen2" else None)  # the query bias through q_a_proj
    hf.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # plain transformers
    with torch.no_grad():
        ours = mla(ids)  # (2, 12, V)
        torch.testing.assert_close(loaded(ids).logits, ours, atol=1e-4, rtol=0)
        prompt = ids[:, :5]
        loaded.generation_config.eos_token_id = None  # the config's default eos (1) would stop a row early
        loaded.generation_config.pad_token_id = 0
        want = mla.generate(prompt, 10)  # greedy
        got = loaded.generate(
            prompt, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt)
        )
    assert torch.equal(got, want)
    back = mh.pretrained.load(tmp_path)  # and multihead reads the DeepSeek-V3 checkpoint back
    with torch.no_grad():
        torch.testing.assert_close(back(ids), ours, atol=1e-4, rtol=0)


def test_shared_frequencies_are_refused_with_the_representable_option():
    lm = _lm("llama", 2)
    mla = mh.heads.to_mla(lm, 20, 8, rope_select="high")  # both kv heads keep pairs 0 .. 3
    with pytest.raises(ValueError, match=r"rotary pairs \[0, 1, 2, 3\] are kept by more than one kv head"):
        mh.pretrained.to_hf(mla)
    with pytest.raises(ValueError, match="rope_select='disjoint'"):
        mh.pretrained.to_hf(mla)


def test_disjoint_selection_keeps_each_pair_once_and_needs_room():
    lm = _lm("llama", 4)  # D = 16: 8 pairs for 4 kv heads
    mla = mh.heads.to_mla(lm, 20, 4, rope_select="disjoint")
    pairs = mla.layers[0].self_attn.rotary.pairs  # (4, 2)
    assert pairs.shape == (4, 2) and pairs.flatten().unique().numel() == 8
    assert mh.heads.to_mla(lm, 20, rope_select="disjoint").layers[0].self_attn.rope_dims == 4  # D / Hkv
    with pytest.raises(ValueError, match=r"kv heads x rope_dims = 4 x 6 must be <= the head dim 16"):
        mh.heads.to_mla(lm, 20, 6, rope_select="disjoint")


def test_sliding_window_and_absolute_positions_are_refused():
    lm = _lm("mistral", 2, sliding_window=5)
    with pytest.raises(ValueError, match="sliding window of 5 tokens"):
        mh.pretrained.to_hf(mh.heads.to_mla(lm, 20, rope_select="disjoint"))
    gpt2 = mh.pretrained.from_hf(
        transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4)
        )
    )
    with pytest.raises(ValueError, match="rotary positions only"):
        mh.pretrained.to_hf(mh.heads.to_mla(gpt2, 16))


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_a_deepseek_v3_model_round_trips(q_lora_rank):
    T = transformers
    config = T.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, first_k_dense_replace=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, max_position_embeddings=64,
        initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # non-trivial latent norms
        for layer in hf.model.layers:
            layer.self_attn.kv_a_layernorm.weight.uniform_(0.5, 1.5)
    back = mh.pretrained.to_hf(mh.pretrained.from_hf(hf))  # the latent norm and the rotary map as they are
    assert back.config.kv_lora_rank == 16 and back.config.q_lora_rank == q_lora_rank
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)
