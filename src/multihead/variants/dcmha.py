"""``DynamicComposition``: dynamically composable multi-head attention (DCMHA; Xiao et al., arXiv 2405.08553).

At every (query i, key j) the vector of head scores ``a = A[:, i, j]`` (Hq entries) is recomposed by::

    Compose(a; X_i, X_j) = a W_b                                    static composition (Hq x Hq)
                         + (a W_q1(X_i)) W_q2(X_i)                  query-wise low-rank projection
                         + (a W_k1(X_j)) W_k2(X_j)                  key-wise low-rank projection
                         + a * tanh(X_i W_qg) + a * tanh(X_j W_kg)  query- and key-wise gates

where ``W_*1`` (Hq x R) and ``W_*2`` (R x Hq) come from the token's attention input X by a two-layer
MLP, ``[W_1 ; W_2] = GELU(X W_a) W_b'``. Compose runs twice with its own parameters: on the scaled
logits before the softmax and on the weights after it (see :mod:`.explicit` for where bias and mask go).

Initialisation: ``W_b`` is the identity and the second MLP layers and the gates are zero, so a fresh
module computes exactly multi-head attention with the same projections.

What it changes of :class:`~multihead.MultiHeadAttention`: the ``attend`` step only (projections, GQA,
rotary, head_mask and W^O are the template's). DCMHA needs the full (B, Hq, N, L) score tensor, so it
**computes attention explicitly** and never goes through the fused kernel (``backend`` is unused):
O(N L) memory per head, plus O(R) per (i, j) for the dynamic terms. The key-wise terms need the
attention input of every key, which a ``KVCache`` does not store, so DCMHA refuses a cache;
cross-attention composes with the context as the key-side input.

Shape legend: B batch, N query tokens, L keys, d = d_model, H = Hq heads, Hkv kv heads, D head dim,
R composition rank, C hidden width of the weight-generating MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..backends import registry
from ..core.biases import Bias
from ..core.checks import check_int
from ..core.masks import Mask
from .base import AttentionVariant
from .explicit import explicit_attention

__all__ = ["Composition", "DynamicComposition"]


class _LowRankWeights(nn.Module):
    """X (B, T, d) -> W1 (B, T, H, R), W2 (B, T, R, H), gate (B, T, H): one side's dynamic weights."""

    def __init__(self, d_model: int, n_heads: int, rank: int, hidden: int):
        super().__init__()
        self.n_heads, self.rank = n_heads, rank
        self.hidden = nn.Linear(d_model, hidden, bias=False)  # W_a
        self.out = nn.Linear(hidden, 2 * n_heads * rank, bias=False)  # W_b'
        self.gate = nn.Linear(d_model, n_heads, bias=False)  # W_g
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.gate.weight)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        H, R = self.n_heads, self.rank
        w = self.out(F.gelu(self.hidden(x)))  # (B, T, 2 H R)
        w1, w2 = w.split(H * R, dim=-1)  # 2 x (B, T, H R)
        return w1.reshape(B, T, H, R), w2.reshape(B, T, R, H), torch.tanh(self.gate(x))  # as documented


