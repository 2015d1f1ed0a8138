"""``TalkingHeads``: learned mixing across heads before and after the softmax (Shazeer et al., 2020).

"Talking-Heads Attention" (arXiv 2003.02436) inserts two Hq x Hq linear maps across the head dimension,
one on the logits and one on the weights, at every (query, key)::

    J_h = Q_h K_h^T * scale                          per-head logits          (B, Hq, N, L)
    L_h = sum_g J_g P_l[g, h]  (+ bias, mask)        logits mixed across heads
    W_h = softmax(L_h)
    U_h = sum_g W_g P_w[g, h]  (masked again)        weights mixed across heads
    O   = concat_h(U_h V_h) W^O

``P_l`` and ``P_w`` start as the identity, so a fresh module computes exactly multi-head attention with
the same projections (the paper's general form also allows different head counts for logits and weights;
here both are Hq). Mixing needs every head's full score tensor, so the core is computed explicitly
(:mod:`._explicit`), not through the fused kernel: O(N L) memory per head.

Shape legend: B batch, N query tokens, L keys, d = d_model, Hq query heads, Hkv kv heads, D head dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..core.biases import Bias
from ..core.masks import Mask
from .base import AttentionVariant, head_scale
from .explicit import explicit_attention

if TYPE_CHECKING:
    from ..nn.kv_cache import KVCache

__all__ = ["TalkingHeads", "mix_heads"]


def mix_heads(s: Tensor, p: Tensor) -> Tensor:
    """s (B, H, N, L) mixed across heads by p (H, H): ``out[:, h] = sum_g s[:, g] p[g, h]``."""
    return torch.einsum("bgnl,gh->bhnl", s, p.to(s.dtype))  # (B, H, N, L)


class TalkingHeads(AttentionVariant):
    """Multi-head attention whose heads talk: Hq x Hq mixing of logits and of weights.

    The mixing needs every head's full score matrix, so attention is computed explicitly, not through
    the fused kernel (O(Hq N L) memory). Cache, cross-attention, GQA, rotary and head_mask work as in
    MultiHeadAttention.

    Args:
        d_model, n_heads, n_kv_heads, bias, dropout, rotary, backend: as
            :class:`~multihead.MultiHeadAttention` (``backend`` is unused: the core is explicit).

    Parameters: ``qkv_proj`` and ``o_proj`` laid out as in MultiHeadAttention, ``logit_mix`` (P_l) and
    ``weight_mix`` (P_w), both (Hq, Hq), initialised to the identity.

    Raises:
        ValueError: what :class:`AttentionVariant` raises for sizes, dropout and backend.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        bias: bool = True,
        dropout: float = 0.0,
        rotary: nn.Module | None = None,
        backend: str = "auto",
    ):
        super().__init__(
            d_model, n_heads, n_kv_heads, bias=bias, dropout=dropout, rotary=rotary, backend=backend
        )
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        self.qkv_proj = nn.Linear(d_model, (H + 2 * Hkv) * D, bias=bias)  # W^Q | W^K | W^V
        self.o_proj = nn.Linear(H * D, d_model, bias=bias)  # W^O
        self.logit_mix = nn.Parameter(torch.eye(H))  # P_l
        self.weight_mix = nn.Parameter(torch.eye(H))  # P_w

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Mask | Tensor | None = None,
        bias: Bias | Tensor | None = None,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        head_mask: Tensor | None = None,
    ) -> Tensor:
        """(B, N, d) -> (B, N, d); arguments as :meth:`multihead.MultiHeadAttention.forward`.

        Raises:
            ValueError: what MultiHeadAttention.forward raises.
        """
        self._check_call(x, context, cache, positions)
        B, N, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        w, b = self.qkv_proj.weight, self.qkv_proj.bias
        src = x if context is None else context
        q = nn.functional.linear(x, w[: H * D], None if b is None else b[: H * D])  # (B, N, Hq*D)
        kv = nn.functional.linear(src, w[H * D :], None if b is None else b[H * D :])  # (B, L, 2 Hkv D)
        q = q.reshape(B, N, H, D).transpose(1, 2)  # (B, Hq, N, D)
        k, v = kv.reshape(B, -1, 2 * Hkv, D).transpose(1, 2).split(Hkv, dim=1)  # 2 x (B, Hkv, L, D)
        if self.rotary is not None and context is None:
            pos = self._positions(N, cache, positions, x.device)
            q, k = self.rotary(q, pos), self.rotary(k, pos)
        if cache is not None:
            k, v = cache.update(k, v)  # (B, Hkv, L, D) each
        a = explicit_attention(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            compose_logits=lambda s: mix_heads(s, self.logit_mix),
            compose_weights=lambda p: mix_heads(p, self.weight_mix),
            dropout_p=self._attn_dropout(),
        )  # (B, Hq, N, D)
        if head_mask is not None:
            a = a * head_scale(head_mask, B, H).to(a.dtype)  # (B, Hq, N, D)
        self.aux_loss = a.new_zeros(())
        a = a.transpose(1, 2).reshape(B, N, H * D)  # (B, N, Hq*D)
        return self.out_dropout(self.o_proj(a))  # (B, N, d)
