"""``GatedHeads``: multi-head attention with trainable hard-concrete head gates (Voita et al., 2019).

"Analyzing Multi-Head Self-Attention: Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned"
(arXiv 1905.09418) multiplies each head's output by a gate g_h before W^O and trains the gates with an L0
penalty, using the hard-concrete relaxation of Louizos et al. (2018, arXiv 1712.01312)::

    u ~ U(0, 1)
    s   = sigmoid((log u - log(1 - u) + log_alpha_h) / beta)        training: a stochastic gate
    g_h = clamp(s (zeta - gamma) + gamma, 0, 1)                     stretched to (gamma, zeta), clipped
    g_h = clamp(sigmoid(log_alpha_h) (zeta - gamma) + gamma, 0, 1)  eval: deterministic
    L0  = sum_h sigmoid(log_alpha_h - beta log(-gamma / zeta))      expected number of open gates

with beta = 2/3, gamma = -0.1, zeta = 1.1. One gate vector is drawn per forward call (shared by the
batch). ``aux_loss = l0_weight * L0``; add it to the task loss. A gate that is exactly 0 at eval marks
a head that can be pruned without changing the output.

What it changes of :class:`~multihead.MultiHeadAttention`: the ``mix_heads`` step only, where the gates
join the ``head_mask``. Everything else (fused QKV, GQA, rotary, cache, cross-attention, the attention
itself) is the template's, so tools for the textbook layer (approximations, attention maps) accept it.

Shape legend: B batch, N query tokens, d = d_model, Hq query heads, Dv per-head output width.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ..backends import registry
from ..core.checks import check_number
from ..nn.attention import MultiHeadAttention

__all__ = ["GAMMA", "ZETA", "GatedHeads", "hard_concrete", "l0_norm"]

GAMMA, ZETA = -0.1, 1.1  #: the stretch interval (gamma, zeta) of Louizos et al.


def hard_concrete(log_alpha: Tensor, u: Tensor | None, beta: float) -> Tensor:
    """Gates (H,) from log_alpha (H,): sampled with uniform noise ``u`` (H,), deterministic when u is None."""
    if u is None:
        s = torch.sigmoid(log_alpha)  # (H,)
    else:
        u = u.clamp(1e-6, 1 - 1e-6)  # keep log(u) and log(1 - u) finite
        s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / beta)  # (H,)
    return (s * (ZETA - GAMMA) + GAMMA).clamp(0.0, 1.0)


def l0_norm(log_alpha: Tensor, beta: float) -> Tensor:
    """Expected number of non-zero gates, a differentiable scalar (Louizos et al., eq. 12)."""
    return torch.sigmoid(log_alpha - beta * math.log(-GAMMA / ZETA)).sum()


class GatedHeads(MultiHeadAttention):
    """:class:`~multihead.MultiHeadAttention` with one hard-concrete gate per query head.

    Args:
        d_model, n_heads, n_kv_heads, head_dim, bias, dropout, rotary, backend, device, dtype: as
            MultiHeadAttention.
        l0_weight: lambda, the weight of the L0 penalty in ``aux_loss`` (>= 0).
        beta: temperature of the hard-concrete distribution, in (0, 1]; the paper's 2/3 by default.
        init_log_alpha: starting log_alpha of every gate; the default 3.0 opens every gate at eval
            (sigmoid(3) * 1.2 - 0.1 > 1), so a fresh module starts as plain multi-head attention.

    Raises:
        ValueError: what MultiHeadAttention raises, l0_weight < 0, beta outside (0, 1], a non-finite
            init_log_alpha.
    """

    aux_loss: Tensor

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        l0_weight: float = 0.01,
        beta: float = 2 / 3,
        init_log_alpha: float = 3.0,
        head_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        rotary: nn.Module | None = None,
        backend: str | registry.Backend = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__(
            d_model,
            n_heads,
            n_kv_heads,
            head_dim=head_dim,
            bias=bias,
            dropout=dropout,
            rotary=rotary,
            backend=backend,
            device=device,
            dtype=dtype,
        )
        self.l0_weight = check_number(
            "l0_weight", l0_weight, 0.0, math.inf, open_high=True, owner="GatedHeads"
        )
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 < beta <= 1.0:
            raise ValueError(f"GatedHeads beta must be a number in (0, 1] (the paper uses 2/3), got {beta!r}")
        if isinstance(init_log_alpha, bool) or not isinstance(init_log_alpha, (int, float)):
            raise ValueError(f"GatedHeads init_log_alpha must be a finite number, got {init_log_alpha!r}")
        if not math.isfinite(init_log_alpha):
            raise ValueError(f"GatedHeads init_log_alpha must be a finite number, got {init_log_alpha!r}")
        self.beta = float(beta)
        self.log_alpha = nn.Parameter(
            torch.full((n_heads,), float(init_log_alpha), device=device, dtype=dtype)
        )
        self.aux_loss = torch.zeros(())

    def gates(self) -> Tensor:
        """(Hq,) gates: a fresh hard-concrete sample in training mode, the deterministic gates in eval."""
        u = torch.rand_like(self.log_alpha) if self.training else None  # (Hq,)
        return hard_concrete(self.log_alpha, u, self.beta)

    def l0_penalty(self) -> Tensor:
        """The expected number of open gates (a differentiable scalar)."""
        return l0_norm(self.log_alpha, self.beta)

    def mix_heads(self, a: Tensor, x: Tensor, head_mask: Tensor | None) -> Tensor:
        """Every head's output (B, Hq, N, Dv) scaled by its gate (a fresh sample in training) times
        ``head_mask``; sets ``aux_loss`` to the weighted L0 penalty. Returns (B, Hq, N, Dv)."""
        g = self.gates()  # (Hq,)
        self.aux_loss = self.l0_weight * self.l0_penalty()
        return super().mix_heads(a, x, g if head_mask is None else g * head_mask)  # (B, Hq, N, Dv)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["aux_loss"] = state["aux_loss"].detach()  # autograd history cannot be deep-copied
        return state

    def extra_repr(self) -> str:
        return super().extra_repr() + f", l0_weight={self.l0_weight}, beta={self.beta:.4g}"
