"""The Transformer layer (docs/equations.md, eq. (6)-(13)) and the Encoder / Decoder stacks built from it.

Post-LN (``norm_first=False``, the layer of the seed and of the original Transformer), over the whole
packed input X (N x d) at once:

    T1 = MultiHeadAttention(X)      (8)        T4 = FFN(T3)           (11)
    T2 = X + T1                     (9)        T5 = T4 + T3           (12)
    T3 = LayerNorm(T2)              (10)        H  = LayerNorm(T5)     (13)

Pre-LN (``norm_first=True``, GPT-2, LLaMA): ``X + MHA(LN(X))`` then ``+ FFN(LN(.))``. With
``cross_attention=True`` a cross-attention sub-layer over the encoder output ``memory`` sits between the
two (cross-attention: queries from the decoder stream, keys and values from memory), with its own
residual and norm. Dropout on the residual branches (training only) lives inside the sub-layers: the
output dropout of :class:`MultiHeadAttention` and of :class:`FeedForward`, the places torch's
``TransformerEncoderLayer`` drops.

Shape legend: B batch, N tokens, M memory tokens, d = d_model. Layers map (B, N, d) -> (B, N, d).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from ..core.biases import Bias
from ..core.masks import Mask, causal
from .attention import MultiHeadAttention
from .feed_forward import FeedForward
from .norms import make_norm

if TYPE_CHECKING:
    from .kv_cache import KVCache

__all__ = ["Decoder", "Encoder", "TransformerLayer"]

_CAUSAL = causal()


class TransformerLayer(nn.Module):
    """One Transformer block: self-attention, optional cross-attention, FFN, each with residual + norm.

    Args:
        d_model, n_heads, d_ff: width d, query heads, FFN hidden width.
        n_kv_heads: kv heads for GQA / MQA (default n_heads).
        norm: "layernorm" | "rmsnorm".
        norm_first: False = post-LN, exactly eq. (8)-(13); True = pre-LN.
        activation: FFN activation, see :class:`FeedForward`.
        dropout: attention-weight, attention-output and FFN dropout (training only).
        cross_attention: add a cross-attention sub-layer over ``memory`` (decoder of an encoder-decoder).
        bias: biases on every projection.
        rotary: a ``RotaryEmbedding`` for the self-attention (cross-attention never rotates).
        norm_eps: epsilon of the norms.
        backend: attention backend passed to :func:`multihead.attention`.
        self_attn: the self-attention module to use (a head design); default a MultiHeadAttention built
            from the arguments above.

    Raises:
        ValueError: what :class:`MultiHeadAttention`, :class:`FeedForward` and ``make_norm`` raise.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        *,
        n_kv_heads: int | None = None,
        norm: str = "layernorm",
        norm_first: bool = False,
        activation: str = "relu",
        dropout: float = 0.0,
        cross_attention: bool = False,
        bias: bool = True,
        rotary: nn.Module | None = None,
        norm_eps: float = 1e-5,
        backend: str = "auto",
        self_attn: MultiHeadAttention | None = None,
    ):
        super().__init__()
        self.norm_kind, self.norm_first, self.norm_eps = norm, bool(norm_first), norm_eps
        self.attn_norm = make_norm(norm, d_model, norm_eps)
        if self_attn is None:
            self_attn = MultiHeadAttention(
                d_model, n_heads, n_kv_heads, bias=bias, dropout=dropout, rotary=rotary, backend=backend
            )
        self.self_attn = self_attn
        self.cross_attn: MultiHeadAttention | None = None
        self.cross_norm: nn.Module | None = None
        if cross_attention:
            self.cross_norm = make_norm(norm, d_model, norm_eps)
            self.cross_attn = MultiHeadAttention(
                d_model, n_heads, n_kv_heads, bias=bias, dropout=dropout, backend=backend
            )
        self.ffn_norm = make_norm(norm, d_model, norm_eps)
        self.ffn = FeedForward(d_model, d_ff, activation=activation, bias=bias, dropout=dropout)

    def forward(
        self,
        x: Tensor,
        *,
        memory: Tensor | None = None,
        mask: Mask | Tensor | None = None,
        memory_mask: Mask | Tensor | None = None,
        bias: Bias | Tensor | None = None,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        head_mask: Tensor | None = None,
    ) -> Tensor:
        """(B, N, d) -> (B, N, d).

        Args:
            x: (B, N, d) input.
            memory: (B, M, d) encoder output; required exactly when built with ``cross_attention``.
            mask: self-attention mask (True = may attend), e.g. ``mh.causal()``; none is implied.
            memory_mask: cross-attention mask broadcastable to (B, Hq, N, M), e.g. ``mh.key_padding``.
            bias: self-attention score bias (ALiBi, ...).
            cache: this layer's ``KVCache`` for the self-attention.
            positions: rotary positions of x's tokens (default: continue from the cache).
            head_mask: (Hq,) or (B, Hq) float multiplier on each self-attention head's output (1 keeps,
                0 prunes; see :class:`MultiHeadAttention`). The cross-attention is never masked.

        Raises:
            ValueError: memory given without cross-attention or missing with it, bad shapes.
        """
        if (memory is None) != (self.cross_attn is None):
            given = "set" if memory is not None else "None"
            raise ValueError(
                "memory must be given exactly when the layer has cross-attention; this layer has "
                f"cross_attention={self.cross_attn is not None} and memory={given}"
            )
        if memory_mask is not None and memory is None:
            raise ValueError("memory_mask was given without memory; it masks the cross-attention only")

        def self_attention(h: Tensor) -> Tensor:
            return self.self_attn(
                h, mask=mask, bias=bias, cache=cache, positions=positions, head_mask=head_mask
            )

        if self.norm_first:
            return self._pre_ln(x, self_attention, memory, memory_mask)
        return self._post_ln(x, self_attention, memory, memory_mask)

    def _post_ln(self, x: Tensor, self_attention, memory: Tensor | None, memory_mask) -> Tensor:
        t1 = self_attention(x)  # (8)
        t2 = x + t1  # (9)
        t3 = self.attn_norm(t2)  # (10)
        if self.cross_attn is not None and self.cross_norm is not None:
            t3 = self.cross_norm(t3 + self.cross_attn(t3, memory, mask=memory_mask))
        t4 = self.ffn(t3)  # (11)
        t5 = t4 + t3  # (12)
        return self.ffn_norm(t5)  # H (13)

    def _pre_ln(self, x: Tensor, self_attention, memory: Tensor | None, memory_mask) -> Tensor:
        x = x + self_attention(self.attn_norm(x))
        if self.cross_attn is not None and self.cross_norm is not None:
            x = x + self.cross_attn(self.cross_norm(x), memory, mask=memory_mask)
        return x + self.ffn(self.ffn_norm(x))


