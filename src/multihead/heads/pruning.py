"""Pruning heads for real: smaller projections, fewer FLOPs, the same outputs as masking them.

Removing head h of a layer deletes its D rows of W^Q in the fused ``qkv_proj`` and its D columns of
W^O; because the heads' outputs are concatenated before W^O (docs/equations.md, eq. (5)), the layer then
computes exactly what it computed with ``head_mask[h] = 0``.

GQA: a kv head (its W^K and W^V rows) is removed only when all its query heads are. When the surviving
groups differ in size (2, 3, 3, 3 query heads per kv head, say), every group must have the same size
for the module's ``i // G`` grouping, so the kept kv heads are repeated until each group has
gcd(sizes) query heads (exact; it costs KV memory: prune whole groups to save it).

A layer with every head pruned computes the bias of W^O at every position (what masking all heads
gives): its self-attention becomes an :class:`EmptyAttention`, with no projections at all.

Shape legend: B batch, N tokens, d width, Hq / Hkv query / kv heads, G = Hq // Hkv, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..models.lm import TransformerLM
from ..nn.attention import MultiHeadAttention, check_model_input
from .access import head_rows, layers_of, plain_attention, rebuild_attention

if TYPE_CHECKING:
    from ..nn.kv_cache import KVCache

__all__ = ["EmptyAttention", "prune"]


class EmptyAttention(nn.Module):
    """A self-attention with no heads left: (B, N, d) -> the W^O bias at every position (zeros without).

    Takes the arguments of :meth:`MultiHeadAttention.forward` and ignores them, except ``cache``: the
    cache is advanced by N zero positions so that positions counted from it stay right in decoding.
    """

    n_heads = 0
    n_kv_heads = 0

    def __init__(self, d_model: int, bias: Tensor | None, dropout: float = 0.0):
        super().__init__()
        self.d_model = d_model
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())  # (d,)
        self.out_dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Any = None,
        bias: Any = None,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        head_mask: Tensor | None = None,
    ) -> Tensor:
        """(B, N, d) -> (B, N, d): the W^O bias broadcast over batch and tokens.

        Raises:
            ValueError: x that is not (B, N, d_model).
        """
        check_model_input(x, self.d_model, "x")
        B, N, d = x.shape
        if cache is not None:
            H, dt = cache.n_kv_heads, cache.dtype
            k = torch.zeros(B, H, N, cache.head_dim, dtype=dt, device=x.device)  # (B, Hkv, N, D)
            cache.update(k, torch.zeros(B, H, N, cache.v_head_dim, dtype=dt, device=x.device))
        out = x.new_zeros(B, N, d) if self.bias is None else self.bias.to(x.dtype).expand(B, N, d)
        return self.out_dropout(out)  # (B, N, d)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads=0 (all pruned), bias={self.bias is not None}"


def _pruned(attn: MultiHeadAttention, drop: set[int]) -> MultiHeadAttention | EmptyAttention:
    """``attn`` without the query heads in ``drop`` (and without the kv heads left with no query head)."""
    Hq, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    G = Hq // Hkv
    keep = [h for h in range(Hq) if h not in drop]
    ob = attn.o_proj.bias
    if not keep:
        return EmptyAttention(attn.d_model, ob, attn.dropout).train(attn.training)
    groups = [[h for h in keep if h // G == g] for g in range(Hkv)]
    sub = math.gcd(*(len(s) for s in groups if s))  # query heads per kv head after pruning
    kv = [g for g, s in enumerate(groups) for _ in range(len(s) // sub)]  # kept kv heads, repeated
    rows = torch.cat(
        [head_rows(0, keep, D), head_rows(Hq * D, kv, D), head_rows((Hq + Hkv) * D, kv, D)]
    )  # ((Hq' + 2 Hkv') D,)
    w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
    cols = head_rows(0, keep, D).to(w.device)  # (Hq' D,): W^O columns of the kept heads
    rows = rows.to(w.device)
    with torch.no_grad():
        qkv = (w[rows], None if b is None else b[rows])
        o = (attn.o_proj.weight[:, cols], None if ob is None else ob.clone())
    return rebuild_attention(attn, len(keep), len(kv), qkv, o, keep)  # the sinks of the kept heads


def _check_heads(heads: Any, counts: list[int]) -> dict[int, set[int]]:
    if not isinstance(heads, Mapping):
        raise ValueError(f"heads must be a dict {{layer: [head, ...]}}, got {type(heads).__name__}")
    out: dict[int, set[int]] = {}
    for layer, hs in heads.items():
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(counts):
            raise ValueError(
                f"layer {layer!r} is not a layer index in [0, {len(counts)}); fix the dict's keys"
            )
        if not isinstance(hs, Iterable) or isinstance(hs, (str, bytes)):
            raise ValueError(f"heads[{layer}] must be a list of head indices, got {type(hs).__name__}")
        hs = list(hs)
        bad = [h for h in hs if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < counts[layer]]
        if bad:
            raise ValueError(
                f"heads[{layer}] has {bad}, not head indices in [0, {counts[layer]}) of layer {layer}; "
                "indices count the layer's current heads"
            )
        out[layer] = set(hs)
    return out


def prune(model: nn.Module, heads: Mapping[int, Iterable[int]]) -> nn.Module:
    """Remove heads from the model, in place: ``prune(model, {0: [2, 5], 3: [0]})``.

    Args:
        model: a multihead model (SentenceEncoder, Bert, TransformerLM, Encoder, ...).
        heads: ``{layer: [head, ...]}``: layer indices count the model's TransformerLayers in order, head
            indices the layer's current query heads (after an earlier prune they are renumbered 0..Hq'-1).

    Returns:
        the same model, whose pruned layers have smaller ``qkv_proj`` / ``o_proj`` and updated
        ``n_heads`` / ``n_kv_heads``; it computes what ``head_mask`` with those heads at 0 computes. A
        layer with every head pruned holds an :class:`EmptyAttention` (output: the W^O bias). A
        TransformerLM's ``n_kv_heads`` (used by ``make_cache``) follows when every layer keeps the same
        kv head count.

    Raises:
        ValueError: heads that is not a dict of valid layer and head indices, a layer that is not a plain
            MultiHeadAttention (a variant, or one already pruned to nothing) with heads to remove.
    """
    layers = layers_of(model)
    drop = _check_heads(heads, [getattr(layer.self_attn, "n_heads", 0) for layer in layers])
    for i, hs in drop.items():
        if hs:
            attn = plain_attention(layers[i], i, "prune")
            layers[i].self_attn = _pruned(attn, hs)  # type: ignore[assignment]
    kv = {getattr(layer.self_attn, "n_kv_heads", 0) for layer in layers}
    if isinstance(model, TransformerLM) and len(kv) == 1 and 0 not in kv:
        model.n_kv_heads = kv.pop()
    return model