class Composition(nn.Module):
    """One Compose of the module doc: a (B, H, N, L) -> (B, H, N, L), given query and key inputs.

    Args:
        d_model: width of the inputs the dynamic weights are computed from.
        n_heads: H, the heads composed.
        rank: R of the dynamic projections.
        hidden: C, hidden width of the weight-generating MLP.
    """

    def __init__(self, d_model: int, n_heads: int, rank: int, hidden: int):
        super().__init__()
        self.static = nn.Parameter(torch.eye(n_heads))  # W_b
        self.query_side = _LowRankWeights(d_model, n_heads, rank, hidden)
        self.key_side = _LowRankWeights(d_model, n_heads, rank, hidden)

    def forward(self, a: Tensor, xq: Tensor, xk: Tensor) -> Tensor:
        """a (B, H, N, L), xq (B, N, d) query inputs, xk (B, L, d) key inputs -> (B, H, N, L)."""
        q1, q2, qg = (t.to(a.dtype) for t in self.query_side(xq))  # (B,N,H,R), (B,N,R,H), (B,N,H)
        k1, k2, kg = (t.to(a.dtype) for t in self.key_side(xk))  # (B,L,H,R), (B,L,R,H), (B,L,H)
        h = a.permute(0, 2, 3, 1)  # (B, N, L, H): the head vector of each (i, j) last
        out = h @ self.static.to(a.dtype)  # (B, N, L, H): a W_b
        out = out + (h @ q1) @ q2  # (B, N, L, H): (a W_q1) W_q2, weights of query i
        hk = h.transpose(1, 2)  # (B, L, N, H)
        out = out + ((hk @ k1) @ k2).transpose(1, 2)  # (B, N, L, H): (a W_k1) W_k2, weights of key j
        out = out + h * (qg.unsqueeze(2) + kg.unsqueeze(1))  # (B, N, L, H): the two gates
        return out.permute(0, 3, 1, 2)  # (B, H, N, L)


class DynamicComposition(AttentionVariant):
    """Multi-head attention with DCMHA's static + dynamic head composition before and after softmax.

    Composition needs every head's full (N, L) score matrix, so attention is computed explicitly
    (:func:`.explicit.explicit_attention`), never through the fused kernel: O(Hq N L) memory. It refuses
    a ``KVCache`` (the key-wise weights need every key's input); cross-attention is supported.

    Args:
        d_model, n_heads, n_kv_heads, bias, dropout, rotary, backend: as
            :class:`~multihead.MultiHeadAttention` (``backend`` is unused: the core is explicit).
        rank: R of the query- and key-wise dynamic projections (the paper uses 2); in [1, n_heads].
        hidden: C, hidden width of the MLP that generates them; default 2 * n_heads * rank.

    Parameters: ``qkv_proj`` and ``o_proj`` as MultiHeadAttention, ``pre`` and ``post``
    (:class:`Composition`, on the logits and on the weights).

    Raises:
        ValueError: what :class:`~multihead.variants.base.AttentionVariant` raises, a rank outside
            [1, n_heads], hidden < 1.
    """

    no_cache = "the key-wise composition needs every key's input vector, which the cache does not keep"

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        rank: int = 2,
        hidden: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        rotary: nn.Module | None = None,
        backend: str | registry.Backend = "auto",
    ):
        super().__init__(
            d_model, n_heads, n_kv_heads, bias=bias, dropout=dropout, rotary=rotary, backend=backend
        )
        H, owner = self.n_heads, "DynamicComposition"
        fix = "a rank above n_heads cannot lower the cost of a full Hq x Hq map; the paper uses 2"
        self.rank = check_int("rank", rank, 1, H, owner=owner, fix=fix)
        self.hidden = check_int("hidden", 2 * H * self.rank if hidden is None else hidden, 1, owner=owner)
        self.pre = Composition(d_model, H, self.rank, self.hidden)  # on the logits
        self.post = Composition(d_model, H, self.rank, self.hidden)  # on the weights

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
        """The heads with scores and weights composed from the inputs: q (B, Hq, N, D), k and v
        (B, Hkv, L, D) -> (B, Hq, N, D); x (B, N, d) is the query-side input, context (B, L, d) (or x)
        the key side. Other arguments as :meth:`multihead.MultiHeadAttention.attend`."""
        assert x is not None, "DynamicComposition composes from the call's input x"
        src = x if context is None else context  # (B, L, d): every key's input (no cache)
        return explicit_attention(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            compose_logits=lambda s: self.pre(s, x, src),
            compose_weights=lambda p: self.post(p, x, src),
            dropout_p=self.attention_dropout(),
        )  # (B, Hq, N, D)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", rank={self.rank}, hidden={self.hidden}"
