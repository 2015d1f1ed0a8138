"""DeepSeek-V3 with dense layers only as a multihead :class:`TransformerLM` of
:class:`~multihead.variants.LatentAttention` layers.

The layer is LLaMA's (pre-LN RMSNorm, SwiGLU MLP) with multi-head latent attention (DeepSeek-AI, 2024,
"DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language Model"). Layers from
``first_k_dense_replace`` on are mixture-of-experts MLPs, which multihead does not model, so only configs
whose layers are all dense convert. Weight names map onto LatentAttention's::

    q_proj -> q_proj          q_a_proj -> q_down       q_a_layernorm -> q_norm      q_b_proj -> q_up
    kv_a_proj_with_mqa -> kv_down    kv_a_layernorm -> kv_norm    kv_b_proj -> kv_up    o_proj -> o_proj

``rope_interleave`` (the default of the config) pairs rotary features (2i, 2i + 1): the rotary is then a
``RotaryEmbedding(qk_rope_head_dim, interleaved=True)``, and the checkpoint's rows need no permutation.
The latent norms use epsilon 1e-6 whatever ``rms_norm_eps`` says, as the reference model does. Modules
past ``num_hidden_layers`` (the multi-token-prediction layer of the released checkpoints) are dropped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..models.lm import TransformerLM
from ..nn.positions import RotaryEmbedding
from ..variants.latent import LatentAttention
from .convert import Rule, align_biases, cfg, load_converted, rename
from .llama import BLOCK_RULES

__all__ = ["deepseek_from_state_dict", "deepseek_kwargs"]

#: The latent RMSNorms' epsilon in DeepSeek-V3 (not configurable there).
LATENT_NORM_EPS = 1e-6


def _rope_base(config: Any) -> float:
    """rope_theta of plain RoPE (``rope_parameters`` in transformers >= 5, ``rope_theta`` before)."""
    params = cfg(config, "rope_parameters", None) or {}
    scaling = cfg(config, "rope_scaling", None) or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise ValueError(
            f"rope_type {kind!r} (RoPE scaling, e.g. YaRN with its mscale on the softmax scale) is not "
            "supported for DeepSeek-V3; multihead converts plain RoPE (rope_type 'default')"
        )
    return float(params.get("rope_theta", cfg(config, "rope_theta", 10000.0)))


def deepseek_kwargs(config: Any) -> dict[str, Any]:
    """:class:`TransformerLM` arguments, ``attention`` included, for an all-dense DeepSeek-V3 config.

    Raises:
        ValueError: another model type, mixture-of-experts layers, a non-SiLU activation, RoPE scaling,
            num_key_value_heads other than num_attention_heads, hidden_size not divisible by the heads.
    """
    model_type = cfg(config, "model_type", "deepseek_v3")
    if model_type != "deepseek_v3":
        raise ValueError(f"model_type {model_type!r} is not 'deepseek_v3'")
    n_layers, dense = cfg(config, "num_hidden_layers"), cfg(config, "first_k_dense_replace")
    if dense is None or dense < n_layers:
        raise ValueError(
            f"first_k_dense_replace={dense} < num_hidden_layers={n_layers}: layers {dense} .. {n_layers - 1} "
            "are mixture-of-experts layers, which multihead does not support; convert a config whose layers "
            f"are all dense (first_k_dense_replace={n_layers})"
        )
    if cfg(config, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"hidden_act {cfg(config, 'hidden_act')!r} is not supported; the SwiGLU MLP uses silu"
        )
    d, heads = cfg(config, "hidden_size"), cfg(config, "num_attention_heads")
    kv_heads = cfg(config, "num_key_value_heads", None) or heads
    if kv_heads != heads:
        raise ValueError(
            f"num_key_value_heads={kv_heads} differs from num_attention_heads={heads}; latent attention "
            "rebuilds a key and a value per head, set num_key_value_heads to num_attention_heads"
        )
    if d % heads:
        raise ValueError(
            f"hidden_size={d} is not divisible by num_attention_heads={heads}; multihead's TransformerLM "
            "needs it to be"
        )
    rotary = RotaryEmbedding(
        cfg(config, "qk_rope_head_dim"),
        base=_rope_base(config),
        interleaved=bool(cfg(config, "rope_interleave", True)),
    )
    sizes = {
        "kv_rank": cfg(config, "kv_lora_rank"),
        "q_rank": cfg(config, "q_lora_rank", None),
        "rope_dims": cfg(config, "qk_rope_head_dim"),
        "nope_dims": cfg(config, "qk_nope_head_dim"),
        "v_head_dim": cfg(config, "v_head_dim"),
    }

    def attention(_layer: int) -> LatentAttention:
        return LatentAttention(d, heads, **sizes, rotary=rotary, norm_eps=LATENT_NORM_EPS)

    return {
        "vocab_size": cfg(config, "vocab_size"),
        "d_model": d,
        "n_layers": n_layers,
        "n_heads": heads,
        "d_ff": cfg(config, "intermediate_size"),
        "max_len": cfg(config, "max_position_embeddings", 4096),
        "positions": "rotary",
        "norm": "rmsnorm",
        "norm_first": True,
        "activation": "swiglu",
        "bias": False,  # the checkpoint decides, Linear by Linear (align_biases)
        "tie_embeddings": bool(cfg(config, "tie_word_embeddings", False)),
        "norm_eps": cfg(config, "rms_norm_eps", 1e-6),
        "attention": attention,
    }


_L = r"(?:model\.)?layers\.(\d+)\."
_ATTN = {
    "q_proj": "q_proj",
    "q_a_proj": "q_down",
    "q_a_layernorm": "q_norm",
    "q_b_proj": "q_up",
    "kv_a_proj_with_mqa": "kv_down",
    "kv_a_layernorm": "kv_norm",
    "kv_b_proj": "kv_up",
    "o_proj": "o_proj",
}
RULES: list[Rule] = [
    (r"(?:model\.)?(?:layers\.\d+\.self_attn\.)?rotary_emb\.(?:original_)?inv_freq", None, None),
    *(
        (rf"{_L}self_attn\.{hf}\.(\w+)", rf"layers.\1.self_attn.{ours}.\2", None)
        for hf, ours in _ATTN.items()
    ),
    *BLOCK_RULES,  # the rest of the block is LLaMA's
]


def deepseek_from_state_dict(state_dict: Mapping[str, Tensor], config: Any) -> TransformerLM:
    """A :class:`TransformerLM` of LatentAttention layers with the weights of an all-dense
    ``DeepseekV3ForCausalLM`` state dict.

    Raises:
        ValueError: what :func:`deepseek_kwargs` raises, unknown keys (expert weights of a mixture-of-experts
            checkpoint among them), a config that does not fit the weights.
    """
    kwargs = deepseek_kwargs(config)
    n_layers = kwargs["n_layers"]
    kept = {}
    for key, value in state_dict.items():
        m = re.match(_L, key)
        if m is None or int(m[1]) < n_layers:  # layers past the last are multi-token prediction
            kept[key] = value
    sd = rename(kept, RULES, "DeepSeek-V3")
    if "lm_head.weight" not in sd and not kwargs["tie_embeddings"]:
        raise ValueError(
            "the checkpoint has no lm_head.weight and tie_word_embeddings is False: pass the "
            "DeepseekV3ForCausalLM model (with its head), not the bare DeepseekV3Model"
        )
    if kwargs["tie_embeddings"]:
        sd["lm_head.weight"] = sd["embed.weight"]
    model = TransformerLM(**kwargs)
    align_biases(model, sd)
    load_converted(model, sd, "DeepSeek-V3", like="embed.weight")
    return model.eval()
