"""GPT-2 as a multihead :class:`TransformerLM`: learned positions, pre-LN LayerNorm, tanh-GELU, tied head.

Hugging Face's GPT-2 keeps its projections in ``Conv1D`` modules whose weight is the transpose of an
``nn.Linear`` weight: (d_in, d_out). ``c_attn`` is already the fused ``[W^Q | W^K | W^V]`` of our
``qkv_proj``, so its rows need no reordering, only the transpose.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..models.lm import TransformerLM
from .convert import Rule, align_biases, cfg, load_converted, rename

__all__ = ["gpt2_from_state_dict", "gpt2_kwargs"]

ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def gpt2_kwargs(config: Any) -> dict[str, Any]:
    """:class:`TransformerLM` arguments for a GPT-2 config.

    Raises:
        ValueError: options multihead does not model (cross-attention, layer-index scaling, ...).
    """
    act = cfg(config, "activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ValueError(
            f"GPT-2 activation_function {act!r} is not supported; supported: {list(ACTIVATIONS)}"
        )
    for flag, ok in (
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
        ("scale_attn_weights", True),
    ):
        if bool(cfg(config, flag, ok)) != ok:
            raise ValueError(f"GPT-2 with {flag}={not ok} is not supported; multihead models {flag}={ok}")
    d = cfg(config, "n_embd")
    inner = cfg(config, "n_inner", None)
    return {
        "vocab_size": cfg(config, "vocab_size"),
        "d_model": d,
        "n_layers": cfg(config, "n_layer"),
        "n_heads": cfg(config, "n_head"),
        "d_ff": 4 * d if inner is None else inner,
        "max_len": cfg(config, "n_positions"),
        "positions": "learned",
        "norm": "layernorm",
        "norm_first": True,
        "activation": ACTIVATIONS[act],
        "bias": True,
        "tie_embeddings": bool(cfg(config, "tie_word_embeddings", True)),
        "norm_eps": cfg(config, "layer_norm_epsilon", 1e-5),
    }


def _t(w: Tensor) -> Tensor:
    """Conv1D (d_in, d_out) -> Linear (d_out, d_in); biases (1-D) pass unchanged."""
    return w.t().contiguous() if w.dim() == 2 else w


_H = r"(?:transformer\.)?h\.(\d+)\."
RULES: list[Rule] = [
    (rf"{_H}attn\.(bias|masked_bias)", None, None),  # causal-mask buffers of old checkpoints
    (r"(?:transformer\.)?wte\.weight", "embed.weight", None),
    (r"(?:transformer\.)?wpe\.weight", "pos_embed.weight", None),
    (rf"{_H}ln_1\.(\w+)", r"layers.\1.attn_norm.\2", None),
    (rf"{_H}attn\.c_attn\.(\w+)", r"layers.\1.self_attn.qkv_proj.\2", _t),
    (rf"{_H}attn\.c_proj\.(\w+)", r"layers.\1.self_attn.o_proj.\2", _t),
    (rf"{_H}ln_2\.(\w+)", r"layers.\1.ffn_norm.\2", None),
    (rf"{_H}mlp\.c_fc\.(\w+)", r"layers.\1.ffn.linear1.\2", _t),
    (rf"{_H}mlp\.c_proj\.(\w+)", r"layers.\1.ffn.linear2.\2", _t),
    (r"(?:transformer\.)?ln_f\.(\w+)", r"final_norm.\1", None),
    (r"lm_head\.weight", "lm_head.weight", None),
]


def gpt2_from_state_dict(state_dict: Mapping[str, Tensor], config: Any) -> TransformerLM:
    """A :class:`TransformerLM` with the weights of a ``GPT2LMHeadModel`` / ``GPT2Model`` state dict.

    Raises:
        ValueError: unsupported config values, unknown keys, a config that does not fit the weights.
    """
    kwargs = gpt2_kwargs(config)
    sd = rename(state_dict, RULES, "GPT-2")
    if kwargs["tie_embeddings"] or "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["embed.weight"]
        kwargs["tie_embeddings"] = True
    model = TransformerLM(**kwargs)
    align_biases(model, sd)
    load_converted(model, sd, "GPT-2", like="embed.weight")
    return model.eval()
