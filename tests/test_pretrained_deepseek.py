"""DeepSeek-V3 (all layers dense) through mh.pretrained.from_hf gives transformers' logits and greedy tokens.

Each model is a small random-weight DeepseekV3ForCausalLM built offline (fp32, eval) with randomised norm
weights and biases, so a swapped or dropped mapping shows up in the logits.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead import variants as V
from tests.numerics import max_err

tf = pytest.importorskip(
    "transformers", reason="the parity oracles need the test extra: pip install -e '.[oracles]'"
)

LOGIT_TOL = 1e-4
GREEDY_TOKENS = 16
VOCAB = 97


def config(**overrides) -> dict:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        first_k_dense_replace=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return {**base, **overrides}


def hf_model(impl: str = "eager", seed: int = 0, **overrides):
    """A random-weight DeepseekV3ForCausalLM with randomised norms and biases, and attention weights of
    variance 1 / fan-in, so that the attention (not the residual stream alone) decides the logits."""
    torch.manual_seed(seed)
    cfg = tf.DeepseekV3Config(**config(**overrides))
    model = tf.DeepseekV3ForCausalLM._from_config(cfg, attn_implementation=impl).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.2)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "self_attn" in n:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return model


def ids_of(B: int, N: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, N), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("impl", "overrides"),
    [
        ("eager", {}),
        ("sdpa", {"q_lora_rank": None}),
        ("eager", {"rope_interleave": False, "attention_bias": True}),
        ("sdpa", {"tie_word_embeddings": True, "q_lora_rank": None, "rope_interleave": False}),
    ],
)
def test_logits_match_transformers(impl, overrides):
    hf = hf_model(impl, **overrides)
    ours = mh.pretrained.from_hf(hf)
    assert isinstance(ours, mh.TransformerLM)
    attn = ours.layers[0].self_attn
    assert isinstance(attn, V.LatentAttention) and (attn.kv_rank, attn.rope_dims) == (16, 8)
    ids = ids_of(2, 40)
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    assert max_err(got, ref) <= LOGIT_TOL
    assert ref.std() > 100 * LOGIT_TOL  # the logits are not all alike


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_greedy_generation_is_token_identical_to_transformers(q_lora_rank):
    hf = hf_model(q_lora_rank=q_lora_rank)
    ours = mh.pretrained.from_hf(hf)
    prompt = ids_of(2, 9)
    ref = hf.generate(prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=0)
    assert ref.shape == (2, 9 + GREEDY_TOKENS)
    attn = ours.layers[0].self_attn
    assert attn.absorbs(1, 9) and not attn.absorbs(9, 9)  # prefill naive, every decode step absorbed
    assert torch.equal(ours.generate(prompt, GREEDY_TOKENS), ref)
    for layer in ours.layers:
        layer.self_attn.absorb = True  # absorbed for the prefill too
    assert torch.equal(ours.generate(prompt, GREEDY_TOKENS), ref)


def test_left_padded_batched_generation_matches_transformers():
    hf = hf_model()
    ours = mh.pretrained.from_hf(hf)
    prompts = [ids_of(1, n, seed=n)[0].tolist() for n in (11, 4, 7)]
    ids, mask = mh.left_pad(prompts, pad_id=0)
    ref = hf.generate(ids, attention_mask=mask.long(), max_new_tokens=GREEDY_TOKENS, pad_token_id=0)
    assert torch.equal(ours.generate(ids, GREEDY_TOKENS, attention_mask=mask), ref)


def test_the_rotary_pairing_follows_rope_interleave():
    hf = hf_model()
    cfg = hf.config.to_dict()
    ids = ids_of(1, 24)
    wrong = mh.pretrained.from_hf_state_dict(hf.state_dict(), {**cfg, "rope_interleave": False})
    with torch.no_grad():
        assert max_err(wrong(ids), hf(ids).logits) > 100 * LOGIT_TOL


def test_kv_cache_bytes_count_the_latent():
    ours = mh.pretrained.from_hf(hf_model())
    assert mh.heads.kv_cache_bytes_per_token(ours) == 2 * (16 + 8) * 4  # 2 layers, r + R floats


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            {"first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
             "topk_group": 1, "moe_intermediate_size": 16},
            r"first_k_dense_replace=1 < num_hidden_layers=2: layers 1 \.\. 1 are mixture-of-experts layers, "
            r"which multihead does not support; convert a config whose layers are all dense "
            r"\(first_k_dense_replace=2\)",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64}},
            r"rope_type 'yarn' \(RoPE scaling.*\) is not supported",
        ),
    ],
)  # fmt: skip
def test_unsupported_configs_raise_value_errors(overrides, match):
    hf = hf_model(**overrides)
    with pytest.raises(ValueError, match=match):
        mh.pretrained.from_hf(hf)


def test_config_checks_before_any_weights():
    cfg = config()
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 differs from num_attention_heads=4"):
        mh.pretrained.from_hf_state_dict({}, {**cfg, "model_type": "deepseek_v3", "num_key_value_heads": 2})
    with pytest.raises(ValueError, match=r"hidden_act 'gelu' is not supported"):
        mh.pretrained.from_hf_state_dict({}, {**cfg, "model_type": "deepseek_v3", "hidden_act": "gelu"})
