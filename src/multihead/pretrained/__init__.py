"""Real models through multihead: the bundled all-MiniLM-L6-v2 and Hugging Face checkpoints.

    mh.pretrained.minilm()                       # SentenceEncoder; .encode(texts) -> (n, 384)
    mh.pretrained.from_hf(hf_model)              # BertModel -> Bert (an Encoder + embeddings);
                                                 # GPT-2 / LLaMA / Mistral / Qwen2 -> TransformerLM;
                                                 # DiffLlama -> TransformerLM (differential attention);
                                                 # DeepSeek-V3 (dense layers) -> TransformerLM of
                                                 # variants.LatentAttention layers
    mh.pretrained.from_hf_state_dict(sd, config) # the same from a state dict and a config (dict or object)
    mh.pretrained.load(directory)                # a save_pretrained() directory (config.json + safetensors)
    mh.pretrained.random_lm("llama-155m")        # random weights of a preset shape
    mh.pretrained.to_hf(lm)                      # LLaMA family / GPT-2 / BERT back to transformers

Nothing here imports transformers or sentence-transformers: weights are read with safetensors and text
is tokenised with ``tokenizers``; the converters only need the config's fields.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..models.lm import TransformerLM
from .bert import Bert, bert_from_state_dict
from .config_checks import check_config
from .convert import cfg
from .corpus import stdlib_docstrings
from .deepseek import deepseek_from_state_dict
from .difflama import diffllama_from_state_dict
from .gpt2 import gpt2_from_state_dict
from .llama import PRESETS, llama_from_state_dict, llama_kwargs, preset_config
from .reading import convert_checked, load_checked
from .sentence_encoder import SentenceEncoder, minilm, minilm_dir, pack
from .to_hf import to_hf

__all__ = [
    "PRESETS",
    "Bert",
    "SentenceEncoder",
    "from_hf",
    "from_hf_state_dict",
    "load",
    "minilm",
    "minilm_dir",
    "pack",
    "random_lm",
    "stdlib_docstrings",
    "to_hf",
]

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


def from_hf(model: nn.Module) -> Bert | TransformerLM:
    """A transformers ``BertModel``, ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``MistralForCausalLM``,
    ``Qwen2ForCausalLM``, ``DiffLlamaForCausalLM`` or ``DeepseekV3ForCausalLM`` (dense layers only:
    ``first_k_dense_replace`` = ``num_hidden_layers``) as a multihead model with the same weights (see
    :func:`from_hf_state_dict`).

    The config decides rotary pairing, norms and their epsilon, activation, biases, sliding window and
    tied embeddings; the result computes the same logits (hidden states for BERT) in eval mode.

    Raises:
        ValueError: not a transformers model, or what :func:`from_hf_state_dict` raises.
    """
    config = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or config is None:
        raise ValueError(
            f"from_hf expects a transformers model (with .config), got {type(model).__name__}; "
            "for weights on disk use mh.pretrained.load(directory) or from_hf_state_dict(sd, config)"
        )
    return from_hf_state_dict(model.state_dict(), config)


def load(path: str | Path) -> Bert | TransformerLM:
    """The multihead model of a ``save_pretrained`` directory (config.json + model.safetensors or shards).

    Nothing larger than the files is allocated before config and weights are known to agree: the config
    is checked field by field, the weights' headers are read first, and the model is matched against
    them on the ``meta`` device; a shard index may only name files inside the directory.

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
    torch.manual_seed(seed)
    return TransformerLM(**llama_kwargs(config)).eval()
