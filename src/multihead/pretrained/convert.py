"""Shared pieces of the Hugging Face converters: config access, key renaming, fusing, strict loading.

A converter (``bert.py``, ``gpt2.py``, ``llama.py``) turns a Hugging Face config into the constructor
arguments of a multihead module and renames the checkpoint's keys with a list of regex :data:`Rule`s.
Everything here works on plain dicts and tensors: transformers is never imported.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "Rule",
    "align_biases",
    "cfg",
    "fuse_qkv",
    "load_converted",
    "rename",
]

#: (pattern, replacement, transform): keys matching ``pattern`` (``re.fullmatch``) are renamed with
#: ``pattern.sub(replacement)``; ``replacement=None`` drops the key; ``transform`` maps the tensor.
Rule = tuple[str, str | None, Callable[[Tensor], Tensor] | None]


def cfg(config: Any, name: str, default: Any = ...) -> Any:
    """``config.name`` for a transformers config object, ``config[name]`` for a dict (config.json).

    Raises:
        ValueError: the field is missing and no default was given.
    """
    value = config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)
    if value is ...:
        raise ValueError(f"the config has no {name!r}; pass a complete Hugging Face config (config.json)")
    return value


def rename(state_dict: Mapping[str, Tensor], rules: list[Rule], what: str) -> dict[str, Tensor]:
    """Apply the first matching rule to every key; a key no rule matches raises. Every tensor a rule
    keeps must be floating point, checked here on the checkpoint's own names before any tensor is
    fused with another (``torch.cat`` of an int32 q_proj with float k/v would cast it silently); the
    buffers a rule drops (``position_ids``, old causal masks) may hold any dtype.

    Raises:
        ValueError: naming the keys that no rule knows (a different architecture or a task head), or
            the kept tensors that are not floating point with their dtypes.
    """
    compiled = [(re.compile(p), r, f) for p, r, f in rules]
    out: dict[str, Tensor] = {}
    unknown = []
    not_float = []
    for key, value in state_dict.items():
        for pattern, repl, fn in compiled:
            if pattern.fullmatch(key):
                if repl is not None:
                    if not value.is_floating_point():
                        not_float.append(f"{key} ({value.dtype})")
                    out[pattern.sub(repl, key)] = fn(value) if fn is not None else value
                break
        else:
            unknown.append(key)
    if not_float:
        raise ValueError(
            f"the {what} checkpoint holds tensors that are not floating point: {_few(not_float)}; multihead "
            "loads float32/float16/bfloat16 weights (dequantize an integer checkpoint before loading)"
        )
    if unknown:
        shown = _few(unknown)
        raise ValueError(
            f"{len(unknown)} {what} checkpoint keys have no multihead counterpart: {shown}; "
            f"pass the bare {what} model's state dict (without task heads)"
        )
    return out


def _few(names: list[str]) -> str:
    """The first five of ``names``, and how many more."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def fuse_qkv(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Replace every ``<prefix>.{q,k,v}_proj.{weight,bias}`` triple by ``<prefix>.qkv_proj.*`` (rows q|k|v).

    The fused layout of :class:`multihead.MultiHeadAttention` (one matmul for eq. (3)).

    Raises:
        ValueError: a q_proj without its k_proj or v_proj (naming the keys).
    """
    out = dict(sd)
    for key in sd:
        m = re.fullmatch(r"(.*)\.q_proj\.(weight|bias)", key)
        if m:
            parts = [f"{m[1]}.{p}_proj.{m[2]}" for p in "qkv"]
            missing = [p for p in parts if p not in out]
            if missing:
                raise ValueError(
                    f"the checkpoint has {key} but no {', '.join(missing)}; every attention layer needs its "
                    "q_proj, k_proj and v_proj (a truncated or edited checkpoint?)"
                )
            out[f"{m[1]}.qkv_proj.{m[2]}"] = torch.cat([out.pop(p) for p in parts], dim=0)
    return out


def align_biases(model: nn.Module, sd: Mapping[str, Tensor]) -> None:
    """Give each ``nn.Linear`` of ``model`` a bias exactly when the checkpoint has one.

    Models differ in where they put biases (Qwen2: on q, k, v but not on o_proj or the MLP; LLaMA:
    none; GPT-2 and BERT: everywhere), so the converters build the model without the bias flag and the
    checkpoint decides, Linear by Linear.
    """
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            key = f"{name}.bias"
            if key in sd and m.bias is None:
                m.bias = nn.Parameter(torch.zeros(m.out_features, dtype=m.weight.dtype))
            elif key not in sd and m.bias is not None:
                m.register_parameter("bias", None)


def load_converted(model: nn.Module, sd: dict[str, Tensor], what: str, like: str) -> None:
    """Move ``model`` to the device and dtype of the checkpoint tensor ``sd[like]``, then
    ``load_state_dict(strict=True)`` with the mismatches named in a ValueError.

    Raises:
        ValueError: missing or unexpected keys, a tensor of the wrong shape (a config that does not
            describe this checkpoint), or integer weights.
    """
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    extra = sorted(set(sd) - set(own))
    wrong = [f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
             for k in own if k in sd and sd[k].shape != own[k].shape]  # fmt: skip
    if missing or extra or wrong:
        raise ValueError(
            f"the {what} checkpoint does not fit the model its config describes: missing {missing[:5]}, "
            f"unexpected {extra[:5]}, wrong shapes {wrong[:5]}; check that config and weights belong together"
        )
    not_float = [f"{k}: {sd[k].dtype}" for k in own if not sd[k].is_floating_point()]
    if not_float:
        raise ValueError(
            f"the {what} checkpoint holds non-floating-point weights {not_float[:5]}; multihead loads "
            "float32/float16/bfloat16 checkpoints (dequantize an int8 checkpoint before loading)"
        )
    model.to(device=sd[like].device, dtype=sd[like].dtype)
    model.load_state_dict(sd, strict=True)
