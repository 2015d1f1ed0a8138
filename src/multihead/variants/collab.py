"""``CollaborativeHeads``: heads share W_Q and W_K and differ by a mixing vector (Cordonnier et al., 2020).

"Multi-Head Attention: Collaborate Instead of Concatenate" (arXiv 2006.16362) observes that the heads of
a trained model learn redundant key/query projections, and replaces them by one shared pair of width D_k
(``d_shared``) and a mixing vector m_i per head::

    q~ = X W~_Q + b~_Q ,  k~ = X W~_K + b~_K                shared, (B, N, D_k) and (B, L, D_k)
    head_i = softmax((q~ diag(m_i)) k~^T / sqrt(D)) X W_V^i      values and W^O as in MHA

Without rotary the key bias only adds a per-query constant, which the softmax removes, and the query
bias carries the one bias term that matters, ``b_Q^i W_K^iT x_j`` of an MHA head; with rotary the rotated
key bias does depend on the key position, so it is kept (and copied by the re-parametrisation).

Re-parametrising a trained :class:`~multihead.MultiHeadAttention` (:meth:`CollaborativeHeads.from_mha`):
head i's bilinear form is ``T_i = W_Q^iT W_K^i`` (d x d). Concatenation ``W~_Q = [W_Q^1 .. W_Q^H]``,
``W~_K = [W_K^1 .. W_K^H]`` with m_i the indicator of head i's block gives exactly the same scores at
D_k = Hq * D. A lower D_k fits the rank-D_k CP decomposition ``T_i ~ A diag(m_i) B^T`` shared by all
heads by alternating least squares (the paper's tensor decomposition), and the query bias by least
squares.

The scale stays 1/sqrt(D), D = d_model // n_heads, so the re-parametrisation is exact. With rotary, q~ and
k~ are rotated in chunks of the rotary head dim after mixing, which keeps scores relative and, at full
rank, reproduces the MHA's rotary exactly; D_k must then be a multiple of the rotary head dim. The cache
is refused: the shared key has width D_k while ``KVCache`` stores keys and values of one (Hkv, D) shape.

What it changes of :class:`~multihead.MultiHeadAttention`: ``project`` (shared, mixed q~ and k~ in place
of the fused qkv_proj), ``apply_positions`` (rotary in chunks) and ``attend`` (one shared key for every
head, scale 1/sqrt(D)); head_mask, W^O and cross-attention are the template's.

Shape legend: B batch, N query tokens, L keys, d = d_model, H = Hq heads, D head dim, K = D_k shared
key/query width, c = K // rotary head dim, Dr rotary head dim.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..backends import registry
from ..core.biases import Bias
from ..core.checks import check_int
from ..core.masks import Mask
from ..nn.attention import MultiHeadAttention
from .base import AttentionVariant

if TYPE_CHECKING:
    from ..nn.kv_cache import KVCache

__all__ = ["CollaborativeHeads", "cp_decompose"]


class CollaborativeHeads(AttentionVariant):
    """Collaborative multi-head attention: shared W~_Q, W~_K of width D_k and per-head mixing vectors.

    Args:
        d_model, n_heads, bias, dropout, rotary, backend: as :class:`~multihead.MultiHeadAttention`.
        d_shared: D_k, width of the shared query/key projection; default n_heads * head_dim (= d_model),
            the width at which any MHA is re-parametrised exactly.

    Parameters: ``q_proj`` (W~_Q, b~_Q), ``k_proj`` (W~_K, b~_K), ``mixing`` (H, D_k) = rows m_i,
    ``v_proj`` and ``o_proj`` as the value and output maps of MHA (no fused ``qkv_proj``). ``mixing``
    starts as head i's indicator on features ``[i K / H, (i + 1) K / H)``, i.e. as concatenated heads.

    Raises:
        ValueError: what :class:`~multihead.variants.base.AttentionVariant` raises, d_shared < 1, a
            d_shared that is not a multiple of the rotary head dim.
    """

    no_cache = "its shared key has width d_shared while KVCache stores keys and values of one (Hkv, D) shape"

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        d_shared: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        rotary: nn.Module | None = None,
        backend: str | registry.Backend = "auto",
    ):
        super().__init__(d_model, n_heads, bias=bias, dropout=dropout, rotary=rotary, backend=backend)
        H, D = self.n_heads, self.head_dim
        K = H * D if d_shared is None else d_shared
        self.d_shared = check_int(
            "d_shared", K, 1, owner="CollaborativeHeads", fix="it is the shared key width D_k"
        )
        rd = getattr(rotary, "head_dim", None)
        self.rotary_dim = None if rd is None else int(rd)
        if rd is not None and K % rd:
            raise ValueError(
                f"CollaborativeHeads d_shared ({K}) must be a multiple of the rotary head_dim ({rd}): "
                "the shared q/k are rotated in chunks of that width; pick d_shared = a multiple of it"
            )
        del self.qkv_proj  # the projections of eq. (3) are these:
        self.q_proj = nn.Linear(d_model, K, bias=bias)  # W~_Q, b~_Q
        self.k_proj = nn.Linear(d_model, K, bias=bias)  # W~_K, b~_K (it matters only with rotary)
        self.v_proj = nn.Linear(d_model, H * D, bias=bias)  # W_V^1 | ... | W_V^H
        owner = torch.arange(K) * H // K  # (K,): the head whose block feature j starts in
        self.mixing = nn.Parameter((owner[None, :] == torch.arange(H)[:, None]).float())  # (H, K): m_i
        self.score_scale = 1.0 / math.sqrt(D)  # not 1/sqrt(K): the re-parametrisation stays exact

    # -- re-parametrisation ------------------------------------------------------------------------
    @classmethod
    def from_mha(
        cls, mha: MultiHeadAttention, d_shared: int | None = None, *, iters: int = 100
    ) -> CollaborativeHeads:
        """Re-parametrise a (trained) MultiHeadAttention as collaborative heads of shared width D_k.

        Exact (same outputs up to rounding) at ``d_shared = n_heads * head_dim``, the default; below that,
        the rank-D_k CP fit of :func:`cp_decompose` (``iters`` ALS sweeps) and a least-squares query bias.
        GQA / MQA modules are expanded to one key per query head first. Values, W^O, rotary, backend and
        dropout are copied. The result is on the module's device and dtype.

        Raises:
            ValueError: a module whose head_dim * n_heads differs from d_model, d_shared outside
                [1, n_heads * head_dim], iters < 1, d_shared below full rank with rotary (a CP basis
                mixes features across rotary pairs, so the scores would no longer be relative).
        """
        H, D, d = mha.n_heads, mha.head_dim, mha.d_model
        if H * D != d:
            raise ValueError(
                f"from_mha needs n_heads * head_dim == d_model, got {H} * {D} != {d}; "
                "CollaborativeHeads derives its head dim from d_model"
            )
        full = H * D
        K = full if d_shared is None else d_shared
        check_int("d_shared", K, 1, full, owner="from_mha", fix=f"{full} (= n_heads * head_dim) is exact")
        check_int("iters", iters, 1, owner="from_mha")
        if K < full and mha.rotary is not None:
            raise ValueError(
                f"from_mha d_shared={K} < {full} with rotary: a low-rank basis mixes rotary pairs; "
                f"use d_shared={full} (exact) or a module without rotary"
            )
        p = mha.qkv_proj.weight
        out = cls(
            d, H, d_shared=K, bias=mha.o_proj.bias is not None, dropout=mha.dropout,
            rotary=mha.rotary, backend=mha.backend,
        ).to(device=p.device, dtype=p.dtype)  # fmt: skip
        wq, wk, wv, bq, bk, bv = _split_mha(mha)  # (H, D, d) x3, (H, D) x3 or None
        with torch.no_grad():
            if K == full:
                out.q_proj.weight.copy_(wq.reshape(full, d))  # (H*D, d): the heads' rows stacked
                out.k_proj.weight.copy_(wk.reshape(full, d))  # (H*D, d)
                mixing = torch.eye(H, dtype=p.dtype).repeat_interleave(D, dim=1)  # (H, H*D): block indicators
                if bq is not None and bk is not None:
                    out.q_proj.bias.copy_(bq.reshape(full))  # (H*D,)
                    out.k_proj.bias.copy_(bk.reshape(full))  # (H*D,)
            else:
                m, a, b = cp_decompose(wq.double(), wk.double(), K, iters=iters)  # (H,K), (d,K), (d,K)
                out.q_proj.weight.copy_(a.T)
                out.k_proj.weight.copy_(b.T)
                mixing = m
                if bq is not None:  # the key bias cancels without rotary (refused above for K < full)
                    out.q_proj.bias.copy_(_fit_query_bias(wk.double(), bq.double(), m, b))
                    out.k_proj.bias.zero_()
            out.mixing.copy_(mixing)
            out.v_proj.weight.copy_(wv.reshape(full, d))  # (H*D, d)
            if bv is not None:
                out.v_proj.bias.copy_(bv.reshape(full))  # (H*D,)
            out.o_proj.load_state_dict(mha.o_proj.state_dict())
        return out

    # -- the steps it overrides ------------------------------------------------------------------
    def project(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """q~ diag(m_i) per head (B, H, N, K), the shared key k~ (B, 1, L, K) and v (B, H, L, D)."""
        src = x if context is None else context
        q = self.q_proj(x).unsqueeze(1) * self.mixing[None, :, None, :].to(x.dtype)  # (B, H, N, K)
        k = self.k_proj(src).unsqueeze(1)  # (B, 1, L, K)
        return q, k, self.split_heads(self.v_proj(src), self.n_heads)  # v: (B, H, L, D)

    def apply_positions(
        self, q: Tensor, k: Tensor, positions: Tensor | None, cache: KVCache | None
    ) -> tuple[Tensor, Tensor]:
        """Rotary on q (B, H, N, K) and k (B, 1, N, K) in chunks of the rotary head dim; see module doc."""
        if self.rotary is None:
            return q, k
        pos = self.token_positions(q.shape[2], cache, positions, q.device)  # (N,) or (B, N)
        return self._rotate(q, pos), self._rotate(k, pos)

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
        """The template's attention with the shared key read by every head: (B, H, N, D)."""
        k = k.expand(-1, self.n_heads, -1, -1)  # (B, H, L, K): a stride-0 view, not a copy
        return super().attend(q, k, v, mask=mask, bias=bias, x=x, context=context)  # (B, H, N, D)

    def _rotate(self, t: Tensor, pos: Tensor) -> Tensor:
        """Rotary on t (B, H', T, K) in chunks of the rotary head dim Dr: (B, H', T, K) out."""
        assert self.rotary is not None and self.rotary_dim is not None
        B, Hp, T, K = t.shape
        Dr = self.rotary_dim
        c = K // Dr
        chunks = t.reshape(B, Hp, T, c, Dr).transpose(2, 3)  # (B, H', c, T, Dr)
        rotated = self.rotary(chunks.reshape(B, Hp * c, T, Dr), pos)  # (B, H'c, T, Dr)
        return rotated.reshape(B, Hp, c, T, Dr).transpose(2, 3).reshape(B, Hp, T, K)  # (B, H', T, K)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", d_shared={self.d_shared}"


