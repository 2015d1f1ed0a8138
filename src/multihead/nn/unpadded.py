"""Unpadded inference of post-LN self-attention layers: the token-wise work on the real tokens only.

A batch of B sequences of n_1 .. n_B tokens is held as one packed matrix X of T = sum n_b rows (T, d),
the input matrix of the layer of docs/equations.md (eq. (1)-(13)) with the sequences stacked. Everything but
attention acts on each row alone - the projections of eq. (3) and (5), the FFN (11), the residual
sums and the norms (eq. (9)-(13)) - so it runs on the T real rows, never on padding. Attention alone needs
the sequences apart: the packed q, k, v rows are scattered into a (B, N) padded layout (N = max n_b),
attended under the key-padding mask, and the real rows gathered back::

    X (T, d) -> X W^QKV (T, 3HD) -> scatter (B, N, 3HD) -> heads (B, H, N, D) -> gather (T, HD)
             -> T2 = X + b^O + heads W^O -> T3 = LN(T2) -> T5 = T3 + b2 + act(T3 W1 + b1) W2 -> LN(T5)

A padded batch spends every matmul on its B*N - T pad rows too; one packed row under a document mask
(``mh.document``) does none of that but pays the mask's per-document kernel overhead. Sorted by length,
the padded attention layout wastes little. The residual sums add into the matmul output in place (one
pass over the activations fewer than ``x + linear(h)``) and the activation runs in place.

Inference only: dropout is off and no autograd graph is recorded (call under ``torch.inference_mode``).

Shape legend: B sequences, N longest sequence, T real tokens, d model width, H heads, D head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..core.masks import key_padding
from .attention import MultiHeadAttention
from .feed_forward import FeedForward
from .layers import TransformerLayer

__all__ = ["Varlen", "unpadded_layer", "why_not_unpadded"]

_IN_PLACE_ACTIVATIONS = {
    "relu": lambda h: h.relu_(),
    "gelu": lambda h: torch.ops.aten.gelu_(h),
    "gelu_tanh": lambda h: torch.ops.aten.gelu_(h, approximate="tanh"),
    "silu": lambda h: nn.functional.silu(h, inplace=True),
}


class Varlen(NamedTuple):
    """Where each of the T packed tokens sits in the (B, N) padded layout.

    ``lengths`` (B,) tokens per sequence; ``batch`` and ``position`` (T,) the sequence and the position
    of each packed token, sequence by sequence; ``real`` (B, N) True on real tokens.
    """

    lengths: Tensor
    batch: Tensor
    position: Tensor
    real: Tensor

    @classmethod
    def from_lengths(cls, lengths: Tensor) -> Varlen:
        """The layout of sequences of ``lengths`` (B,) tokens packed one after another.

        Raises:
            ValueError: lengths that are not a 1-d integer tensor of values >= 1.
        """
        if lengths.dim() != 1 or lengths.is_floating_point() or len(lengths) == 0 or int(lengths.min()) < 1:
            raise ValueError(
                f"lengths must be a non-empty 1-d integer tensor of values >= 1, got {lengths!r}; "
                "drop empty sequences before packing"
            )
        B, N = len(lengths), int(lengths.max())
        batch = torch.repeat_interleave(torch.arange(B, device=lengths.device), lengths)  # (T,)
        starts = torch.cumsum(lengths, 0) - lengths  # (B,)
        position = torch.arange(len(batch), device=lengths.device) - starts[batch]  # (T,)
        real = torch.arange(N, device=lengths.device)[None] < lengths[:, None]  # (B, N)
        return cls(lengths, batch, position, real)


def why_not_unpadded(layer: nn.Module) -> str | None:
    """None when :func:`unpadded_layer` computes what ``layer`` computes, else the reason it cannot."""
    if not isinstance(layer, TransformerLayer):
        return f"{type(layer).__name__} is not a TransformerLayer"
    if layer.training:
        return "the layer is in training mode (dropout)"
    if layer.norm_first or layer.cross_attn is not None:
        return "only post-LN layers without cross-attention are unpadded"
    if type(layer.self_attn) is not MultiHeadAttention or layer.self_attn.rotary is not None:
        return f"{type(layer.self_attn).__name__} is not the textbook MultiHeadAttention without rotary"
    ffn = layer.ffn
    if not isinstance(ffn, FeedForward) or ffn.activation not in _IN_PLACE_ACTIVATIONS:
        return "the feed-forward network is not a plain FeedForward (relu, gelu, gelu_tanh, silu)"
    return None


def _add_linear(residual: Tensor, h: Tensor, linear: nn.Module) -> Tensor:
    """``residual + linear(h)``: (T, d) + (T, k) @ W^T (k -> d), the sum accumulated in the matmul (for a
    plain ``nn.Linear``; a quantized or packed layer runs its own kernel and the sum follows)."""
    if type(linear) is not nn.Linear:
        return residual + linear(h)  # (T, d)
    out = residual + linear.bias if linear.bias is not None else residual.clone()  # (T, d)
    return out.addmm_(h, linear.weight.t())  # (T, d)


def unpadded_layer(
    layer: TransformerLayer,
    x: Tensor,
    varlen: Varlen,
    head_mask: Tensor | None = None,
    *,
    scratch: dict[int, Tensor] | None = None,
) -> Tensor:
    """One post-LN layer on packed rows: x (T, d) -> (T, d), equal to the padded layer at real tokens.

    Args:
        layer: a layer :func:`why_not_unpadded` accepts (checked by the caller).
        x: (T, d) the real tokens of the batch, sequence after sequence.
        varlen: their layout (:meth:`Varlen.from_lengths`).
        head_mask: (H,) or (B, H) gates on the heads' outputs before W^O, or None.
        scratch: a dict the layers of one batch share: it keeps the zeroed (B, N, width) padded
            layout of q, k, v between layers (only real rows are ever written, so the pad rows stay
            zero), which saves allocating and zeroing it in every layer.

    Returns:
        (T, d).

    Raises:
        ValueError: a head_mask that is not a float (H,) or (B, H) tensor.
    """
    attn, ffn = layer.self_attn, layer.ffn
    B, N = varlen.real.shape
    H, D = attn.n_heads, attn.head_dim
    if head_mask is not None and (
        not head_mask.is_floating_point() or tuple(head_mask.shape) not in ((H,), (B, H))
    ):
        raise ValueError(
            f"head_mask must be a float tensor of shape (Hq,) = ({H},) or (B, Hq) = ({B}, {H}), got "
            f"{tuple(head_mask.shape)}; use 1.0 to keep a head and 0.0 to prune it"
        )
    Hkv = attn.n_kv_heads
    qkv = attn.qkv_proj(x)  # (T, (H + 2 Hkv) D): eq. (3) on the real rows only
    padded = None if scratch is None else scratch.get(qkv.shape[-1])
    if padded is None or padded.shape[:2] != (B, N) or padded.dtype != qkv.dtype:
        padded = qkv.new_zeros(B, N, qkv.shape[-1])  # (B, N, (H + 2 Hkv) D)
        if scratch is not None:
            scratch[qkv.shape[-1]] = padded
    padded[varlen.batch, varlen.position] = qkv
    q, k, v = padded.split([H * D, Hkv * D, Hkv * D], dim=-1)  # (B, N, H*D), 2 x (B, N, Hkv*D)
    q = q.view(B, N, H, D).transpose(1, 2)  # (B, H, N, D)
    k = k.view(B, N, Hkv, D).transpose(1, 2)  # (B, Hkv, N, D)
    v = v.view(B, N, Hkv, D).transpose(1, 2)  # (B, Hkv, N, D)
    heads = attn.attend(q, k, v, mask=key_padding(varlen.real))  # (B, H, N, D): eq. (4)
    heads = attn.mix_heads(heads, x, head_mask)  # (B, H, N, D); the textbook step does not read x
    heads = heads.transpose(1, 2)[varlen.batch, varlen.position]  # (T, H, D): the real rows
    t2 = _add_linear(x, heads.reshape(len(x), H * D), attn.o_proj)  # (T, d): eq. (8)-(9)
    t3 = layer.attn_norm(t2)  # (T, d): eq. (10)
    h = ffn.linear1(t3)  # (T, F)
    _IN_PLACE_ACTIVATIONS[ffn.activation](h)
    t5 = _add_linear(t3, h, ffn.linear2)  # (T, d): eq. (11)-(12)
    return layer.ffn_norm(t5)  # (T, d): eq. (13)
