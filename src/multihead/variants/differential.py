"""``DifferentialAttention``: the difference of two softmax maps per head (Ye et al., 2025).

"Differential Transformer" (Ye et al., ICLR 2025, arXiv 2410.05258) computes each head's weights as the
difference of two softmax maps, which cancels the attention noise the two maps share::

    A1 = softmax(Q1 K1^T / sqrt(D)),  A2 = softmax(Q2 K2^T / sqrt(D))         two maps, D-wide q and k
    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init                  one learned scalar per layer
    head   = (1 - lambda_init) * RMSNorm((A1 - lambda A2) V)                V is 2D wide
    O      = concat(heads) W^O
    lambda_init = 0.8 - 0.6 exp(-0.3 l)                                     l = 0, 1, ... the layer index

(the paper writes ``exp(-0.3 (l - 1))`` with layers counted from 1). The RMSNorm is the paper's
"GroupNorm": each differential head is normalised on its own, here without a learned scale (as
Hugging Face's DiffLlama; ``norm_affine=True`` adds the paper's per-feature scale).

Layout (the same projections as :class:`~multihead.MultiHeadAttention`, and DiffLlama's): ``qkv_proj``
gives Hq query heads and Hkv key and value heads of width D = d_model // Hq. They pair up by halves::

    differential head i (i < Hq/2):   Q1 = query head i,     Q2 = query head i + Hq/2
    its kv head j = i // G:           K1 = key head j,       K2 = key head j + Hkv/2
                                      V  = value head j (+) value head j + Hkv/2   (2D wide)

with G = Hq / Hkv, so Hq and Hkv must be even and the Hq/2 differential heads keep the GQA grouping.
A1 and A2 are two calls of :func:`multihead.attention` (queries of the first half on keys of the first
half, then the second halves), each with the 2D-wide values, so every backend, mask, bias, GQA and the
``KVCache`` (which keeps the plain keys and values) work as for multi-head attention, and everything is
differentiable. Masks and biases are written for the Hq query heads: query head i + Hq/2 sees the mask
of head i + Hq/2. ``head_mask`` (Hq,) scales each map's output A_i V before the difference.

What it changes of :class:`~multihead.MultiHeadAttention`: ``attend`` (the Hq maps applied to the
2D-wide values, (B, Hq, N, 2D)) and ``mix_heads`` (head_mask, then the difference, the norm and the
(1 - lambda_init) scale, (B, Hq/2, N, 2D)); projections, rotary, the cache and W^O are the template's.
Attention dropout drops each map's weights independently (the paper's code drops the combined map, which
is never formed here).

Shape legend: B batch, N query tokens, L keys, d = d_model, Hq query heads, Hkv kv heads, D head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..backends import registry
from ..core.biases import Bias
from ..core.checks import check_int, check_number
from ..core.functional import attention
from ..core.masks import Mask, MaskContext
from .base import AttentionVariant
from .remap import sub_bias, sub_mask

__all__ = ["DifferentialAttention", "default_lambda_init"]


def default_lambda_init(layer_idx: int) -> float:
    """lambda_init = 0.8 - 0.6 exp(-0.3 l) of layer ``l`` counted from 0 (Ye et al., 2025; DiffLlama)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def _mask_of(mask: Mask | Tensor | None, whole: MaskContext, offset: int) -> Mask | Tensor | None:
    """A mask over the Hq query heads, read for the half of the heads from ``offset``."""
    if isinstance(mask, Tensor) and (mask.dim() < 3 or mask.shape[-3] == 1):
        return mask  # the same for every head
    return sub_mask(mask, whole, offset)


def _bias_of(bias: Bias | Tensor | None, whole: MaskContext, offset: int) -> Bias | Tensor | None:
    """A bias over the Hq query heads, read for the half of the heads from ``offset``."""
    if isinstance(bias, Tensor) and (bias.dim() < 3 or bias.shape[-3] == 1):
        return bias  # the same for every head
    return sub_bias(bias, whole, offset)


