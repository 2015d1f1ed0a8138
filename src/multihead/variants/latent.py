"""``LatentAttention``: multi-head latent attention, MLA (DeepSeek-AI, 2024, "DeepSeek-V2: A Strong,
Economical, and Efficient Mixture-of-Experts Language Model"; also the attention of DeepSeek-V3).

Every head's key and value are rebuilt from one low-rank latent per token, and positions enter through a
small rotary key shared by all heads ("decoupled RoPE"), so a KV cache holds only r + R numbers per token::

    c_kv  = RMSNorm(x W_DKV)                      (B, L, r)        the latent, r = kv_rank
    k_R   = RoPE(x W_KR)                          (B, L, R)        one rotary key for all heads, R = rope_dims
    k_i   = [c_kv W_UK^i | k_R]                   (B, L, Dn + R)   Dn = nope_dims
    v_i   = c_kv W_UV^i                           (B, L, Dv)       Dv = v_head_dim
    q_i   = [q_i^C | RoPE(q_i^R)] from  c_q W_UQ^i, c_q = RMSNorm(x W_DQ) (q_rank set)  or  x W_Q^i
    head_i = softmax(q_i k_i^T * s) v_i,   s = 1 / sqrt(Dn + R)
    out   = [head_1 .. head_H] W^O

**Two forms, the same numbers.** The naive form materialises k_i and v_i for every head and calls
:func:`multihead.attention`. The absorbed form moves W_UK^i into the query,
``q_i^C . (c_kv W_UK^i) = (q_i^C W_UK^iT) . c_kv``, so that every head attends over the one latent key
``[c_kv | k_R]`` (width r + R) with values c_kv (width r) - multi-query attention with a single kv head -
and applies W_UV^i after the weighted sum::

    head_i = (softmax([q_i^C W_UK^iT | RoPE(q_i^R)] [c_kv | k_R]^T * s) c_kv) W_UV^iT

It never builds per-head keys, so a decode step reads only the cached latents. ``absorb=None`` picks the
form with fewer multiply-adds for each call (N queries, L keys): naive ``L r H (Dn + Dv) +
N L H (Dn + R + Dv)``, absorbed ``N H r (Dn + Dv) + 2 N L H (r + G R)`` - the absorbed form for one-token
decode, the naive one for a long prefill.

**Rotary keys per head group** (``rope_heads`` = G > 1; G = 1 above): a model converted from MHA / GQA
with partial RoPE (MHA2MLA, Ji et al., 2025; ``mh.heads.to_mla``) keeps each kv head's own rotary
features, so the latent key is ``[c_kv | k_R^1 .. k_R^G]`` (r + G R numbers per token) and query head i
reads rope key ``i // (H / G)`` (the GQA grouping). The absorbed form then places each head's rotary
query in its group's slot of a width-(r + G R) latent query, zeros elsewhere: the same scores over one
shared latent key.

DeepSeek config names: ``kv_rank`` = kv_lora_rank, ``q_rank`` = q_lora_rank, ``rope_dims`` =
qk_rope_head_dim, ``nope_dims`` = qk_nope_head_dim, ``v_head_dim`` = v_head_dim, ``rope_theta`` =
rope_theta; the latent norms' epsilon is ``norm_eps`` (1e-6 in DeepSeek-V2/V3).

What it changes of :class:`~multihead.MultiHeadAttention`: ``project`` (q, the latent key
``[c_kv | k_R]`` as the one kv head's key and c_kv as its value), ``apply_positions`` (rotary on the rope
features of q and k only), ``attend`` (naive or absorbed) and the cache (a :class:`LatentCache` from
:meth:`LatentAttention.make_cache`); head_mask, W^O and cross-attention are the template's.

Shape legend: B batch, N query tokens, L keys (M context tokens, or the cache length), d = d_model,
H heads, r kv_rank, r_q q_rank, R rope_dims, Dn nope_dims, Dv v_head_dim.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..backends import registry
from ..core.biases import Bias
from ..core.checks import check_int
from ..core.masks import Mask
from ..nn.norms import RMSNorm
from ..nn.positions import RotaryEmbedding
from .base import AttentionVariant
from .latent_cache import LatentCache

if TYPE_CHECKING:
    from ..nn.kv_cache import KVCache

__all__ = ["LatentAttention"]


class LatentAttention(AttentionVariant):
    """Multi-head latent attention (MLA) with a decoupled rotary key and an absorbed decode path.

    Args:
        d_model: model width d.
        n_heads: heads H; must divide d_model (the defaults below derive from D = d_model // n_heads).
        n_kv_heads: must be None: MLA shares keys and values through its latent, not through kv heads.
        kv_rank: r, width of the latent c_kv (DeepSeek kv_lora_rank); default 4 D (DeepSeek-V2's d_c = 4 d_h).
        q_rank: r_q, width of the low-rank query latent c_q (q_lora_rank); None: a full query projection.
        rope_dims: R, width of each rotary key and of each query's rotary part (qk_rope_head_dim);
            default the rotary's head_dim when ``rotary`` is given, else D / 2 (even, at least 2). 0 (only
            without rotary and rope_theta): no rope features at all, keys are ``c_kv W_UK^i`` alone - the
            form a model with absolute positions converts to (``mh.heads.to_mla``).
        nope_dims: Dn, each head's query/key features without positions (qk_nope_head_dim); default D;
            0 (with rope_dims >= 1) when every feature is rotary.
        rope_heads: G, how many rotary keys: 1 (DeepSeek: one k_R shared by all heads) or a divisor of
            n_heads (one per group of H / G heads, as a GQA source's kv heads after ``mh.heads.to_mla``).
        v_head_dim: Dv, each head's value width (v_head_dim); default D.
        rotary: a ``RotaryEmbedding`` of head_dim R rotating the rope features (shared by the layers of a
            model), or any module with ``head_dim`` R and ``forward(x (B, heads, N, R), positions)`` (a
            :class:`~multihead.nn.positions.PartialRotary` of G groups). None (and no ``rope_theta``):
            the rope features are not rotated, as MultiHeadAttention without rotary.
        rope_theta: build ``RotaryEmbedding(R, base=rope_theta)`` (half-split pairs) when rotary is None.
        scale: the softmax scale s; default 1 / sqrt(Dn + R). (DeepSeek-V3 under YaRN rope scaling
            multiplies it by mscale^2.)
        absorb: True: always the absorbed form; False: always the naive form; None: the cheaper per call.
        norm_eps: epsilon of the latent RMSNorms.
        kv_norm: RMSNorm the latent c_kv (DeepSeek-V2/V3 do); False: ``c_kv = x W_DKV`` as it is, so that a
            joint low-rank factorisation of an existing model's W_K, W_V is exact at full rank
            (``mh.heads.to_mla``). ``kv_norm`` is then None.
        bias: biases on the down projections (W_DQ or W_Q, W_DKV|W_KR) and on W^O, as DeepSeek's
            attention_bias; the up projections never have one.
        dropout: attention-weight and output dropout, training only.
        backend: passed to :func:`multihead.attention`.
        device, dtype: of the parameters.

    Parameters: ``q_proj`` (W_Q) or ``q_down`` (W_DQ), ``q_norm``, ``q_up`` (W_UQ), whose rows are head by
    head ``[q_i^C | q_i^R]`` (Dn + R each); ``kv_down`` (rows ``[W_DKV | W_KR^1 .. W_KR^G]``, r + G R);
    ``kv_norm``; ``kv_up`` (rows head by head ``[W_UK^i | W_UV^i]``, Dn + Dv each); ``o_proj`` (W^O).
    Attributes:
    ``head_dim`` = Dn + R (the query/key width of a head), ``n_kv_heads`` = H (per-head keys once
    rebuilt).

    Raises:
        ValueError: n_kv_heads given, sizes that are not ints >= 1, a rope_heads that does not divide
            n_heads (or is not 1 without rope features), a rotary whose head_dim is not
            rope_dims, both rotary and rope_theta, a scale that is not a finite number > 0, an absorb that
            is not a bool or None, and what :class:`~multihead.variants.base.AttentionVariant` raises.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        kv_rank: int | None = None,
        q_rank: int | None = None,
        rope_dims: int | None = None,
        nope_dims: int | None = None,
        v_head_dim: int | None = None,
        rope_heads: int = 1,
        rotary: nn.Module | None = None,
        rope_theta: float | None = None,
        scale: float | None = None,
        absorb: bool | None = None,
        norm_eps: float = 1e-6,
        kv_norm: bool = True,
        bias: bool = False,
        dropout: float = 0.0,
        backend: str | registry.Backend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        owner = type(self).__name__
        if n_kv_heads is not None:
            raise ValueError(
                f"{owner} takes no n_kv_heads (got {n_kv_heads!r}): multi-head latent attention shares keys "
                "and values through its latent of width kv_rank, not through kv heads; drop n_kv_heads and "
                "set kv_rank to size the cache"
            )
        if rotary is not None and rope_theta is not None:
            raise ValueError(
                f"{owner} got both rotary and rope_theta={rope_theta!r}; pass one: rope_theta builds "
                "RotaryEmbedding(rope_dims, base=rope_theta)"
            )
        super().__init__(d_model, n_heads, bias=bias, dropout=dropout, rotary=None, backend=backend)
        del self.qkv_proj, self.o_proj  # the projections of MLA are below
        D, H = d_model // n_heads, n_heads
        rd = getattr(rotary, "head_dim", None)
        if rope_dims is None:
            rope_dims = int(rd) if rd is not None else 2 * max(1, D // 4)
        no_positions = rotary is None and rope_theta is None
        R = check_int(
            "rope_dims", rope_dims, 0 if no_positions else 1, owner=owner,
            fix="" if no_positions else "(0 only without rotary and rope_theta)",
        )  # fmt: skip
        if rd is not None and rd != R:
            raise ValueError(
                f"{owner} rotary has head_dim {rd} but rope_dims={R}: the rotary rotates the rope features; "
                f"build it as RotaryEmbedding({R}) or pass rope_dims={rd}"
            )
        r = check_int("kv_rank", 4 * D if kv_rank is None else kv_rank, 1, owner=owner)
        Dn = check_int(
            "nope_dims", D if nope_dims is None else nope_dims, 0 if R >= 1 else 1, owner=owner,
            fix="(0 only with rope_dims >= 1)",
        )  # fmt: skip
        G = check_int("rope_heads", rope_heads, 1, owner=owner)
        if n_heads % G or (R == 0 and G != 1):
            raise ValueError(
                f"{owner} rope_heads={G} must divide n_heads={n_heads} (one rotary key per group of heads)"
                + (" and be 1 without rope features (rope_dims=0)" if R == 0 else "")
                + f"; choose one of {[g for g in range(1, n_heads + 1) if not n_heads % g and (R or g == 1)]}"
            )
        Dv = check_int("v_head_dim", D if v_head_dim is None else v_head_dim, 1, owner=owner)
        if q_rank is not None:
            check_int("q_rank", q_rank, 1, owner=owner, fix="or None for a full query projection")
        if absorb is not None and not isinstance(absorb, bool):
            raise ValueError(
                f"{owner} absorb must be True, False or None (the cheaper per call), got {absorb!r}"
            )
        if rope_theta is not None:
            rotary = RotaryEmbedding(R, base=rope_theta)
        self.rotary = rotary
        self.kv_rank, self.q_rank, self.rope_dims, self.nope_dims, self.v_head_dim = r, q_rank, R, Dn, Dv
        self.rope_heads = G
        self.head_dim = Dn + R
        self.absorb = absorb
        if scale is None:
            scale = 1.0 / math.sqrt(Dn + R)
        ok = not isinstance(scale, bool) and isinstance(scale, (int, float)) and 0 < scale < math.inf
        if not ok:
            raise ValueError(
                f"{owner} scale must be a finite number > 0 or None (1/sqrt(Dn + R)), got {scale!r}"
            )
        self.score_scale = float(scale)
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.q_proj: nn.Linear | None = None
        self.q_down: nn.Linear | None = None
        self.q_norm: RMSNorm | None = None
        self.q_up: nn.Linear | None = None
        if q_rank is None:
            self.q_proj = nn.Linear(d_model, H * (Dn + R), bias=bias, **fk)  # W_Q
        else:
            self.q_down = nn.Linear(d_model, q_rank, bias=bias, **fk)  # W_DQ
            self.q_norm = RMSNorm(q_rank, norm_eps, **fk)
            self.q_up = nn.Linear(q_rank, H * (Dn + R), bias=False, **fk)  # W_UQ
        self.kv_down = nn.Linear(d_model, r + G * R, bias=bias, **fk)  # [W_DKV | W_KR^1 .. W_KR^G]
        self.kv_norm: RMSNorm | None = RMSNorm(r, norm_eps, **fk) if kv_norm else None
        self.kv_up = nn.Linear(r, H * (Dn + Dv), bias=False, **fk)  # [W_UK^i | W_UV^i] head by head
        self.o_proj = nn.Linear(H * Dv, d_model, bias=bias, **fk)  # W^O

    # -- sizes and the cache ---------------------------------------------------------------------------
    @property
    def cache_numbers_per_token(self) -> int:
        """Numbers one token adds to this layer's cache: r + G R (the latent key)."""
        return self.kv_rank + self.rope_heads * self.rope_dims

    def make_cache(
        self,
        batch_size: int,
        max_len: int,
        *,
        kind: str = "dense",
        window: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> LatentCache:
        """A :class:`LatentCache` for this layer, by default in the dtype and on the device of its weights.

        Raises:
            ValueError: what :class:`LatentCache` raises (a kind other than "dense", bad sizes).
        """
        w = self.kv_down.weight
        return LatentCache(
            batch_size, self.kv_rank, self.rope_heads * self.rope_dims, max_len, kind=kind, window=window,
            dtype=w.dtype if dtype is None else dtype, device=w.device if device is None else device,
        )  # fmt: skip

    def absorbs(self, n_queries: int, n_keys: int) -> bool:
        """Whether a call with ``n_queries`` queries over ``n_keys`` keys runs the absorbed form: ``absorb``
        when set, else the form with fewer multiply-adds (see the module docstring)."""
        if self.absorb is not None:
            return self.absorb
        H, r, R, Dn, Dv = self.n_heads, self.kv_rank, self.rope_dims, self.nope_dims, self.v_head_dim
        naive = n_keys * r * H * (Dn + Dv) + n_queries * n_keys * H * (Dn + R + Dv)
        absorbed = n_queries * H * r * (Dn + Dv) + 2 * n_queries * n_keys * H * (r + self.rope_heads * R)
        return absorbed < naive

    def up_weights(self) -> tuple[Tensor, Tensor]:
        """W_UK (H, Dn, r) and W_UV (H, Dv, r): views of ``kv_up.weight`` split head by head."""
        w = self.kv_up.weight.reshape(self.n_heads, self.nope_dims + self.v_head_dim, self.kv_rank)
        return w[:, : self.nope_dims], w[:, self.nope_dims :]  # (H, Dn, r), (H, Dv, r)

    # -- the steps it overrides ------------------------------------------------------------------------
    def check_call(
        self,
        x: Tensor,
        context: Tensor | None,
        cache: KVCache | None,
        positions: Tensor | None,
        head_mask: Tensor | None,
    ) -> None:
        """The template's checks, and a cache that must be a :class:`LatentCache` of this layer's sizes.

        Raises:
            ValueError: what AttentionVariant.check_call raises; a plain KVCache or a LatentCache of other
                sizes.
        """
        super().check_call(x, context, cache, positions, head_mask)
        if cache is None:
            return
        rope = self.rope_heads * self.rope_dims
        if not isinstance(cache, LatentCache) or (cache.kv_rank, cache.rope_dims) != (self.kv_rank, rope):
            what = "rope_dims" if self.rope_heads == 1 else "rope_heads x rope_dims"
            raise ValueError(
                f"{type(self).__name__} caches latent keys of width kv_rank + {what} = {self.kv_rank} + "
                f"{rope}, got {cache!r}; build its cache with "
                "layer.make_cache(batch_size, max_len) (TransformerLM.make_cache does so for every layer)"
            )

    def project(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, and the latents of the keys' input (x, or ``context`` in cross-attention).

        Returns:
            q (B, H, N, Dn + R) with each head's features ``[q^C | q^R]``; the latent key ``[c_kv | k_R]``
            (B, 1, M, r + G R), the one kv head's key; and c_kv (B, 1, M, r), its value (a view of the key).
        """
        if self.q_proj is not None:
            q = self.q_proj(x)  # (B, N, H (Dn + R))
        else:
            assert self.q_down is not None and self.q_norm is not None and self.q_up is not None
            q = self.q_up(self.q_norm(self.q_down(x)))  # (B, N, H (Dn + R))
        src = x if context is None else context
        rope = self.rope_heads * self.rope_dims
        c_kv, k_rope = self.kv_down(src).split([self.kv_rank, rope], dim=-1)  # (B, M, r), (B, M, G R)
        if self.kv_norm is not None:
            c_kv = self.kv_norm(c_kv)  # (B, M, r)
        k = torch.cat([c_kv, k_rope], dim=-1).unsqueeze(1)  # (B, 1, M, r + G R)
        return self.split_heads(q, self.n_heads), k, k[..., : self.kv_rank]  # (B, H, N, Dn + R), ...

    def apply_positions(
        self, q: Tensor, k: Tensor, positions: Tensor | None, cache: KVCache | None
    ) -> tuple[Tensor, Tensor]:
        """Rotary on the rope features only: the last R of q (B, H, N, Dn + R) and the last G R of the
        latent key (B, 1, N, r + G R), as G rotary keys. Positions as the template's. The identity without
        ``rotary``.

        Returns:
            q and the latent key, same shapes.
        """
        if self.rotary is None:
            return q, k
        B, _, N, _ = k.shape
        G, R = self.rope_heads, self.rope_dims
        q_nope, q_rope = q.split([self.nope_dims, R], dim=-1)  # (B, H, N, Dn), (B, H, N, R)
        c_kv, k_rope = k.split([self.kv_rank, G * R], dim=-1)  # (B, 1, N, r), (B, 1, N, G R)
        k_rope = k_rope.reshape(B, N, G, R).transpose(1, 2)  # (B, G, N, R)
        q_rope, k_rope = super().apply_positions(q_rope, k_rope, positions, cache)
        k_rope = k_rope.transpose(1, 2).reshape(B, 1, N, G * R)  # (B, 1, N, G R)
        return torch.cat([q_nope, q_rope], dim=-1), torch.cat([c_kv, k_rope], dim=-1)

    def update_cache(self, cache: KVCache, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append the latent keys (B, 1, N, r + G R) to the :class:`LatentCache`; return every cached
        position's latent key (B, 1, L, r + G R) and c_kv (B, 1, L, r)."""
        return cache.update(k, v)

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
        """head_1 .. head_H from q (B, H, N, Dn + R), the latent keys k (B, 1, L, r + G R) and c_kv v
        (B, 1, L, r), in the naive or the absorbed form (:meth:`absorbs`): (B, H, N, Dv).

        Masks and biases are those of the H heads over the L keys, (B, H, N, L), in either form.
        """
        if self.absorbs(q.shape[2], k.shape[2]):
            return self._attend_absorbed(q, k, v, mask=mask, bias=bias, x=x, context=context)
        return self._attend_naive(q, k, v, mask=mask, bias=bias, x=x, context=context)

    def _attend_naive(self, q: Tensor, k: Tensor, c_kv: Tensor, **kw: Any) -> Tensor:
        """Per-head keys [c_kv W_UK^i | k_R^g(i)] and values c_kv W_UV^i, then the template's attention."""
        B, _, L, _ = k.shape
        H, Dn, G, R = self.n_heads, self.nope_dims, self.rope_heads, self.rope_dims
        kv = self.kv_up(c_kv[:, 0]).reshape(B, L, H, Dn + self.v_head_dim).transpose(1, 2)  # (B, H, L, Dn+Dv)
        k_nope, v = kv.split([Dn, self.v_head_dim], dim=-1)  # (B, H, L, Dn), (B, H, L, Dv)
        k_rope = k[:, 0, :, self.kv_rank :].reshape(B, L, G, 1, R).transpose(1, 2)  # (B, G, L, 1, R)
        k_rope = k_rope.expand(B, G, L, H // G, R).transpose(2, 3).reshape(B, H, L, R)  # (B, H, L, R)
        keys = torch.cat([k_nope, k_rope], dim=-1)  # (B, H, L, Dn + R)
        return super().attend(q, keys, v, **kw)  # (B, H, N, Dv)

    def _attend_absorbed(self, q: Tensor, k: Tensor, c_kv: Tensor, **kw: Any) -> Tensor:
        """Queries moved into latent space, one shared latent key, then W_UV per head.

        The values passed to the core are the latent keys themselves (c_kv followed by k_R) and the
        output keeps its first r features: the weighted sum of c_kv. One tensor for keys and values lets
        the core read the cache once, with no copy and equal key and value widths (the shape its
        one-kernel decode path serves), for R / r more work in the weighted sum.
        """
        w_uk, w_uv = self.up_weights()  # (H, Dn, r), (H, Dv, r)
        G, R = self.rope_heads, self.rope_dims
        q_nope, q_rope = q.split([self.nope_dims, R], dim=-1)  # (B, H, N, Dn), (B, H, N, R)
        if G > 1:  # each head's rotary query in its group's slot, zeros in the others
            B, H, N, _ = q.shape
            slot = torch.eye(G, dtype=q.dtype, device=q.device).repeat_interleave(H // G, 0)  # (H, G)
            q_rope = (q_rope.unsqueeze(-2) * slot[:, None, :, None]).reshape(B, H, N, G * R)  # (B,H,N,G R)
        q_lat = torch.cat([q_nope @ w_uk.to(q.dtype), q_rope], dim=-1)  # (B, H, N, r + G R)
        o = super().attend(q_lat, k, k, **kw)[..., : self.kv_rank]  # (B, H, N, r): MQA over latent keys
        return o @ w_uv.to(o.dtype).transpose(1, 2)  # (B, H, N, Dv)

    def extra_repr(self) -> str:
        b = self.backend
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, kv_rank={self.kv_rank}, q_rank={self.q_rank}, "
            f"rope_dims={self.rope_dims}, rope_heads={self.rope_heads}, nope_dims={self.nope_dims}, "
            f"v_head_dim={self.v_head_dim}, "
            f"absorb={self.absorb}, dropout={self.dropout}, "
            + (f"backend={b!r}" if isinstance(b, str) else f"backend={b.name}")
        )
