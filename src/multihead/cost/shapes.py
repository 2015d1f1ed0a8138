"""What a cost estimate needs to know about a model: a :class:`ModelShape` - the embedding, runs of
identical layers, the head - read here from a multihead module (:func:`from_model`) and in
:mod:`multihead.cost.configs` from a config or a preset. Nothing is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from .ops import norm_params
from .walk import LayerSpec

__all__ = ["ModelShape", "from_model"]


@dataclass(frozen=True)
class ModelShape:
    """The parts of a model that cost something, in forward order: embedding, layers, head.

    ``layers`` holds runs of identical layers as (spec, count) - one run for every stock model, several
    for a model whose layers were pruned to different widths. ``dtype`` is the model's own (its
    parameters', or the config's ``torch_dtype``), None when unknown.
    """

    name: str
    kind: str  # "lm" | "bert" | "encoder" | "layer" | "attention"
    layers: tuple[tuple[LayerSpec, int], ...]
    vocab_size: int = 0  # 0: no token embedding in front of the layers
    positions: str = "none"  # added to the embedding: "learned" | "sinusoidal"; "rotary" | "none" add none
    max_len: int | None = None  # longest sequence the learned position table covers
    token_types: int = 0  # BERT's token-type embeddings
    embed_norm: str | None = None  # BERT normalises the embedding sum
    pooler: bool = False  # BERT's pooler: weights held, not run by forward (so no row)
    final_norm: str | None = None  # pre-LN stacks end with a norm
    lm_head: bool = False
    tie_embeddings: bool = False
    causal: bool = False
    window: int | None = None  # sliding-window attention (Mistral)
    dtype: torch.dtype | None = None

    @property
    def d_model(self) -> int:
        return self.layers[0][0].d_model

    @property
    def n_layers(self) -> int:
        return sum(n for _, n in self.layers)

    @property
    def params(self) -> int:
        """Parameters, a tied head counted once (what ``sum(p.numel() for p in m.parameters())`` gives)."""
        d = self.d_model
        n = sum(spec.params * count for spec, count in self.layers)
        n += self.vocab_size * d * (2 if self.lm_head and not self.tie_embeddings else 1)
        n += (self.max_len or 0) * d if self.positions == "learned" else 0
        n += self.token_types * d
        n += sum(norm_params(k, d) for k in (self.embed_norm, self.final_norm) if k is not None)
        n += d * d + d if self.pooler else 0
        return n

    def mask(self):
        """The self-attention mask the model's forward uses: causal, sliding_window(w), or None."""
        from ..core.masks import causal, sliding_window

        if not self.causal:
            return None
        return causal() if self.window is None else sliding_window(self.window)

    def describe(self) -> str:
        """One line: layers, width, heads, FFN, norm, positions, vocabulary, parameters."""
        s = self.layers[0][0]
        heads = f"{s.n_heads} heads" + ("" if s.n_kv_heads == s.n_heads else f" / {s.n_kv_heads} kv")
        parts = [f"{self.name}: {self.n_layers} x d {s.d_model}, {heads} of {s.head_dim}"]
        if s.ffn:
            ln = "pre-LN" if s.norm_first else "post-LN"
            parts.append(f"FFN {s.d_ff} {s.activation}, {ln} {s.norm}")
        pos = "rotary" if s.rotary else self.positions
        parts.append(f"{pos} positions" + ("" if self.window is None else f", window {self.window}"))
        if self.vocab_size:
            tie = ", tied head" if self.lm_head and self.tie_embeddings else ", head" if self.lm_head else ""
            parts.append(f"vocab {self.vocab_size}{tie}")
        return ", ".join(parts) + f"; {self.params / 1e6:,.1f}M params"


# -- from a module ------------------------------------------------------------------------------------
def _attention_spec(attn: nn.Module, **layer: Any) -> LayerSpec:
    from ..nn.attention import MultiHeadAttention

    if not isinstance(attn, MultiHeadAttention) or not attn.textbook or attn.approx is not None:
        what = type(attn).__name__ + (" with an approximation" if getattr(attn, "approx", None) else "")
        raise ValueError(
            f"the cost model walks exact multihead.MultiHeadAttention, got {what}; estimate the exact "
            "model (before multihead.approx.apply) or pass a config"
        )
    return LayerSpec.make(
        attn.d_model,
        attn.n_heads,
        attn.n_kv_heads,
        head_dim=attn.head_dim,
        bias=attn.qkv_proj.bias is not None,
        rotary=attn.rotary is not None,
        **layer,
    )


