"""Model shapes from configs: a Hugging Face config.json (dict), a multihead config, or a named preset.
Nothing is allocated: a 7B preset is a handful of integers.

Presets (:data:`PRESETS`, also :data:`multihead.pretrained.PRESETS`)::

    transformer-base   Vaswani et al. 2017 base: the encoder stack of the original post-LN layer
                       (6 x d 512, 8 heads, d_ff 2048, ReLU, sinusoidal positions, 37000-token vocabulary);
                       the decoder's cross-attention is not modelled
    bert-base          BERT-base uncased: 12 x d 768, 12 heads, GELU, learned positions (512)
    minilm             all-MiniLM-L6-v2: 6 x d 384, 12 heads of 32, d_ff 1536
    gpt2               GPT-2 small: 12 x d 768, pre-LN, tanh-GELU, learned positions (1024), tied head
    llama-7b           LLaMA(-2)-7B shape: 32 x d 4096, 32 heads (MHA), SwiGLU 11008, RMSNorm, RoPE
    mistral-7b         Mistral-7B shape: LLaMA's layer with GQA (8 kv heads), SwiGLU 14336,
                       sliding window 4096
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .shapes import ModelShape, from_model
from .walk import LayerSpec

__all__ = ["PRESETS", "as_shape", "from_config", "load_config", "preset"]


_LLAMA_7B = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}
_BERT = {
    "model_type": "bert",
    "vocab_size": 30522,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-12,
    "torch_dtype": "float32",
}

#: Model shapes by name, as the config dicts :func:`from_config` reads (see the module docstring).
PRESETS: dict[str, dict[str, Any]] = {
    "transformer-base": {
        "model_type": "multihead-encoder",
        "name": "transformer-base",
        "vocab_size": 37000,
        "d_model": 512,
        "n_layers": 6,
        "n_heads": 8,
        "d_ff": 2048,
        "positions": "sinusoidal",
        "torch_dtype": "float32",
    },
    "bert-base": {
        **_BERT,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
    },
    "minilm": {
        **_BERT,
        "hidden_size": 384,
        "num_hidden_layers": 6,
        "num_attention_heads": 12,
        "intermediate_size": 1536,
    },
    "gpt2": {
        "model_type": "gpt2",
        "vocab_size": 50257,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_positions": 1024,
        "activation_function": "gelu_new",
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    },
    "llama-7b": _LLAMA_7B,
    "mistral-7b": {
        **_LLAMA_7B,
        "model_type": "mistral",
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "torch_dtype": "bfloat16",
    },
}


# -- from a config ------------------------------------------------------------------------------------
def _dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    name = config.get("torch_dtype") or config.get("dtype")
    dt = getattr(torch, str(name).replace("torch.", ""), None) if name else None
    return dt if isinstance(dt, torch.dtype) else None


def _from_lm_kwargs(kw: Mapping[str, Any], name: str, dtype: torch.dtype | None) -> ModelShape:
    """The shape of ``TransformerLM(**kw)``, with its config's (:class:`LMConfig`) defaults for missing
    keys."""
    import dataclasses

    from ..models.lm_config import LMConfig

    allowed = {f.name: f.default for f in dataclasses.fields(LMConfig)}
    unknown = sorted(set(kw) - set(allowed))
    if unknown:
        raise ValueError(f"unknown TransformerLM config keys {unknown}; known: {sorted(allowed)}")
    a = {**allowed, **kw}
    spec = LayerSpec.make(
        a["d_model"],
        a["n_heads"],
        a["n_kv_heads"],
        a["d_ff"],
        activation=a["activation"],
        norm=a["norm"],
        norm_first=a["norm_first"],
        bias=a["bias"],
        rotary=a["positions"] == "rotary",
    )
    return ModelShape(
        name,
        "lm",
        ((spec, a["n_layers"]),),
        a["vocab_size"],
        a["positions"],
        a["max_len"],
        final_norm=a["norm"] if a["norm_first"] else None,
        lm_head=True,
        tie_embeddings=bool(a["tie_embeddings"]),
        causal=True,
        window=a["sliding_window"],
        dtype=dtype,
    )


_ENCODER_KEYS = {
    "name",
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "activation",
    "norm",
    "norm_first",
    "bias",
    "positions",
    "max_len",
    "final_norm",
    "model_type",
    "torch_dtype",
}


def _from_encoder_config(c: Mapping[str, Any], name: str) -> ModelShape:
    """``{"model_type": "multihead-encoder", ...}``: Encoder arguments, optionally an embedding in front."""
    unknown = sorted(set(c) - _ENCODER_KEYS)
    if unknown:
        raise ValueError(f"unknown multihead-encoder config keys {unknown}; known: {sorted(_ENCODER_KEYS)}")
    norm, norm_first = c.get("norm", "layernorm"), bool(c.get("norm_first", False))
    spec = LayerSpec.make(
        c["d_model"],
        c["n_heads"],
        c.get("n_kv_heads"),
        c["d_ff"],
        activation=c.get("activation", "relu"),
        norm=norm,
        norm_first=norm_first,
        bias=c.get("bias", True),
        rotary=c.get("positions") == "rotary",
    )
    final = c.get("final_norm")
    return ModelShape(
        c.get("name", name),
        "encoder",
        ((spec, c["n_layers"]),),
        c.get("vocab_size", 0),
        c.get("positions", "none"),
        c.get("max_len"),
        final_norm=norm if (norm_first if final is None else final) else None,
        dtype=_dtype(c),
    )


def _from_bert_config(c: Mapping[str, Any], name: str) -> ModelShape:
    from ..pretrained.bert import ACTIVATIONS

    act = c.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(f"BERT hidden_act {act!r} is not supported; supported: {list(ACTIVATIONS)}")
    spec = LayerSpec.make(
        c["hidden_size"], c["num_attention_heads"], None, c["intermediate_size"], activation=ACTIVATIONS[act]
    )
    return ModelShape(
        name,
        "bert",
        ((spec, c["num_hidden_layers"]),),
        c["vocab_size"],
        "learned",
        c["max_position_embeddings"],
        token_types=c.get("type_vocab_size", 2),
        embed_norm="layernorm",
        dtype=_dtype(c),
    )


def from_config(config: Mapping[str, Any], name: str = "config") -> ModelShape:
    """The shape of a config dict: a Hugging Face config.json (``model_type`` bert, gpt2, llama, mistral,
    qwen2), ``{"model_type": "multihead-lm", **TransformerLM kwargs}`` or ``{"model_type":
    "multihead-encoder", n_layers, d_model, n_heads, d_ff, ...}`` (an Encoder, optionally with
    ``vocab_size`` / ``positions`` for an embedding in front).

    Raises:
        ValueError: another model type, unknown keys, options the converters reject, bad sizes.
    """
    from ..pretrained.gpt2 import gpt2_kwargs
    from ..pretrained.llama import MODEL_TYPES, llama_kwargs

    kind = config.get("model_type")
    dtype = _dtype(config)
    if kind == "bert":
        return _from_bert_config(config, name)
    if kind == "gpt2":
        return _from_lm_kwargs(gpt2_kwargs(config), name, dtype)
    if kind in MODEL_TYPES:
        return _from_lm_kwargs(llama_kwargs(config), name, dtype)
    if kind == "multihead-lm":
        kw = {k: v for k, v in config.items() if k not in ("model_type", "torch_dtype", "name")}
        return _from_lm_kwargs(kw, config.get("name", name), dtype)
    if kind == "multihead-encoder":
        return _from_encoder_config(config, name)
    known = ["bert", "gpt2", *MODEL_TYPES, "multihead-lm", "multihead-encoder"]
    raise ValueError(f"config model_type {kind!r} is not supported; use one of {known}")


def _all_presets() -> dict[str, dict[str, Any]]:
    from ..pretrained.llama import PRESETS as LM_PRESETS

    return {**PRESETS, **LM_PRESETS}


def preset(name: str) -> ModelShape:
    """The shape of preset ``name`` (this module's :data:`PRESETS` and ``multihead.pretrained.PRESETS``).

    Raises:
        ValueError: an unknown name (the message lists the presets).
    """
    presets = _all_presets()
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(presets)}")
    return from_config(presets[name], name)


def load_config(directory: str | Path) -> dict[str, Any]:
    """The config.json of a Hugging Face / sentence-transformers directory (no weights are read).

    Raises:
        ValueError: ``directory`` is missing or not a folder, has no config.json, its config.json is not a
            JSON object, or a field has the wrong type or range; the message names the file.
    """
    from ..pretrained.config_checks import check_config
    from ..pretrained.files import read_json

    folder = Path(directory)
    if not folder.is_dir():
        why = "does not exist" if not folder.exists() else "is a file, not a folder"
        raise ValueError(f"{str(directory)!r} {why}; pass a save_pretrained() directory (--hf DIR)")
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(
            f"no config.json in {str(directory)!r}; pass a save_pretrained() directory (--hf DIR)"
        )
    config = read_json(path)
    check_config(config, f"config file {str(path)!r}")
    return config


def as_shape(model_or_config: Any) -> ModelShape:
    """A ModelShape from a ModelShape, a multihead module, a config dict or a preset name.

    Raises:
        ValueError: what :func:`from_model`, :func:`from_config` and :func:`preset` raise, or another type.
    """
    if isinstance(model_or_config, ModelShape):
        return model_or_config
    if isinstance(model_or_config, nn.Module):
        return from_model(model_or_config)
    if isinstance(model_or_config, str):
        return preset(model_or_config)
    if isinstance(model_or_config, Mapping):
        return from_config(model_or_config)
    raise ValueError(
        f"model_or_config must be a multihead module, a config dict or a preset name, got "
        f"{type(model_or_config).__name__}; e.g. estimate('llama-7b', 1, 2048)"
    )
