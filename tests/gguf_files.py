"""Tiny GGUF files written with ``gguf.GGUFWriter`` as llama.cpp's converter writes them (q/k rows
permuted for its rotary layout), with the model they must load as (built from the same weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from multihead.pretrained import from_hf_state_dict

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
#: d_model and d_ff are multiples of 256 so that every block type (K-quants: 256 per block) fits
CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}


def byte_tokens() -> list[str]:
    """GPT-2's 256 byte characters (``bytes_to_unicode``)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(keep, chars))]


def vocabulary() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types): control tokens, the byte characters, a few merges."""
    merges = ["Ġ t", "h e", "Ġt he", "i s", "Ġ is"]
    tokens = SPECIALS + byte_tokens() + ["Ġt", "he", "Ġthe", "is", "Ġis"]
    return tokens, merges, [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: q/k rows of each head reordered for its rotary layout."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _blocks(w: np.ndarray, qtype: Any) -> np.ndarray:
    """``w`` as blocks of ``qtype`` (uint8 rows), or as it is for F32: the gguf package's llama.cpp
    rounding, or for the k-quants (which it cannot round) multihead's (their decoding is the gguf
    package's in the loaders)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    from multihead.native import gguf_blocks

    if qtype == T.F32:
        return w
    if qtype in (T.Q4_K, T.Q6_K):
        return gguf_blocks.quantize(torch.from_numpy(w), qtype.name.lower()).numpy()
    return quantize(w, qtype)


def random_weights(config: dict[str, Any], vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 weights in Hugging Face's row order (numpy shapes)."""
    g = np.random.default_rng(seed)
    d, f = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    out = {"token_embd.weight": g.normal(0, 0.5, (vocab, d)), "output_norm.weight": 1 + g.normal(0, 0.1, d)}
    for i in range(config["num_hidden_layers"]):
        shapes = {"attn_q": (d, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, d),
                  "ffn_gate": (f, d), "ffn_up": (f, d), "ffn_down": (d, f)}  # fmt: skip
        for name, shape in shapes.items():
            out[f"blk.{i}.{name}.weight"] = g.normal(0, 0.05, shape)
        out[f"blk.{i}.attn_norm.weight"] = 1 + g.normal(0, 0.1, d)
        out[f"blk.{i}.ffn_norm.weight"] = 1 + g.normal(0, 0.1, d)
    return {k: v.astype(np.float32) for k, v in out.items()}


_HF = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
       "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
       "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
       "ffn_down": "mlp.down_proj"}  # fmt: skip


def hf_name(name: str) -> str:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if name in top:
        return top[name]
    _, i, part, kind = name.split(".")
    return f"model.layers.{i}.{_HF[part]}.{kind}"


def write_gguf(
    path: Path,
    qtype: Any = None,
    *,
    arch: str = "llama",
    config: dict[str, Any] | None = None,
    drop_tensor: str | None = None,
    drop_key: str | None = None,
    seed: int = 0,
    tensor_types: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """Write a tiny model to ``path`` (2-D weights in ``qtype``, default F32, or ``tensor_types[part]`` for a
    tensor part such as "attn_v", "ffn_down" or "token_embd"; norms F32) and return the TransformerLM the
    same weights make (dequantized as the file holds them)."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    qtype = T.F32 if qtype is None else qtype
    config = dict(CONFIG if config is None else config)
    tokens, merges, types = vocabulary()
    config["vocab_size"] = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    keys: dict[str, Any] = {
        f"{arch}.block_count": ("uint32", config["num_hidden_layers"]),
        f"{arch}.context_length": ("uint32", config["max_position_embeddings"]),
        f"{arch}.embedding_length": ("uint32", config["hidden_size"]),
        f"{arch}.feed_forward_length": ("uint32", config["intermediate_size"]),
        f"{arch}.attention.head_count": ("uint32", config["num_attention_heads"]),
        f"{arch}.attention.head_count_kv": ("uint32", config["num_key_value_heads"]),
        f"{arch}.rope.freq_base": ("float32", config["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": ("float32", config["rms_norm_eps"]),
        "tokenizer.ggml.model": ("string", "gpt2"),
        "tokenizer.ggml.pre": ("string", "smollm"),
        "tokenizer.ggml.bos_token_id": ("uint32", 1),
        "tokenizer.ggml.eos_token_id": ("uint32", 2),
        "tokenizer.ggml.padding_token_id": ("uint32", 2),
        "tokenizer.chat_template": ("string", TEMPLATE),
    }
    for key, (kind, value) in keys.items():
        if key != drop_key:
            getattr(w, f"add_{kind}")(key, value)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_array("tokenizer.ggml.token_type", types)
    sd: dict[str, torch.Tensor] = {}
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for name, value in random_weights(config, len(tokens), seed).items():
        part = name.split(".")[2] if name.startswith("blk.") else name.split(".")[0]
        kind = T.F32 if value.ndim == 1 else (tensor_types or {}).get(part, qtype)
        data = value if value.ndim == 1 else _blocks(value, kind)
        sd[hf_name(name)] = torch.from_numpy(dequantize(data, kind).reshape(value.shape).copy())
        if part in heads:
            data = _permute(data, heads[part])
        if name != drop_tensor:
            w.add_tensor(name, data, raw_dtype=None if kind == T.F32 else kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return from_hf_state_dict(sd, config)
