"""``OutputGatedAttention``: a sigmoid gate from the layer input on every head's output (Qiu et al., 2025).

"Gated Attention for Large Language Models: Non-linearity, Sparsity, and Attention-Sink-Free" (Qiu et
al., 2025, arXiv 2505.06708; the full-attention layers of Qwen3-Next) multiplies the output of scaled
dot-product attention by a query-dependent sigmoid gate before W^O (their position "G1")::

    head_i = softmax(Q^i K^iT / sqrt(D)) V^i                    (B, N, D) per head, as in MHA
    g      = sigmoid(X W_g + b_g)                               from the layer input X (B, N, d)
    O      = concat_i(head_i * g_i) W^O

    gate="elementwise"  W_g: d -> Hq*D, one gate per head and feature (g_i is (B, N, D))
    gate="headwise"     W_g: d -> Hq,   one scalar gate per head     (g_i is (B, N, 1))

The gate adds a non-linearity between W^V and W^O (whose product is otherwise a low-rank linear map) and
lets a head output nearly nothing for a token without parking its weight on a "sink" key.

What it changes of :class:`~multihead.MultiHeadAttention`: the ``mix_heads`` step only, where the gate
multiplies each head (together with ``head_mask``). The gate depends only on the current tokens' x, so
GQA, masks, biases, rotary, cross-attention (the gate comes from the queries' input), a ``KVCache`` and
every backend work as in the template. Not to be confused with
:class:`~multihead.variants.GatedHeads`, Voita et al.'s (2019) hard-concrete pruning gates: one learned
constant per head trained towards 0 or 1 under an L0 penalty, the same for every token; here the gate is
a function of each token's input and is part of the model.

Initialisation: W_g as ``nn.Linear`` (Kaiming-uniform), b_g to the constant ``gate_bias_init``. With
b_g = 0 a fresh gate sits near 1/2, as the bias-free gate of Qwen3-Next starts. For a module that
starts as plain multi-head attention (to add the gate to a trained model), zero W_g and give b_g a large
value b: every gate is then sigmoid(b) = 1 - e^-b (1 to float64 precision for b >= 37);
:meth:`OutputGatedAttention.from_mha` does this.

Shape legend: B batch, N query tokens, d = d_model, Hq query heads, D head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..backends import registry
from ..nn.attention import MultiHeadAttention
from .base import AttentionVariant

__all__ = ["GATES", "OutputGatedAttention"]

GATES = ("elementwise", "headwise")


class OutputGatedAttention(AttentionVariant):
    """Multi-head attention whose heads are gated by ``sigmoid(x W_g + b_g)`` before W^O (Qiu et al., 2025).

    Args:
        d_model, n_heads, n_kv_heads, bias, dropout, rotary, backend: as
            :class:`~multihead.MultiHeadAttention` (``head_dim`` is ``d_model // n_heads``).
        gate: "elementwise" (W_g: d -> Hq*D, the paper's best variant and Qwen3-Next's) or "headwise"
            (W_g: d -> Hq, one scalar per head and token).
        gate_bias: whether the gate has a bias b_g (independent of ``bias``).
        gate_bias_init: the starting value of every entry of b_g; 0 starts the gates near 1/2, a large
            value (with W_g zeroed) near 1, i.e. as multi-head attention.

    Parameters: ``qkv_proj`` and ``o_proj`` laid out as in MultiHeadAttention, ``gate_proj`` (W_g, b_g).

    Raises:
        ValueError: what :class:`~multihead.variants.base.AttentionVariant` raises, a gate other than
            "elementwise" / "headwise", a non-finite gate_bias_init.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        gate: str = "elementwise",
        gate_bias: bool = True,
        gate_bias_init: float = 0.0,
        bias: bool = True,
        dropout: float = 0.0,
        rotary: nn.Module | None = None,
        backend: str | registry.Backend = "auto",
    ):
        super().__init__(
            d_model, n_heads, n_kv_heads, bias=bias, dropout=dropout, rotary=rotary, backend=backend
        )
        if gate not in GATES:
            raise ValueError(
                f"OutputGatedAttention gate must be one of {list(GATES)}, got {gate!r}; 'elementwise' gates "
                "every feature of every head, 'headwise' every head with one scalar"
            )
        ok = not isinstance(gate_bias_init, bool) and isinstance(gate_bias_init, (int, float))
        if not ok or not math.isfinite(gate_bias_init):
            raise ValueError(
                f"OutputGatedAttention gate_bias_init must be a finite number, got {gate_bias_init!r}; "
                "0 starts the gates near 1/2, a large value (e.g. 40) near 1"
            )
        self.gate = gate
        width = n_heads * self.head_dim if gate == "elementwise" else n_heads
        self.gate_proj = nn.Linear(d_model, width, bias=gate_bias)  # W_g, b_g
        if self.gate_proj.bias is not None:
            nn.init.constant_(self.gate_proj.bias, float(gate_bias_init))

    @classmethod
    def from_mha(
        cls, mha: MultiHeadAttention, *, gate: str = "elementwise", open_bias: float = 40.0
    ) -> OutputGatedAttention:
        """An output-gated module with ``mha``'s projections, W_g = 0 and b_g = ``open_bias``: it computes
        ``sigmoid(open_bias) * mha(x)`` (mha(x) itself, to float64 precision, for open_bias >= 37) and the
        gate can then be trained. Same device, dtype, rotary module (shared) and backend as ``mha``.

        Raises:
            ValueError: an ``mha`` whose head_dim is not d_model // n_heads, and what the constructor
                raises.
        """
        if mha.head_dim * mha.n_heads != mha.d_model:
            raise ValueError(
                f"from_mha needs n_heads * head_dim == d_model, got {mha.n_heads} * {mha.head_dim} != "
                f"{mha.d_model}"
            )
        out = cls(
            mha.d_model,
            mha.n_heads,
            mha.n_kv_heads,
            gate=gate,
            gate_bias_init=open_bias,
            bias=mha.qkv_proj.bias is not None,
            dropout=mha.dropout,
            rotary=mha.rotary,
            backend=mha.backend,
        )
        p = mha.qkv_proj.weight
        out.to(device=p.device, dtype=p.dtype)
        missing, unexpected = out.load_state_dict(mha.state_dict(), strict=False)
        assert not unexpected and all(k.startswith("gate_proj.") for k in missing), (missing, unexpected)
        with torch.no_grad():
            out.gate_proj.weight.zero_()
        return out

    def gates(self, x: Tensor) -> Tensor:
        """g = sigmoid(x W_g + b_g) as a multiplier of the heads: x (B, N, d) -> (B, Hq, N, D) for
        "elementwise", (B, Hq, N, 1) for "headwise"."""
        g = torch.sigmoid(self.gate_proj(x))  # (B, N, Hq*D) or (B, N, Hq)
        if self.gate == "elementwise":
            return self.split_heads(g, self.n_heads)  # (B, Hq, N, D)
        return g.transpose(1, 2).unsqueeze(-1)  # (B, Hq, N, 1)

    def mix_heads(self, a: Tensor, x: Tensor, head_mask: Tensor | None) -> Tensor:
        """Every head (B, Hq, N, D) times its gate from x (B, N, d), then ``head_mask`` as in
        MultiHeadAttention. Returns (B, Hq, N, D)."""
        return super().mix_heads(a * self.gates(x).to(a.dtype), x, head_mask)  # (B, Hq, N, D)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", gate={self.gate!r}"