def _split_mha(
    mha: MultiHeadAttention,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Per-head W_Q, W_K, W_V (H, D, d) and biases b_Q, b_K, b_V (H, D) of an MHA, kv heads expanded."""
    H, Hkv, D, d = mha.n_heads, mha.n_kv_heads, mha.head_dim, mha.d_model
    sd = mha.split_state_dict()
    G = H // Hkv
    wq = sd["q_proj.weight"].reshape(H, D, d)  # (H, D, d)
    wk = sd["k_proj.weight"].reshape(Hkv, D, d).repeat_interleave(G, dim=0)  # (H, D, d): kv head i // G
    wv = sd["v_proj.weight"].reshape(Hkv, D, d).repeat_interleave(G, dim=0)  # (H, D, d)
    bq, bk, bv = sd.get("q_proj.bias"), sd.get("k_proj.bias"), sd.get("v_proj.bias")
    bq = None if bq is None else bq.reshape(H, D)  # (H, D)
    bk = None if bk is None else bk.reshape(Hkv, D).repeat_interleave(G, dim=0)  # (H, D)
    bv = None if bv is None else bv.reshape(Hkv, D).repeat_interleave(G, dim=0)  # (H, D)
    return wq, wk, wv, bq, bk, bv


def cp_decompose(wq: Tensor, wk: Tensor, rank: int, *, iters: int = 100) -> tuple[Tensor, Tensor, Tensor]:
    """Rank-r CP fit of the heads' bilinear forms ``T_i = W_Q^iT W_K^i ~ A diag(m_i) B^T`` by ALS.

    Never builds the (H, d, d) tensor: every contraction with T goes through the factors
    ``W_Q^i`` (D x d) and ``W_K^i``, O(H D d r) per sweep.

    Args:
        wq, wk: (H, D, d) per-head query and key projections.
        rank: r, the shared width D_k.
        iters: ALS sweeps.

    Returns:
        ``(m, A, B)``: mixing (H, r), query basis A (d, r) and key basis B (d, r), so that
        ``W~_Q = A^T`` and ``W~_K = B^T``.
    """
    H, D, d = wq.shape
    # Initialise A and B with the leading singular vectors of all heads' query / key rows.
    a = torch.linalg.svd(wq.reshape(H * D, d).T, full_matrices=False)[0][:, :rank]  # (d, r)
    b = torch.linalg.svd(wk.reshape(H * D, d).T, full_matrices=False)[0][:, :rank]  # (d, r)
    if a.shape[1] < rank:  # fewer singular vectors than the rank (H * D < r): pad with random columns
        a = torch.cat([a, torch.randn(d, rank - a.shape[1], dtype=a.dtype)], 1)  # (d, r)
        b = torch.cat([b, torch.randn(d, rank - b.shape[1], dtype=b.dtype)], 1)  # (d, r)

    def t_ab(a: Tensor, b: Tensor) -> Tensor:  # sum_pq T_i[p, q] A[p, r] B[q, r] -> (H, r)
        return ((wq @ a) * (wk @ b)).sum(1)  # (H, D, r) * (H, D, r) summed over D

    def t_mb(m: Tensor, b: Tensor) -> Tensor:  # sum_iq T_i[p, q] m[i, r] B[q, r] -> (d, r)
        return torch.einsum("iep,ier->pr", wq, (wk @ b) * m[:, None, :])  # (d, r)

    def t_ma(m: Tensor, a: Tensor) -> Tensor:  # sum_ip T_i[p, q] m[i, r] A[p, r] -> (d, r)
        return torch.einsum("ieq,ier->qr", wk, (wq @ a) * m[:, None, :])  # (d, r)

    m = t_ab(a, b) @ torch.linalg.pinv((a.T @ a) * (b.T @ b))  # (H, r)
    for _ in range(iters):
        a = t_mb(m, b) @ torch.linalg.pinv((m.T @ m) * (b.T @ b))  # (d, r)
        b = t_ma(m, a) @ torch.linalg.pinv((m.T @ m) * (a.T @ a))  # (d, r)
        m = t_ab(a, b) @ torch.linalg.pinv((a.T @ a) * (b.T @ b))  # (H, r)
    return m, a, b


def _fit_query_bias(wk: Tensor, bq: Tensor, m: Tensor, b: Tensor) -> Tensor:
    """b~_Q (r,) minimising sum_i |B diag(m_i) b~ - W_K^iT b_Q^i|^2: the key-content term of each head."""
    target = torch.einsum("ied,ie->id", wk, bq)  # (H, d): W_K^iT b_Q^i
    design = b[None, :, :] * m[:, None, :]  # (H, d, r): B diag(m_i)
    H, d, r = design.shape
    return torch.linalg.lstsq(design.reshape(H * d, r), target.reshape(H * d, 1)).solution[:, 0]  # (r,)
