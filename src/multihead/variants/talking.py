"""``TalkingHeads``: learned mixing across heads before and after the softmax (Shazeer et al., 2020).

"Talking-Heads Attention" (arXiv 2003.02436) inserts two Hq x Hq linear maps across the head dimension,
one on the logits and one on the weights, at every (query, key)::

    J_h = Q_h K_h^T * scale                          per-head logits          (B, Hq, N, L)
    L_h = sum_g J_g P_l[g, h]  (+ bias, mask)        logits mixed across heads
    W_h = softmax(L_h)
    U_h = sum_g W_g P_w[g, h]  (masked again)        weights mixed across heads
    O   = concat_h(U_h V_h) W^O

What it changes of :class:`~multihead.MultiHeadAttention`: the ``attend`` step only (projections, GQA,
rotary, cache, cross-attention, head_mask and W^O are the template's). ``P_l`` and ``P_w`` start as the
identity, so a fresh module computes exactly multi-head attention with the same projections (the paper's
general form also allows different head counts for logits and weights; here both are Hq). Mixing needs
every head's full score tensor, so the core is computed explicitly (:mod:`.explicit`), not through the
fused kernel: O(N L) memory per head, and ``backend`` is unused.

Shape legend: B batch, N query tokens, L keys, d = d_model, Hq query heads, Hkv kv heads, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..backends import registry
from ..core.biases import Bias
from ..core.masks import Mask
from .base import AttentionVariant
from .explicit import explicit_attention

__all__ = ["TalkingHeads", "mix_scores"]


def mix_scores(s: Tensor, p: Tensor) -> Tensor:
    """s (B, H, N, L) mixed across heads by p (H, H): ``out[:, h] = sum_g s[:, g] p[g, h]``."""
    return torch.einsum("bgnl,gh->bhnl", s, p.to(s.dtype))  # (B, H, N, L)


class TalkingHeads(AttentionVariant):
    """Multi-head attention whose heads talk: Hq x Hq mixing of logits and of weights.

    Args:
        d_model, n_heads, n_kv_heads, bias, dropout, rotary, backend: as
            :class:`~multihead.MultiHeadAttention` (``backend`` is unused: the core is explicit).

    Parameters: ``qkv_proj`` and ``o_proj`` laid out as in MultiHeadAttention, ``logit_mix`` (P_l) and
    ``weight_mix`` (P_w), both (Hq, Hq), initialised to the identity.

    Raises:
        ValueError: what :class:`~multihead.variants.base.AttentionVariant` raises for sizes, dropout
            and backend.
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
        backend: str | registry.Backend = "auto",
    ):
        super().__init__(
            d_model, n_heads, n_kv_heads, bias=bias, dropout=dropout, rotary=rotary, backend=backend
        )
        self.logit_mix = nn.Parameter(torch.eye(self.n_heads))  # P_l
        self.weight_mix = nn.Parameter(torch.eye(self.n_heads))  # P_w

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        bias: Bias | Tensor | None = None,
        x: Tensor | None = None,
        context: Tensor | None = None,
    ) -> Tensor:
        """The heads with logits and weights mixed across heads: q (B, Hq, N, D), k and v (B, Hkv, L, D)
        -> (B, Hq, N, D); arguments as :meth:`multihead.MultiHeadAttention.attend`."""
        return explicit_attention(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            compose_logits=lambda s: mix_scores(s, self.logit_mix),
            compose_weights=lambda p: mix_scores(p, self.weight_mix),
            dropout_p=self.attention_dropout(),
        )  # (B, Hq, N, D)
