"""Normalisation layers of the Transformer block: LayerNorm (docs/equations.md, eq. (10) / (13)) and RMSNorm.

``LayerNorm`` is torch's ``nn.LayerNorm``: ``(x - mean) / sqrt(var + eps) * weight + bias`` per token.
``RMSNorm`` (Zhang & Sennrich, 2019; LLaMA, Mistral, Qwen2) drops the centring and the bias:
``x / sqrt(mean(x^2) + eps) * weight``; it normalises in fp32 and casts back, as LLaMA does, so bf16
and fp16 inputs do not lose the statistics. Shapes: any ``(..., d)`` in, same shape out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["NORM_KINDS", "RMSNorm", "make_norm"]

NORM_KINDS = ("layernorm", "rmsnorm")


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last dim: ``x / sqrt(mean(x^2) + eps) * weight``.

    The parameter is named ``weight`` (like ``torch.nn.RMSNorm`` and Hugging Face's ``LlamaRMSNorm``),
    so state dicts of either load directly.
    """

    def __init__(self, d: int, eps: float = 1e-5, *, device=None, dtype=None):
        super().__init__()
        self.d = d
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype in (torch.float32, torch.float64) and x.dtype == self.weight.dtype:
            return F.rms_norm(x, (self.d,), self.weight, self.eps)  # one fused op, same formula
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (..., 1)
        return (xf * inv_rms).to(x.dtype) * self.weight

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}"


def make_norm(kind: str, d: int, eps: float = 1e-5, *, device=None, dtype=None) -> nn.Module:
    """Build the norm named ``kind`` ("layernorm" | "rmsnorm") over ``d`` features.

    Raises:
        ValueError: for an unknown ``kind``.
    """
    if kind == "layernorm":
        return nn.LayerNorm(d, eps=eps, device=device, dtype=dtype)
    if kind == "rmsnorm":
        return RMSNorm(d, eps=eps, device=device, dtype=dtype)
    raise ValueError(f"norm must be one of {list(NORM_KINDS)}, got {kind!r}")
