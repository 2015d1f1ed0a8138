"""DiffLlama through mh.pretrained.from_hf: transformers' logits and greedy tokens from a TransformerLM
whose layers are DifferentialAttention.

A small random-weight DiffLlamaForCausalLM (fp32, eval); its RMSNorm weights and lambda vectors are
randomised too, so a dropped or swapped mapping (or a wrong lambda_init per layer) shows in the logits.
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from multihead import variants as V
from tests.numerics import max_err

tf = pytest.importorskip(
    "transformers", reason="the parity oracle needs the test extra: pip install -e '.[oracles]'"
)

LOGIT_TOL = 1e-4
GREEDY_TOKENS = 16
VOCAB = 97


def config(**overrides):
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return tf.DiffLlamaConfig(**{**fields, **overrides})


def hf_model(impl: str = "sdpa", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config(**overrides), attn_implementation=impl).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.2)
            elif "lambda" in n:
                p.normal_(0.0, 0.3)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def ids_of(B: int, N: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, N), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("impl", "extra"),
    [("eager", {}), ("sdpa", {}), ("sdpa", {"attention_bias": True, "tie_word_embeddings": True})],
)
def test_logits_match_transformers(impl, extra):
    hf = hf_model(impl, **extra)
    ours = mh.pretrained.from_hf(hf)
    assert isinstance(ours, mh.TransformerLM)
    ids = ids_of(2, 40)
    with torch.no_grad():
        assert max_err(ours(ids), hf(ids).logits) <= LOGIT_TOL


def test_layers_are_differential_attention_with_diffllamas_lambda_init():
    hf = hf_model()
    ours = mh.pretrained.from_hf(hf)
    for i, (layer, hf_layer) in enumerate(zip(ours.layers, hf.model.layers)):
        attn = layer.self_attn
        assert isinstance(attn, V.DifferentialAttention) and attn.layer_idx == i
        assert attn.lambda_init == pytest.approx(hf_layer.self_attn.lambda_init)
        assert attn.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * i))
        assert torch.equal(attn.lambda_k2, hf_layer.self_attn.lambda_k2)
        assert attn.norm_eps == hf.config.rms_norm_eps and attn.rotary is ours.layers[0].self_attn.rotary


def test_greedy_generation_is_token_identical_to_transformers():
    hf = hf_model()
    ours = mh.pretrained.from_hf(hf)
    prompt = ids_of(2, 9)
    ones = torch.ones_like(prompt)  # no pad id: every prompt token is real
    ref = hf.generate(prompt, attention_mask=ones, max_new_tokens=GREEDY_TOKENS, do_sample=False)
    assert ref.shape == (2, 9 + GREEDY_TOKENS)
    assert torch.equal(ours.generate(prompt, GREEDY_TOKENS), ref)
    assert torch.equal(ours.generate(prompt, GREEDY_TOKENS, cache=None), ref)  # the cache changes nothing


def test_save_pretrained_directory_loads(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = mh.pretrained.load(tmp_path)
    ids = ids_of(1, 12)
    with torch.no_grad():
        assert max_err(ours(ids), hf(ids).logits) <= LOGIT_TOL


def test_unsupported_configs_raise():
    hf = hf_model()
    sd, cfg = hf.state_dict(), hf.config.to_dict()
    with pytest.raises(ValueError, match=r"attention_dropout=0.1 is not supported"):
        mh.pretrained.from_hf_state_dict(sd, {**cfg, "attention_dropout": 0.1})
    with pytest.raises(ValueError, match=r"needs an even n_heads and n_kv_heads .* n_kv_heads=1"):
        mh.pretrained.from_hf_state_dict(sd, {**cfg, "num_key_value_heads": 1})
    with pytest.raises(ValueError, match=r"1 DiffLlama checkpoint keys have no multihead counterpart: score"):
        mh.pretrained.from_hf_state_dict({**sd, "score.weight": torch.zeros(2, 64)}, cfg)
    with pytest.raises(ValueError, match=r"missing \['layers.0.self_attn.lambda_k1'"):
        mh.pretrained.from_hf_state_dict(
            {k: v for k, v in sd.items() if not k.endswith("0.self_attn.lambda_k1")}, cfg
        )
