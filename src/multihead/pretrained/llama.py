"""LLaMA, Mistral and Qwen2 as a multihead :class:`TransformerLM`: one converter for the three.

They share the layer (pre-LN RMSNorm, rotary attention with GQA, SwiGLU MLP) and differ only in what the
config decides: Mistral adds a sliding window, Qwen2 biases on q/k/v (not on o_proj), LLaMA may tie the
embeddings. Hugging Face stores q/k rows in the half-split rotary pairing, ``RotaryEmbedding``'s
default, so no permutation is needed. Hugging Face's MLP names map onto Meta's: gate = w1, up = w3,
down = w2.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..models.lm import TransformerLM
from .convert import Rule, align_biases, cfg, fuse_qkv, load_converted, rename

__all__ = ["PRESETS", "llama_from_state_dict", "llama_kwargs", "preset_config"]

MODEL_TYPES = ("llama", "mistral", "qwen2")

#: Random-weight model shapes (Hugging Face LLaMA config fields) for ``multihead generate`` and the
#: benchmarks. ``llama-155m`` is the decode benchmark's workload: 155M parameters, fp32; ``llama-20m``
#: (19.5M) the same family at a size ``multihead bench decode`` runs in seconds.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-155m": {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
    "llama-20m": {
        "model_type": "llama",
        "vocab_size": 8000,
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
    "llama-tiny": {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
}


def preset_config(name: str) -> dict[str, Any]:
    """A copy of the config of preset ``name``.

    Raises:
        ValueError: an unknown preset (the message lists them).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {list(PRESETS)}")
    return dict(PRESETS[name])


def _rope_base(config: Any) -> float:
    """rope_theta from ``rope_parameters`` (transformers >= 5) or ``rope_theta`` (4.x); plain RoPE only."""
    params = cfg(config, "rope_parameters", None) or {}
    scaling = cfg(config, "rope_scaling", None) or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise ValueError(f"rope_type {kind!r} (RoPE scaling) is not supported; multihead models plain RoPE")
    return float(params.get("rope_theta", cfg(config, "rope_theta", 10000.0)))


def _sliding_window(config: Any, model_type: str) -> int | None:
    """Mistral: ``sliding_window`` on every layer; Qwen2: only with ``use_sliding_window`` on all layers."""
    window = cfg(config, "sliding_window", None)
    if model_type == "qwen2" and not cfg(config, "use_sliding_window", False):
        return None
    layer_types = cfg(config, "layer_types", None)
    if window is not None and layer_types is not None and len(set(layer_types)) > 1:
        raise ValueError(
            f"layers of different kinds {sorted(set(layer_types))} are not supported: multihead applies "
            "one sliding window to every layer"
        )
    return window


def llama_kwargs(config: Any) -> dict[str, Any]:
    """:class:`TransformerLM` arguments for a LLaMA / Mistral / Qwen2 config.

    Raises:
        ValueError: another model type, a non-SiLU activation, RoPE scaling, a head_dim other than
            hidden_size / num_attention_heads, mixed sliding / full layers.
    """
    model_type = cfg(config, "model_type", "llama")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of {list(MODEL_TYPES)}")
    if cfg(config, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"hidden_act {cfg(config, 'hidden_act')!r} is not supported; the SwiGLU MLP uses silu"
        )
    d, heads = cfg(config, "hidden_size"), cfg(config, "num_attention_heads")
    head_dim = cfg(config, "head_dim", None) or d // heads
    if head_dim * heads != d:
        raise ValueError(
            f"head_dim={head_dim} with {heads} heads does not give hidden_size={d}; multihead's "
            "TransformerLM needs head_dim = hidden_size / num_attention_heads"
        )
    return {
        "vocab_size": cfg(config, "vocab_size"),
        "d_model": d,
        "n_layers": cfg(config, "num_hidden_layers"),
        "n_heads": heads,
        "d_ff": cfg(config, "intermediate_size"),
        "n_kv_heads": cfg(config, "num_key_value_heads", None) or heads,
        "max_len": cfg(config, "max_position_embeddings", 2048),
        "positions": "rotary",
        "norm": "rmsnorm",
        "norm_first": True,
        "activation": "swiglu",
        "bias": False,  # the checkpoint decides, Linear by Linear (align_biases)
        "tie_embeddings": bool(cfg(config, "tie_word_embeddings", False)),
        "rope_base": _rope_base(config),
        "sliding_window": _sliding_window(config, model_type),
        "norm_eps": cfg(config, "rms_norm_eps", 1e-6),
    }


_L = r"(?:model\.)?layers\.(\d+)\."
#: Everything of a LLaMA-style checkpoint but its attention: embeddings, SwiGLU MLP, pre-norms, final norm
#: and head (shared by every family built on LLaMA's block).
BLOCK_RULES: list[Rule] = [
    (r"(?:model\.)?embed_tokens\.weight", "embed.weight", None),
    (rf"{_L}mlp\.gate_proj\.(\w+)", r"layers.\1.ffn.w1.\2", None),
    (rf"{_L}mlp\.up_proj\.(\w+)", r"layers.\1.ffn.w3.\2", None),
    (rf"{_L}mlp\.down_proj\.(\w+)", r"layers.\1.ffn.w2.\2", None),
    (rf"{_L}input_layernorm\.weight", r"layers.\1.attn_norm.weight", None),
    (rf"{_L}post_attention_layernorm\.weight", r"layers.\1.ffn_norm.weight", None),
    (r"(?:model\.)?norm\.weight", "final_norm.weight", None),
    (r"lm_head\.weight", "lm_head.weight", None),
]
RULES: list[Rule] = [
    (r"(?:model\.)?(?:layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq", None, None),  # derived buffers
    (rf"{_L}self_attn\.([qkvo])_proj\.(\w+)", r"layers.\1.self_attn.\2_proj.\3", None),
    *BLOCK_RULES,
]


def llama_from_state_dict(state_dict: Mapping[str, Tensor], config: Any) -> TransformerLM:
    """A :class:`TransformerLM` with the weights of a LLaMA / Mistral / Qwen2 (``*ForCausalLM``) state dict.

    Raises:
        ValueError: unsupported config values, unknown keys, a config that does not fit the weights.
    """
    kwargs = llama_kwargs(config)
    sd = fuse_qkv(rename(state_dict, RULES, str(cfg(config, "model_type", "llama"))))
    if "lm_head.weight" not in sd and not kwargs["tie_embeddings"]:
        raise ValueError(
            "the checkpoint has no lm_head.weight and tie_word_embeddings is False: pass the "
            "*ForCausalLM model (with its head), not the bare LlamaModel / MistralModel / Qwen2Model"
        )
    if kwargs["tie_embeddings"]:
        sd["lm_head.weight"] = sd["embed.weight"]
    model = TransformerLM(**kwargs)
    align_biases(model, sd)
    load_converted(model, sd, "LLaMA-family", like="embed.weight")
    return model.eval()
