"""A Hugging Face config, checked once before any model is built: every field a converter reads has the
right type and range, head counts divide, and a checkpoint of mixed float dtypes gets one dtype.

A config.json is user input: ``"hidden_size": 128.0`` or ``"128"``, ``"num_attention_heads": 0`` or
``"rms_norm_eps": "x"`` would otherwise surface as a ZeroDivisionError, a TypeError or a failure at the
first forward. Each check names the file (or "config" for an in-memory config), the field, the value and
the fix.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["check_config", "declared_dtype", "unify_dtypes"]

#: Fields that must be ints >= 1 (None allowed for the optional ones).
POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
)
OPTIONAL_POSITIVE_INTS = ("num_key_value_heads", "head_dim", "n_inner", "q_lora_rank", "sliding_window")
#: Fields that must be ints >= 0 (None allowed).
OPTIONAL_COUNTS = ("first_k_dense_replace",)
#: Fields that must be finite numbers > 0 (an int such as ``"rope_theta": 10000`` is a number too).
POSITIVE_FLOATS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta")
#: Fields that must be numbers in [0, 1).
FRACTIONS = ("attention_dropout",)
BOOLS = (
    "tie_word_embeddings",
    "use_sliding_window",
    "rope_interleave",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
    "add_cross_attention",
)
STRINGS = ("model_type", "hidden_act", "activation_function", "position_embedding_type")
#: (heads, kv heads) field pairs whose first must be a multiple of the second.
HEAD_PAIRS = (("num_attention_heads", "num_key_value_heads"),)
#: (width, heads) field pairs: the width splits evenly over the heads unless head_dim is given.
WIDTH_PAIRS = (("hidden_size", "num_attention_heads"), ("n_embd", "n_head"))


def _get(config: Any, name: str) -> Any:
    """``config[name]`` (dict) or ``config.name`` (object); ``...`` when absent."""
    return config.get(name, ...) if isinstance(config, Mapping) else getattr(config, name, ...)


def _kind(value: Any) -> str:
    return f"{value!r} (a {type(value).__name__})"


def _check_field(config: Any, name: str, where: str) -> None:
    value = _get(config, name)
    if value is ... or (value is None and name not in POSITIVE_INTS):
        return
    if name in POSITIVE_INTS + OPTIONAL_POSITIVE_INTS + OPTIONAL_COUNTS:
        low = 0 if name in OPTIONAL_COUNTS else 1
        if isinstance(value, bool) or not isinstance(value, int):
            whole = isinstance(value, float) and value.is_integer()
            fix = f"write {int(value)}" if whole else "write an int"
            if isinstance(value, str) and value.strip().isdigit():
                fix = f"write {value.strip()} without quotes"
            raise ValueError(f"{where}: {name} must be an int >= {low}, got {_kind(value)}; {fix}")
        if value < low:
            raise ValueError(f"{where}: {name} must be an int >= {low}, got {value}")
    elif name in POSITIVE_FLOATS + FRACTIONS:
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        span = "> 0" if name in POSITIVE_FLOATS else "in [0, 1)"
        if ok:
            ok = value > 0 if name in POSITIVE_FLOATS else 0 <= value < 1
        if not ok:
            raise ValueError(f"{where}: {name} must be a finite number {span}, got {_kind(value)}")
    elif name in BOOLS and not isinstance(value, bool):
        raise ValueError(f"{where}: {name} must be true or false, got {_kind(value)}")
    elif name in STRINGS and not isinstance(value, str):
        raise ValueError(f"{where}: {name} must be a string, got {_kind(value)}")


def _check_rope(config: Any, where: str) -> None:
    """``rope_parameters`` / ``rope_scaling``: None or an object whose rope_theta is a number > 0."""
    for name in ("rope_parameters", "rope_scaling"):
        value = _get(config, name)
        if value is ... or value is None:
            continue
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: {name} must be an object or null, got {_kind(value)}")
        _check_field(value, "rope_theta", f"{where}: {name}")


def check_config(config: Any, where: str = "config") -> None:
    """Check every field a converter reads: types, ranges, head divisibility.

    Args:
        config: a config.json dict or a transformers config object.
        where: how to name it in a message, e.g. ``"config file '/ckpt/config.json'"``.

    Raises:
        ValueError: naming ``where``, the field, the value and what it must be.
    """
    if not isinstance(config, Mapping) and not hasattr(config, "model_type"):
        raise ValueError(f"{where} must be a config.json dict or a transformers config, got {_kind(config)}")
    for name in POSITIVE_INTS + OPTIONAL_POSITIVE_INTS + OPTIONAL_COUNTS + POSITIVE_FLOATS:
        _check_field(config, name, where)
    for name in FRACTIONS + BOOLS + STRINGS:
        _check_field(config, name, where)
    _check_rope(config, where)
    for heads, kv in HEAD_PAIRS:
        h, g = _get(config, heads), _get(config, kv)
        if isinstance(h, int) and isinstance(g, int) and h % g:
            raise ValueError(
                f"{where}: {heads}={h} is not a multiple of {kv}={g}; each kv head serves a whole group "
                "of query heads (GQA)"
            )
    head_dim = _get(config, "head_dim")
    for width, heads in WIDTH_PAIRS:
        d, h = _get(config, width), _get(config, heads)
        if isinstance(d, int) and isinstance(h, int) and head_dim in (None, ...) and d % h:
            raise ValueError(
                f"{where}: {width}={d} is not divisible by {heads}={h}; each head takes {width} / {heads} "
                "features"
            )


_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def declared_dtype(config: Any) -> torch.dtype | None:
    """The float dtype a config declares (``torch_dtype`` or, in transformers >= 5, ``dtype``), or None."""
    for name in ("dtype", "torch_dtype"):
        value = _get(config, name)
        if isinstance(value, torch.dtype) and value in _DTYPES.values():
            return value
        if isinstance(value, str) and value.replace("torch.", "") in _DTYPES:
            return _DTYPES[value.replace("torch.", "")]
    return None


def unify_dtypes(
    sd: Mapping[str, Tensor], config: Any, where: str, *, warn: bool = True
) -> Mapping[str, Tensor]:
    """``sd`` with every floating tensor in one dtype: a checkpoint of mixed float dtypes (one fp16 tensor
    among fp32 ones) is cast, with a warning, to the dtype the config declares (``torch_dtype``) or else
    to the dtype that holds most of the numbers. transformers likewise casts every weight to the one
    dtype of the model it builds, silently. A checkpoint of one dtype is returned as it is.
    """
    counts: dict[torch.dtype, int] = {}
    for t in sd.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    if len(counts) <= 1:
        return sd
    target = declared_dtype(config)
    if target is None:
        target = max(counts, key=lambda d: counts[d])
    odd = [f"{k} ({t.dtype})" for k, t in sd.items() if t.is_floating_point() and t.dtype != target]
    shown = ", ".join(odd[:5]) + (f" and {len(odd) - 5} more" if len(odd) > 5 else "")
    if warn:
        warnings.warn(
            f"{where} mixes float dtypes {sorted(str(d) for d in counts)}; casting {shown} to {target} "
            "(the declared torch_dtype, else the dtype of most weights)",
            stacklevel=3,
        )
    return {k: t.to(target) if t.is_floating_point() else t for k, t in sd.items()}
