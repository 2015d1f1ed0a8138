"""DiffLlama (LLaMA with differential attention) as a multihead :class:`TransformerLM`.

Hugging Face's DiffLlama is the LLaMA layer (pre-LN RMSNorm, rotary GQA attention, SwiGLU MLP) whose
attention is the differential attention of Ye et al. (2025, "Differential Transformer"): layer l's
self-attention is a :class:`~multihead.variants.DifferentialAttention` with ``layer_idx=l`` (so
lambda_init = 0.8 - 0.6 exp(-0.3 l)) and the per-head RMSNorm's epsilon ``rms_norm_eps``. The weights
keep their layout: ``q_proj`` / ``k_proj`` / ``v_proj`` fuse into ``qkv_proj`` as for LLaMA, and
``lambda_q1``, ``lambda_k1``, ``lambda_q2``, ``lambda_k2`` keep their names; the per-head norm has no
weights. Everything else (rotary pairing, MLP names, tied embeddings) is the LLaMA converter's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..models.lm import TransformerLM
from ..nn.layers import TransformerLayer
from ..variants.differential import DifferentialAttention
from .convert import Rule, align_biases, cfg, fuse_qkv, load_converted, rename
from .llama import RULES, llama_kwargs

__all__ = ["DIFFLLAMA_RULES", "diffllama_from_state_dict", "diffllama_kwargs"]

#: LLaMA's key rules plus the four lambda vectors of every layer.
DIFFLLAMA_RULES: list[Rule] = [
    *RULES,
    (r"(?:model\.)?layers\.(\d+)\.self_attn\.(lambda_[qk][12])", r"layers.\1.self_attn.\2", None),
]


def diffllama_kwargs(config: Any) -> dict[str, Any]:
    """:class:`TransformerLM` arguments for a DiffLlama config (those of the same LLaMA config).

    Raises:
        ValueError: a model type other than "diffllama", attention dropout, and what
            :func:`~multihead.pretrained.llama.llama_kwargs` raises (a non-SiLU MLP, RoPE scaling, a head_dim
            other than hidden_size / num_attention_heads).
    """
    model_type = cfg(config, "model_type", "diffllama")
    if model_type != "diffllama":
        raise ValueError(f"model_type {model_type!r} is not 'diffllama'")
    if cfg(config, "attention_dropout", 0.0):
        raise ValueError(
            f"attention_dropout={cfg(config, 'attention_dropout')} is not supported: DiffLlama refuses it "
            "too; set it to 0.0"
        )
    fields = dict(config) if isinstance(config, Mapping) else dict(config.to_dict())
    return llama_kwargs({**fields, "model_type": "llama"})


def diffllama_from_state_dict(state_dict: Mapping[str, Tensor], config: Any) -> TransformerLM:
    """A :class:`TransformerLM` with :class:`~multihead.variants.DifferentialAttention` layers and the
    weights of a ``DiffLlamaForCausalLM`` state dict.

    Raises:
        ValueError: unsupported config values, an odd head or kv-head count, unknown keys, a config that
            does not fit the weights.
    """
    kwargs = diffllama_kwargs(config)
    sd = fuse_qkv(rename(state_dict, DIFFLLAMA_RULES, "DiffLlama"))
    if "lm_head.weight" not in sd and not kwargs["tie_embeddings"]:
        raise ValueError(
            "the checkpoint has no lm_head.weight and tie_word_embeddings is False: pass the "
            "DiffLlamaForCausalLM model (with its head), not the bare DiffLlamaModel"
        )
    if kwargs["tie_embeddings"]:
        sd["lm_head.weight"] = sd["embed.weight"]
    model = TransformerLM(**kwargs)
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, TransformerLayer)
        plain = layer.self_attn
        layer.self_attn = DifferentialAttention(
            plain.d_model,
            plain.n_heads,
            plain.n_kv_heads,
            layer_idx=i,
            norm_eps=float(kwargs["norm_eps"]),
            bias=False,  # the checkpoint decides (align_biases)
            rotary=plain.rotary,
            backend=plain.backend,
        )
    align_biases(model, sd)
    load_converted(model, sd, "DiffLlama", like="embed.weight")
    return model.eval()