def per_layer_head_masks(head_mask: Any, n_layers: int) -> list[Tensor | None]:
    """Split a stack's ``head_mask`` into one entry per layer.

    ``head_mask`` is None, a float tensor (L, Hq) or (L, B, Hq) (row i goes to layer i), or a sequence of
    L per-layer masks ((Hq_i,), (B, Hq_i) or None; for stacks whose layers differ in width after pruning).

    Raises:
        ValueError: a head_mask whose first dimension or length is not the number of layers.
    """
    if head_mask is None:
        return [None] * n_layers
    if isinstance(head_mask, Tensor) and head_mask.dim() not in (2, 3):
        raise ValueError(
            f"head_mask must be (L, Hq) or (L, B, Hq) with L = {n_layers} layers, got shape "
            f"{tuple(head_mask.shape)}; give one row per layer"
        )
    masks = list(head_mask)
    if len(masks) != n_layers:
        raise ValueError(
            f"head_mask has {len(masks)} layer entries but the stack has {n_layers} layers; "
            "give one row (or one per-layer mask) per layer"
        )
    return masks


def _check_n_layers(n_layers: Any) -> None:
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be an int >= 1, got {n_layers!r}")


class _Stack(nn.Module):
    """``n_layers`` TransformerLayers and an optional final norm (default: on for pre-LN only)."""

    def __init__(self, n_layers, d_model, n_heads, d_ff, final_norm: bool | None, layer_kwargs):
        super().__init__()
        _check_n_layers(n_layers)
        self.layers = nn.ModuleList(
            TransformerLayer(d_model, n_heads, d_ff, **layer_kwargs) for _ in range(n_layers)
        )
        first = self.layers[0]
        assert isinstance(first, TransformerLayer)
        use_norm = first.norm_first if final_norm is None else bool(final_norm)
        # Pre-LN leaves the residual stream un-normalised, so stacks end with a norm (GPT-2 ln_f);
        # post-LN layers already end with one (eq. (13)).
        self.final_norm = make_norm(first.norm_kind, d_model, first.norm_eps) if use_norm else nn.Identity()