def _layer_spec(layer: nn.Module) -> LayerSpec:
    from ..nn.feed_forward import FeedForward
    from ..nn.layers import TransformerLayer

    if not isinstance(layer, TransformerLayer) or not isinstance(layer.ffn, FeedForward):
        raise ValueError(
            f"the cost model walks TransformerLayer with a FeedForward, got {type(layer).__name__}; "
            "estimate a stock model or pass its config"
        )
    if layer.cross_attn is not None:
        raise ValueError(
            "layers with cross-attention (Decoder) are not modelled: their cost depends on the memory "
            "length; estimate the self-attention stack (Encoder / TransformerLM) instead"
        )
    ffn = layer.ffn
    return _attention_spec(
        layer.self_attn,
        d_ff=ffn.d_ff,
        activation=ffn.activation,
        norm=layer.norm_kind,
        norm_first=layer.norm_first,
    )


def _runs(specs: list[LayerSpec]) -> tuple[tuple[LayerSpec, int], ...]:
    """Consecutive equal specs as (spec, count)."""
    runs: list[tuple[LayerSpec, int]] = []
    for s in specs:
        if runs and runs[-1][0] == s:
            runs[-1] = (s, runs[-1][1] + 1)
        else:
            runs.append((s, 1))
    return tuple(runs)


def _norm_kind(m: nn.Module) -> str | None:
    from ..nn.norms import RMSNorm

    return "layernorm" if isinstance(m, nn.LayerNorm) else "rmsnorm" if isinstance(m, RMSNorm) else None


def from_model(model: nn.Module) -> ModelShape:
    """The shape of a multihead module: TransformerLM, Encoder, Bert, SentenceEncoder, TransformerLayer or
    MultiHeadAttention.

    Raises:
        ValueError: another module, a Decoder / cross-attention layer, an approximated attention.
    """
    from ..models.lm import TransformerLM
    from ..nn.attention import MultiHeadAttention
    from ..nn.layers import Decoder, Encoder, TransformerLayer
    from ..pretrained import Bert, SentenceEncoder

    param = next(model.parameters(), None)
    dtype = None if param is None else param.dtype
    name = type(model).__name__
    if isinstance(model, SentenceEncoder):
        return replace(from_model(model.bert), name=name)
    if isinstance(model, Bert):
        emb = model.embeddings
        return replace(
            from_model(model.encoder),
            name=name,
            kind="bert",
            vocab_size=emb.word.num_embeddings,
            positions="learned",
            max_len=model.max_len,
            token_types=emb.token_type.num_embeddings,
            embed_norm="layernorm",
            pooler=model.pooler is not None,
        )
    if isinstance(model, TransformerLM):
        return ModelShape(
            name,
            "lm",
            _runs([_layer_spec(m) for m in model.layers]),
            model.vocab_size,
            model.positions,
            model.max_len,
            final_norm=_norm_kind(model.final_norm),
            lm_head=True,
            tie_embeddings=model.lm_head.weight is model.embed.weight,
            causal=True,
            window=model.sliding_window,
            dtype=dtype,
        )
    if isinstance(model, (Encoder, Decoder)):  # a Decoder's cross-attention layers raise
        runs = _runs([_layer_spec(m) for m in model.layers])
        return ModelShape(name, "encoder", runs, final_norm=_norm_kind(model.final_norm), dtype=dtype)
    if isinstance(model, TransformerLayer):
        return ModelShape(name, "layer", ((_layer_spec(model), 1),), dtype=dtype)
    if isinstance(model, MultiHeadAttention):
        return ModelShape(name, "attention", ((_attention_spec(model, ffn=False), 1),), dtype=dtype)
    raise ValueError(
        f"cannot estimate a {name}; pass a multihead TransformerLM, Encoder, Bert, SentenceEncoder, "
        "TransformerLayer or MultiHeadAttention, a config dict or a preset name"
    )