class DifferentialAttention(AttentionVariant):
    """Differential attention: (A1 - lambda A2) V per head, normalised (Ye et al., 2025).

    Args:
        d_model, n_heads, n_kv_heads, bias, dropout, rotary, backend: as
            :class:`~multihead.MultiHeadAttention`; ``n_heads`` counts the D-wide query heads (each
            differential head uses two of them), so n_heads and n_kv_heads must be even.
        layer_idx: the layer's index l (from 0), which sets lambda_init = 0.8 - 0.6 exp(-0.3 l).
        lambda_init: overrides that value when given.
        lambda_std: std of the normal initialisation of lq1, lk1, lq2, lk2 (the paper's 0.1).
        norm_eps: epsilon of the per-head RMSNorm.
        norm_affine: a learned per-feature scale in that norm (the paper's code has one, DiffLlama not).

    Parameters: ``qkv_proj`` and ``o_proj`` laid out as in MultiHeadAttention, ``lambda_q1``,
    ``lambda_k1``, ``lambda_q2``, ``lambda_k2`` (each (D,)), and ``norm_weight`` (2D,) with norm_affine.

    Raises:
        ValueError: what :class:`~multihead.variants.base.AttentionVariant` raises, an odd n_heads or
            n_kv_heads, a negative layer_idx, a non-finite lambda_init, a negative lambda_std, norm_eps
            <= 0.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        layer_idx: int = 0,
        lambda_init: float | None = None,
        lambda_std: float = 0.1,
        norm_eps: float = 1e-5,
        norm_affine: bool = False,
        bias: bool = True,
        dropout: float = 0.0,
        rotary: nn.Module | None = None,
        backend: str | registry.Backend = "auto",
    ):
        super().__init__(
            d_model, n_heads, n_kv_heads, bias=bias, dropout=dropout, rotary=rotary, backend=backend
        )
        owner = "DifferentialAttention"
        if self.n_heads % 2 or self.n_kv_heads % 2:
            raise ValueError(
                f"{owner} needs an even n_heads and n_kv_heads (each differential head pairs query head i "
                f"with i + n_heads/2 and kv head j with j + n_kv_heads/2), got n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads}; use e.g. n_kv_heads=2 instead of 1"
            )
        self.layer_idx = check_int("layer_idx", layer_idx, 0, owner=owner)
        if lambda_init is None:
            lambda_init = default_lambda_init(layer_idx)
        ok = not isinstance(lambda_init, bool) and isinstance(lambda_init, (int, float))
        if not ok or not math.isfinite(lambda_init):
            raise ValueError(
                f"{owner} lambda_init must be a finite number or None (0.8 - 0.6 exp(-0.3 layer_idx)), "
                f"got {lambda_init!r}"
            )
        self.lambda_init = float(lambda_init)
        std = check_number("lambda_std", lambda_std, 0.0, math.inf, open_high=True, owner=owner)
        self.norm_eps = check_number("norm_eps", norm_eps, 0.0, math.inf, open_high=True, owner=owner)
        if self.norm_eps == 0.0:
            raise ValueError(f"{owner} norm_eps must be > 0, got {norm_eps!r}; the usual value is 1e-5")
        D = self.head_dim
        self.lambda_q1 = nn.Parameter(torch.randn(D) * std)
        self.lambda_k1 = nn.Parameter(torch.randn(D) * std)
        self.lambda_q2 = nn.Parameter(torch.randn(D) * std)
        self.lambda_k2 = nn.Parameter(torch.randn(D) * std)
        self.norm_weight = nn.Parameter(torch.ones(2 * D)) if norm_affine else None

    def lambda_full(self) -> Tensor:
        """lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, a scalar (at least float32)."""
        dtype = torch.promote_types(self.lambda_q1.dtype, torch.float32)
        l1 = torch.exp(torch.sum(self.lambda_q1.to(dtype) * self.lambda_k1.to(dtype)))
        l2 = torch.exp(torch.sum(self.lambda_q2.to(dtype) * self.lambda_k2.to(dtype)))
        return l1 - l2 + self.lambda_init

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
        """Each of the Hq maps applied to its differential head's 2D-wide value.

        Args:
            q: (B, Hq, N, D); k, v: (B, Hkv, L, D); mask, bias: over (B, Hq, N, L), as
                :meth:`multihead.MultiHeadAttention.forward`.

        Returns:
            (B, Hq, N, 2D): rows [0, Hq/2) are A1 V of the differential heads, rows [Hq/2, Hq) A2 V.
        """
        hq, hkv = self.n_heads // 2, self.n_kv_heads // 2
        v2 = torch.cat([v[:, :hkv], v[:, hkv:]], dim=-1)  # (B, Hkv/2, L, 2D): value head j (+) j + Hkv/2
        whole = MaskContext(q.shape[0], self.n_heads, q.shape[2], k.shape[2])
        maps = []
        for half in (0, 1):
            a = attention(
                q[:, half * hq : (half + 1) * hq],  # (B, Hq/2, N, D)
                k[:, half * hkv : (half + 1) * hkv],  # (B, Hkv/2, L, D)
                v2,
                mask=_mask_of(mask, whole, half * hq),
                bias=_bias_of(bias, whole, half * hq),
                scale=self.score_scale,
                dropout_p=self.attention_dropout(),
                backend=self.backend,
            )  # (B, Hq/2, N, 2D): A1 V (half 0) or A2 V (half 1)
            assert isinstance(a, Tensor)
            maps.append(a)
        return torch.cat(maps, dim=1)  # (B, Hq, N, 2D)

    def mix_heads(self, a: Tensor, x: Tensor, head_mask: Tensor | None) -> Tensor:
        """``head_mask`` on each map's output, then (1 - lambda_init) RMSNorm(A1 V - lambda A2 V).

        Args:
            a: (B, Hq, N, 2D) from :meth:`attend`; x: (B, N, d) (unused); head_mask: (Hq,), (B, Hq) or None.

        Returns:
            (B, Hq/2, N, 2D), the differential heads.
        """
        a = super().mix_heads(a, x, head_mask)  # (B, Hq, N, 2D)
        a1, a2 = a.chunk(2, dim=1)  # 2 x (B, Hq/2, N, 2D)
        diff = a1 - self.lambda_full().to(a.dtype) * a2  # (B, Hq/2, N, 2D)
        low = diff.dtype in (torch.float16, torch.bfloat16)
        t = diff.float() if low else diff  # the norm's statistics in fp32 at least
        w = None if self.norm_weight is None else self.norm_weight.to(t.dtype)
        normed = F.rms_norm(t, (t.shape[-1],), w, self.norm_eps)  # (B, Hq/2, N, 2D)
        return ((1.0 - self.lambda_init) * normed).to(a.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", layer_idx={self.layer_idx}, lambda_init={self.lambda_init:.4g}"
