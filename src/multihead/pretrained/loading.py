"""Hugging Face checkpoints to multihead models: the converters by ``model_type``, ``save_pretrained``
directories and random-weight presets (re-exported by :mod:`multihead.pretrained`; head surgery's saved
folders build on these, so they live apart from the package's :func:`~multihead.pretrained.load`, which
also reads those folders)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from .. import rng
from ..models.lm import TransformerLM
from .bert import Bert, bert_from_state_dict
from .config_checks import check_config
from .convert import cfg
from .deepseek import deepseek_from_state_dict
from .difflama import diffllama_from_state_dict
from .gpt2 import gpt2_from_state_dict
from .llama import llama_from_state_dict, llama_kwargs, preset_config
from .reading import convert_checked, load_checked

__all__ = ["from_hf_state_dict", "load_hf_dir", "random_lm"]

_CONVERTERS: dict[str, Callable[[Mapping[str, Tensor], Any], Bert | TransformerLM]] = {
    "bert": bert_from_state_dict,
    "gpt2": gpt2_from_state_dict,
    "llama": llama_from_state_dict,
    "mistral": llama_from_state_dict,
    "qwen2": llama_from_state_dict,
    "diffllama": diffllama_from_state_dict,
    "deepseek_v3": deepseek_from_state_dict,
}


def from_hf_state_dict(state_dict: Mapping[str, Tensor], config: Any) -> Bert | TransformerLM:
    """Build the multihead model of a Hugging Face checkpoint from its weights and config.

    Args:
        state_dict: the checkpoint's tensors (``model.state_dict()`` or a safetensors file's contents).
        config: a transformers config object or the dict of its config.json; ``model_type`` picks the
            converter: "bert" -> :class:`Bert`; "gpt2", "llama", "mistral", "qwen2" -> TransformerLM;
            "diffllama" -> TransformerLM with :class:`~multihead.variants.DifferentialAttention` layers.
            "deepseek_v3" (all layers dense) -> TransformerLM of LatentAttention layers.

    Returns:
        the model in eval mode, on the checkpoint's device and in its dtype.

    Every config field is type- and range-checked first, and the model is built on the ``meta`` device
    and matched against the weights' shapes before it is allocated. A state dict of mixed float dtypes
    is cast to the config's ``torch_dtype`` (else to the dtype of most weights) with a warning.

    Raises:
        ValueError: another model type, config options multihead does not model or of the wrong type or
            range, keys of task heads, weights that do not fit the config.
    """
    check_config(config)
    return convert_checked(_convert, state_dict, config, "the state dict")


def _convert(state_dict: Mapping[str, Tensor], config: Any) -> Bert | TransformerLM:
    """The converter that ``model_type`` names, applied (a config already checked)."""
    model_type = cfg(config, "model_type")
    if model_type not in _CONVERTERS:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {list(_CONVERTERS)}")
    return _CONVERTERS[model_type](state_dict, config)


def load_hf_dir(path: str | Path) -> Bert | TransformerLM:
    """The multihead model of a ``save_pretrained`` directory (config.json + model.safetensors or shards),
    read through :func:`~multihead.pretrained.reading.load_checked` (config checked, headers matched on
    the ``meta`` device before anything is allocated).

    Raises:
        ValueError: missing or unreadable files, config fields of the wrong type or range, weights that
            do not fit the config, and what :func:`from_hf_state_dict` raises; the message names the file.
    """
    return load_checked(path, _convert)


def random_lm(preset: str | Mapping[str, Any] = "llama-tiny", *, seed: int = 0) -> TransformerLM:
    """A TransformerLM with random weights (N(0, 0.02)) of a preset shape or a LLaMA-style config dict.

    Raises:
        ValueError: an unknown preset name or an unsupported config.
    """
    config = preset_config(preset) if isinstance(preset, str) else dict(preset)
    with rng.private(seed):  # the caller's global generator is neither reset nor advanced
        return TransformerLM(**llama_kwargs(config)).eval()