class Encoder(_Stack):
    """A stack of self-attention TransformerLayers (BERT-style encoder).

    ``Encoder(n_layers, d_model, n_heads, d_ff, *, final_norm=None, **layer_kwargs)``: layer_kwargs go
    to every :class:`TransformerLayer` (unknown names raise ``TypeError``). ``final_norm`` defaults to
    True for pre-LN and False for post-LN.

    Raises:
        ValueError: ``n_layers < 1``, ``cross_attention=True``, and what TransformerLayer raises.
    """

    def __init__(
        self, n_layers: int, d_model: int, n_heads: int, d_ff: int, *, final_norm=None, **layer_kwargs
    ):
        if layer_kwargs.get("cross_attention", False):
            raise ValueError("Encoder layers have no cross-attention; use Decoder for cross_attention=True")
        super().__init__(n_layers, d_model, n_heads, d_ff, final_norm, layer_kwargs)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        bias: Bias | Tensor | None = None,
        head_mask: Tensor | Sequence[Tensor | None] | None = None,
    ) -> Tensor:
        """(B, N, d) -> (B, N, d); ``mask`` (e.g. ``mh.key_padding(real)``) and ``bias`` go to every layer.

        ``head_mask``: (L, Hq) or (L, B, Hq) float gates, row i multiplying layer i's head outputs (1 keeps
        a head, 0 prunes it), or a list of L per-layer masks; see :func:`per_layer_head_masks`.

        Raises:
            ValueError: a head_mask of the wrong length or shape, and what the layers raise.
        """
        for layer, layer_head_mask in zip(self.layers, per_layer_head_masks(head_mask, len(self.layers))):
            x = layer(x, mask=mask, bias=bias, head_mask=layer_head_mask)
        return self.final_norm(x)


class Decoder(_Stack):
    """A stack of TransformerLayers with cross-attention over the encoder output (docs/equations.md, sec. 4).

    ``Decoder(n_layers, d_model, n_heads, d_ff, *, final_norm=None, **layer_kwargs)``, as :class:`Encoder`
    with ``cross_attention=True`` in every layer.

    Raises:
        ValueError: ``n_layers < 1``, ``cross_attention=False``, and what TransformerLayer raises.
    """

    def __init__(
        self, n_layers: int, d_model: int, n_heads: int, d_ff: int, *, final_norm=None, **layer_kwargs
    ):
        if not layer_kwargs.pop("cross_attention", True):
            raise ValueError("Decoder layers always have cross-attention; use Encoder for no cross-attention")
        super().__init__(
            n_layers, d_model, n_heads, d_ff, final_norm, {**layer_kwargs, "cross_attention": True}
        )

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        mask: Mask | Tensor | None = _CAUSAL,
        memory_mask: Mask | Tensor | None = None,
        caches: list[KVCache] | None = None,
        head_mask: Tensor | Sequence[Tensor | None] | None = None,
    ) -> Tensor:
        """(B, N, d) over memory (B, M, d) -> (B, N, d).

        Args:
            mask: self-attention mask, ``mh.causal()`` by default (bottom-right, so it also serves
                cached decoding); pass None for no mask.
            memory_mask: cross-attention mask broadcastable to (B, Hq, N, M).
            caches: one ``KVCache`` per layer for incremental decoding (self-attention only; the
                cross-attention keys/values are recomputed from memory at each call).
            head_mask: (L, Hq) or (L, B, Hq) gates on the self-attention heads, row i for layer i, or a
                list of L per-layer masks (see :func:`per_layer_head_masks`).

        Raises:
            ValueError: ``caches`` or ``head_mask`` of the wrong length, and what the layers raise.
        """
        if caches is not None and len(caches) != len(self.layers):
            raise ValueError(
                f"caches has {len(caches)} entries but the decoder has {len(self.layers)} layers"
            )
        head_masks = per_layer_head_masks(head_mask, len(self.layers))
        for i, layer in enumerate(self.layers):
            cache = None if caches is None else caches[i]
            x = layer(
                x, memory=memory, mask=mask, memory_mask=memory_mask, cache=cache, head_mask=head_masks[i]
            )
        return self.final_norm(x)
