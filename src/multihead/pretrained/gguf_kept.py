"""A GGUF file's Q4_0, Q4_1, Q8_0, Q4_K and Q6_K tensors kept in their own blocks (no dequantize /
requantize round trip: the numbers llama.cpp multiplies), for :func:`~multihead.pretrained.gguf.from_gguf`.
A mixed file (Q4_K_M: Q4_K with some Q6_K tensors) keeps every tensor in its own type.

    which tensors are kept (:func:`kept_names`: 2-D, of a kept type; a q/k/v triple only when all three
    share one type, since multihead fuses them into one qkv_proj)
    -> their blocks, q/k rows back in Hugging Face's rotary order (a row's blocks move with it)
    -> the model built as usual with placeholders for them, then each of their modules swapped for a
       :class:`~multihead.models.gguf_linear.GGUFLinear` (the embedding for a
       :class:`~multihead.models.gguf_linear.GGUFEmbedding`; a tied head shares its blocks)

Other types (F16, BF16, F32) are dequantized to fp32, as is a q/k/v triple of mixed types.

Shape legend: O rows, R bytes of a row's blocks.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..models.gguf_linear import GGUFEmbedding, GGUFLinear
from ..models.lm import TransformerLM
from .gguf_file import GGUFTensorInfo

__all__ = ["KEPT", "keep_blocks", "kept_names", "module_path"]

#: GGUF's type names whose blocks are kept, and their multihead kinds
KEPT = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0", "Q4_K": "q4_k", "Q6_K": "q6_k"}
_QKV = re.compile(r"blk\.(\d+)\.attn_([qkv])\.weight")


def kept_names(infos: list[GGUFTensorInfo]) -> set[str]:
    """The GGUF names of the tensors whose blocks are kept: 2-D weights of a :data:`KEPT` type; of a
    layer's attn_q / attn_k / attn_v only when all three have one type (else all three dequantized)."""
    kept = {t.name for t in infos if t.type_name in KEPT and len(t.dims) == 2}
    types = {t.name: t.type_name for t in infos}
    for t in infos:
        m = _QKV.fullmatch(t.name)
        if m is not None:
            triple = [f"blk.{m[1]}.attn_{p}.weight" for p in "qkv"]
            if len({types.get(n) for n in triple}) != 1 or not all(n in kept for n in triple):
                kept -= set(triple)
    return kept


def _blocks(reader_tensor: Any) -> Tensor:
    """One tensor's blocks as uint8 (O, R), copied out of the file's memory map."""
    return torch.from_numpy(np.array(reader_tensor.data, dtype=np.uint8, copy=True))  # (O, R)


def _unpermute_rows(blocks: Tensor, n_heads: int) -> Tensor:
    """q/k rows (H * D, R) from llama.cpp's rotary order back to the half-split order (its rows: each
    head's row 2i + t to row t * D / 2 + i), as :func:`.gguf._unpermute` does to the weights."""
    O = blocks.shape[0]
    rows = blocks.reshape(n_heads, O // n_heads // 2, 2, -1)  # (H, D/2, 2, R)
    return rows.transpose(1, 2).reshape(O, -1).contiguous()  # (H * D, R)


def _module(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent = model
    *parts, last = path.split(".")
    for p in parts:
        parent = getattr(parent, p)
    return parent, last


def keep_blocks(
    model: TransformerLM,
    reader: Any,
    infos: list[GGUFTensorInfo],
    config: dict[str, Any],
    kept: set[str],
    permuted: bool,
) -> int:
    """Swap (in place) the modules of ``model`` whose weights are the file's ``kept`` tensors
    (:func:`kept_names`) for block modules holding them (q / k / v rows fused as ``fuse_qkv`` fuses
    them; a head tied to a kept embedding on its blocks). ``permuted``: the file's q/k rows are in
    llama.cpp's rotary order. Returns how many modules it swapped.

    Raises:
        ValueError: a kept tensor a LLaMA-style model does not have.
    """
    by_name = {t.name: t for t in reader.tensors}
    names = {n: module_path(n) for n in kept}
    kinds = {t.name: KEPT[t.type_name] for t in infos if t.name in names}
    heads = {"q": config["num_attention_heads"], "k": config["num_key_value_heads"]}
    fused: dict[str, list[tuple[str, Tensor, str]]] = {}
    for gguf_name, path in names.items():
        blocks = _blocks(by_name[gguf_name])  # (O, R)
        letter = path.rsplit(".", 1)[-1]
        if path.endswith((".q", ".k", ".v")):
            if permuted and letter in heads:
                blocks = _unpermute_rows(blocks, heads[letter])
            fused.setdefault(path[:-2], []).append((letter, blocks, kinds[gguf_name]))
        else:
            fused[path] = [("", blocks, kinds[gguf_name])]
    swapped = 0
    for path, parts in sorted(fused.items()):
        parts.sort(key=lambda p: "qkv".index(p[0]) if p[0] else 0)  # rows q | k | v, as fuse_qkv
        blocks = parts[0][1] if len(parts) == 1 else torch.cat([b for _, b, _ in parts])  # (O, R)
        kind = parts[0][2]  # one kind for a fused triple (kept_names)
        parent, attr = _module(model, path)
        old = getattr(parent, attr)
        if isinstance(old, nn.Embedding):
            setattr(parent, attr, GGUFEmbedding(blocks, kind, old.embedding_dim, old.weight.dtype))
        else:
            setattr(parent, attr, GGUFLinear(blocks, kind, old.in_features, old.bias))
        swapped += 1
    emb, head = model.embed, model.lm_head
    if isinstance(emb, GGUFEmbedding) and not isinstance(head, GGUFLinear) and config["tie_word_embeddings"]:
        tied = GGUFLinear(emb.blocks, emb.kind, emb.embedding_dim, head.bias)  # the same blocks
        setattr(model, "lm_head", tied)  # noqa: B010  (the attribute is typed as the float head)
        swapped += 1
    return swapped


def module_path(gguf_name: str) -> str:
    """The module of a kept GGUF tensor in a multihead TransformerLM ("blk.3.attn_q.weight" ->
    "layers.3.self_attn.qkv_proj.q").

    Raises:
        ValueError: a tensor a LLaMA-style model does not have.
    """
    top = {"token_embd.weight": "embed", "output.weight": "lm_head"}
    if gguf_name in top:
        return top[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    parts = {
        "attn_q": "self_attn.qkv_proj.q", "attn_k": "self_attn.qkv_proj.k", "attn_v": "self_attn.qkv_proj.v",
        "attn_output": "self_attn.o_proj", "ffn_gate": "ffn.w1", "ffn_up": "ffn.w3", "ffn_down": "ffn.w2",
    }  # fmt: skip
    if m is None or m[2] not in parts:
        raise ValueError(f"tensor {gguf_name!r} has no block module in a LLaMA-style TransformerLM")
    return f"layers.{m[1]}.{parts[m[2]]}"
