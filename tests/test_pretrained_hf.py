"""Hugging Face interop: BERT, GPT-2, LLaMA, Mistral, Qwen2 through multihead give transformers' numbers.

Each model is a small random-weight config built offline (fp32, eval). Norm weights and biases are
randomised too, so a swapped or dropped mapping shows up in the logits.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.models.padding import left_pad
from tests.numerics import max_err

tf = pytest.importorskip(
    "transformers", reason="the parity oracles need the test extra: pip install -e '.[oracles]'"
)

# The fixed tolerances (issue 4, "Done means"): logits within 1e-4, 24 greedy tokens identical.
LOGIT_TOL = 1e-4
GREEDY_TOKENS = 24
V = 97
COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
WINDOW = 16  # Mistral's sliding window; every test sequence runs past it


def configs() -> dict:
    return {
        "gpt2": tf.GPT2Config(
            vocab_size=V,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=128,
            bos_token_id=None,
            eos_token_id=None,
        ),
        "llama": tf.LlamaConfig(**COMMON),
        "llama-tied-bias": tf.LlamaConfig(**COMMON, tie_word_embeddings=True, attention_bias=True),
        "mistral": tf.MistralConfig(**COMMON, sliding_window=WINDOW),
        "qwen2": tf.Qwen2Config(**COMMON, tie_word_embeddings=True),
    }


def hf_model(name: str, impl: str = "sdpa", seed: int = 0, **overrides):
    """A random-weight transformers model with randomised norms and biases."""
    config = configs()[name]
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or ".ln_" in n:
                p.normal_(1.0 if n.endswith("weight") else 0.0, 0.2)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def ids_of(B: int, N: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, N), generator=torch.Generator().manual_seed(seed))


# -- decoder-only models -----------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "llama-tied-bias", "mistral", "qwen2"])
def test_logits_match_transformers(name, impl):
    hf = hf_model(name, impl)
    ours = mh.pretrained.from_hf(hf)
    assert isinstance(ours, mh.TransformerLM)
    ids = ids_of(2, 3 * WINDOW)  # past Mistral's window
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    assert max_err(got, ref) <= LOGIT_TOL


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "qwen2"])
def test_greedy_generation_is_token_identical_to_transformers(name):
    hf = hf_model(name)
    ours = mh.pretrained.from_hf(hf)
    prompt = ids_of(2, 9)
    ref = hf.generate(prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=0)
    assert ref.shape == (2, 9 + GREEDY_TOKENS)
    assert torch.equal(ours.generate(prompt, GREEDY_TOKENS), ref)


@pytest.mark.parametrize("name", ["gpt2", "qwen2"])
def test_left_padded_batched_generation_matches_transformers(name):
    hf = hf_model(name)
    ours = mh.pretrained.from_hf(hf)
    prompts = [ids_of(1, n, seed=n)[0].tolist() for n in (11, 4, 7)]
    ids, mask = left_pad(prompts, pad_id=0)
    ref = hf.generate(ids, attention_mask=mask.long(), max_new_tokens=GREEDY_TOKENS, pad_token_id=0)
    assert torch.equal(ours.generate(ids, GREEDY_TOKENS, attention_mask=mask), ref)


def test_mistral_past_its_window_with_a_sliding_cache():
    hf = hf_model("mistral")
    ours = mh.pretrained.from_hf(hf)
    assert ours.sliding_window == WINDOW
    prompt = ids_of(1, WINDOW + 5)
    ref = hf.generate(prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False)
    assert torch.equal(ours.generate(prompt, GREEDY_TOKENS, cache="sliding"), ref)
    # the window matters: the same weights without it give other logits past position WINDOW
    full = mh.pretrained.from_hf(hf_model("mistral", sliding_window=None))
    ids = ids_of(1, 3 * WINDOW)
    with torch.no_grad():
        assert max_err(ours(ids)[:, :WINDOW], full(ids)[:, :WINDOW]) <= LOGIT_TOL
        assert max_err(ours(ids)[:, WINDOW:], full(ids)[:, WINDOW:]) > 10 * LOGIT_TOL


def test_qwen2_biases_sit_on_q_k_v_only():
    ours = mh.pretrained.from_hf(hf_model("qwen2"))
    attn = ours.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    assert ours.layers[0].ffn.w1.bias is None
    assert ours.lm_head.weight is ours.embed.weight  # tie_word_embeddings=True


def test_save_pretrained_directory_loads_through_safetensors(tmp_path):
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = mh.pretrained.load(tmp_path)
    ids = ids_of(1, 20)
    with torch.no_grad():
        assert max_err(ours(ids), hf(ids).logits) <= LOGIT_TOL


# -- BERT ------------------------------------------------------------------------------------------------
def bert_pair(seed: int = 0):
    config = tf.BertConfig(
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    hf = tf.BertModel._from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "LayerNorm" in n:
                p.normal_(1.0 if n.endswith("weight") else 0.0, 0.2)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.1)
    return hf, mh.pretrained.from_hf(hf)


def test_bert_right_padded_batch_matches_transformers():
    hf, ours = bert_pair()
    assert isinstance(ours, mh.pretrained.Bert) and isinstance(ours.encoder, mh.Encoder)
    ids = ids_of(3, 23)
    lengths = torch.tensor([23, 17, 5])
    mask = torch.arange(23)[None, :] < lengths[:, None]  # (3, 23) right padding
    types = (torch.arange(23)[None, :] >= lengths[:, None] // 2).long()  # two segments per row
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=types)
        got = ours(ids, attention_mask=mask, token_type_ids=types)
    assert max_err(got[mask], ref.last_hidden_state[mask]) <= LOGIT_TOL
    assert max_err(ours.pool(got), ref.pooler_output) <= LOGIT_TOL


def test_bert_packed_rows_equal_each_sequence_alone():
    hf, ours = bert_pair()
    a, b = ids_of(1, 9, seed=2), ids_of(1, 6, seed=3)
    packed = torch.cat([a, b], dim=1)  # (1, 15): two documents in one row
    doc = torch.tensor([[0] * 9 + [1] * 6])
    with torch.no_grad():
        got = ours(packed, document_ids=doc)
        assert max_err(got[:, :9], hf(input_ids=a).last_hidden_state) <= LOGIT_TOL
        assert max_err(got[:, 9:], hf(input_ids=b).last_hidden_state) <= LOGIT_TOL


# -- errors ----------------------------------------------------------------------------------------------
def test_unsupported_models_and_mismatched_weights_raise():
    with pytest.raises(ValueError, match=r"model_type 't5' is not supported; supported: \['bert'"):
        mh.pretrained.from_hf_state_dict({}, {"model_type": "t5"})
    with pytest.raises(ValueError, match="from_hf expects a transformers model"):
        mh.pretrained.from_hf(torch.nn.Linear(2, 2))
    hf = hf_model("llama")
    sd = hf.state_dict()
    with pytest.raises(ValueError, match=r"1 llama checkpoint keys have no multihead counterpart: score\.w"):
        mh.pretrained.from_hf_state_dict({**sd, "score.weight": torch.zeros(2, 64)}, hf.config)
    wrong = {**configs()["llama"].to_dict(), "num_key_value_heads": 4}
    with pytest.raises(ValueError, match=r"does not fit the model its config describes"):
        mh.pretrained.from_hf_state_dict(sd, wrong)
    with pytest.raises(ValueError, match=r"rope_type 'linear'.*not supported"):
        mh.pretrained.from_hf_state_dict(
            sd, {**wrong, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}
        )
    no_head = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match=r"no lm_head\.weight and tie_word_embeddings is False"):
        mh.pretrained.from_hf_state_dict(no_head, hf.config)


def test_load_of_a_directory_without_a_checkpoint_raises(tmp_path):
    with pytest.raises(ValueError, match=r"no config\.json in it"):
        mh.pretrained.load(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=r"has no model\.safetensors"):
        mh.pretrained.load(tmp_path)
