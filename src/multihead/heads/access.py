"""What the head tools need from a model: its layers, its tokens, one forward pass over token ids.

A "layer" here is a :class:`TransformerLayer` of the model, numbered in module order; its heads are the
heads of its self-attention (cross-attention is left alone). The models understood end to end are the
:class:`SentenceEncoder` (texts or ids), :class:`Bert` and :class:`TransformerLM` (ids); any module made of
TransformerLayers works with :func:`~multihead.heads.prune` and :func:`~multihead.heads.to_gqa`.

Shape legend: B batch, N tokens, d model width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..models.lm import TransformerLM
from ..nn.attention import MultiHeadAttention
from ..nn.layers import TransformerLayer
from ..pretrained.bert import Bert
from ..pretrained.sentence_encoder import SentenceEncoder

__all__ = [
    "forward_ids",
    "head_rows",
    "layers_of",
    "model_device",
    "pad_batch",
    "plain_attention",
    "rebuild_attention",
    "to_id_lists",
    "token_strings",
]


def layers_of(model: nn.Module) -> list[TransformerLayer]:
    """The TransformerLayers of ``model`` in module order (layer i of every head tool).

    Raises:
        ValueError: the model has none.
    """
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no TransformerLayer; the head tools work on multihead models "
            "(mh.pretrained.minilm(), from_hf(...), TransformerLM, Encoder, Decoder)"
        )
    return layers


def to_id_lists(model: nn.Module, texts_or_ids: Any) -> list[list[int]]:
    """Token ids of each input: texts (SentenceEncoder only), a (n, N) int tensor, or lists of ids.

    Raises:
        ValueError: texts for a model without a tokenizer, an empty input, anything else.
    """
    if isinstance(texts_or_ids, Tensor):
        if texts_or_ids.is_floating_point() or texts_or_ids.dim() not in (1, 2):
            raise ValueError(
                f"ids must be an int tensor (N,) or (n, N), got {texts_or_ids.dtype} "
                f"{tuple(texts_or_ids.shape)}"
            )
        rows = texts_or_ids.reshape(-1, texts_or_ids.shape[-1])  # (n, N)
        out = [r.tolist() for r in rows]
    elif isinstance(texts_or_ids, Sequence) and not isinstance(texts_or_ids, str):
        items = list(texts_or_ids)
        if items and all(isinstance(t, str) for t in items):
            if not isinstance(model, SentenceEncoder):
                raise ValueError(
                    f"texts need a model with a tokenizer (a SentenceEncoder); {type(model).__name__} "
                    "takes token ids: pass a (n, N) int tensor or a list of id lists"
                )
            out = model.tokenize(items)
        else:
            out = [t.tolist() if isinstance(t, Tensor) else list(t) for t in items]
    else:
        raise ValueError(
            f"texts_or_ids must be a list of texts, a list of id lists or an int tensor, got "
            f"{type(texts_or_ids).__name__}; wrap a single text as [text]"
        )
    if not out or any(len(s) == 0 for s in out):
        raise ValueError("texts_or_ids must hold at least one input, each with at least one token")
    return out


def token_strings(model: SentenceEncoder, texts: Sequence[str]) -> list[list[str]]:
    """The token strings of each text as the model sees them ("[CLS]", "the", ..., "[SEP]").

    Raises:
        ValueError: a model without a tokenizer, texts that are not a list of strings.
    """
    if not isinstance(model, SentenceEncoder):
        raise ValueError(
            f"token_strings needs a SentenceEncoder (it has the tokenizer), got {type(model).__name__}"
        )
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts must be a list of strings; wrap a single text as [text]")
    return [e.tokens for e in model.tokenizer.encode_batch(list(texts))]


def pad_batch(seqs: Sequence[Sequence[int]], device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """Right-pad id lists: ``ids`` (B, N) long and ``real`` (B, N) bool (True on real tokens)."""
    N = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), N, dtype=torch.long, device=device)  # (B, N)
    real = torch.zeros(len(seqs), N, dtype=torch.bool, device=device)  # (B, N)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.as_tensor(s, device=device)
        real[r, : len(s)] = True
    return ids, real


def forward_ids(model: nn.Module, ids: Tensor, real: Tensor | None = None) -> Tensor:
    """One forward pass over right-padded ids (B, N): hidden states (B, N, d), logits for an LM.

    Raises:
        ValueError: a model type the head tools cannot run (pass your own loss / run it yourself).
    """
    if isinstance(model, SentenceEncoder):
        return model.bert(ids, attention_mask=real)  # (B, N, d)
    if isinstance(model, Bert):
        return model(ids, attention_mask=real)  # (B, N, d)
    if isinstance(model, TransformerLM):
        return model(ids, attention_mask=real)  # (B, N, vocab)
    raise ValueError(
        f"cannot run a {type(model).__name__} on token ids; the head tools run SentenceEncoder, Bert and "
        "TransformerLM (for other models capture the maps or gates around your own forward call)"
    )


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (cpu for a model without parameters)."""
    p = next(model.parameters(), None)
    return torch.device("cpu") if p is None else p.device


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    lin = nn.Linear(
        weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype
    )
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def rebuild_attention(
    attn: MultiHeadAttention,
    n_heads: int,
    n_kv_heads: int,
    qkv: tuple[Tensor, Tensor | None],
    o: tuple[Tensor, Tensor | None],
    heads: Sequence[int] | None = None,
) -> MultiHeadAttention:
    """A MultiHeadAttention like ``attn`` (width, head dim, rotary, backend, dropout, mode) with new head
    counts and the given fused qkv (weight, bias) and W^O (weight, bias); a bias is kept where given.
    ``heads``: the query heads of ``attn`` that the new module keeps, in order (default all); its
    attention sinks, when it has them, follow those heads."""
    new = MultiHeadAttention(
        attn.d_model,
        n_heads,
        n_kv_heads,
        head_dim=attn.head_dim,
        bias=False,
        dropout=attn.dropout,
        rotary=attn.rotary,
        backend=attn.backend,
        sinks=attn.sinks is not None,
        device=qkv[0].device,
        dtype=qkv[0].dtype,
    )
    new.qkv_proj = _linear(*qkv)
    new.o_proj = _linear(*o)
    if attn.sinks is not None and new.sinks is not None:
        kept = list(range(attn.n_heads)) if heads is None else list(heads)
        with torch.no_grad():
            new.sinks.copy_(attn.sinks[torch.as_tensor(kept, dtype=torch.long, device=attn.sinks.device)])
    return new.train(attn.training)


def plain_attention(layer: TransformerLayer, i: int, what: str) -> MultiHeadAttention:
    """Layer i's self-attention, which must be a plain MultiHeadAttention (not a variant, not pruned away).

    Raises:
        ValueError: otherwise.
    """
    attn = layer.self_attn
    if type(attn) is not MultiHeadAttention:
        raise ValueError(
            f"{what} works on plain MultiHeadAttention; layer {i} has {type(attn).__name__}"
            + (" (every head was pruned)" if getattr(attn, "n_heads", None) == 0 else "")
        )
    return attn


def head_rows(base: int, heads: Sequence[int], head_dim: int) -> Tensor:
    """Row indices ``base + h*D + [0, D)`` of the given heads, in order: (len(heads) * D,) long."""
    idx = torch.as_tensor(list(heads), dtype=torch.long)
    return (base + idx[:, None] * head_dim + torch.arange(head_dim)).flatten()  # (len * D,)
