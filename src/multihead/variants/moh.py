"""``MixtureOfHeads``: mixture-of-head attention (MoH; Jin et al., arXiv 2410.11842).

Heads are experts. ``Hs`` shared heads work on every token; each token also picks ``top_k`` of the
``Hr = Hq - Hs`` routed heads. The output is a gated sum of the head outputs (two-stage routing)::

    [alpha_1, alpha_2] = softmax(W_h x_t)                          weights of the two groups
    g_i = alpha_1 softmax(W_s x_t)_i                   i <  Hs      shared heads
    g_i = alpha_2 softmax(W_r x_t)_i  if i in TopK     i >= Hs      routed heads (0 when not chosen)
    MoH(x_t) = sum_i g_i head_i(x_t) W^O_i = W^O (g_0 head_0 (+) ... (+) g_{H-1} head_{H-1})

    L_b = sum_{routed i} f_i P_i,  f_i = fraction of tokens that chose head i,
                                   P_i = mean router probability softmax(W_r x_t)_i

``aux_loss = balance_weight * L_b`` (the paper's beta = 0.01). Routing is per query token; every head's
keys and values are computed for all positions, since any later token may choose any head.

**Skipping the heads a token did not choose.** The paper's reference code computes every head for every
token and multiplies by zero gates. Here (``skip="eval"``, the default, in eval mode; ``"always"`` also in
training) the routed heads run on packed rows: for routed head j, the m_j tokens that chose it are
gathered (padded to m = max m_j over batch rows and heads), their queries are projected from those rows
only, and the attention calls cover (B, Hr, m, L) instead of (B, Hr, N, L). The caller's mask and bias
follow the rows (:mod:`._remap`); the packed rows go in chunks that drop the keys the mask hides from all
of a chunk's rows (with a causal mask, the keys after its last position). With balanced routing
m ~ N top_k / Hr, so query projection and attention work of the routed heads shrink by about that
factor; keys, values, W^O and the shared heads are unchanged. Outputs and gradients equal the
compute-everything path (``skip="never"``), which is faster for short sequences, where gathering costs
more than it saves (``python -m multihead.variants.bench`` measures both).

Shape legend: B batch, N query tokens, L keys, d = d_model, H = Hq heads, Hkv kv heads, G = H // Hkv,
Hs / Hr shared / routed heads, D head dim, m packed rows per routed head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.biases import Bias
from ..core.functional import attention
from ..core.masks import EMPTY, Mask, MaskContext, as_mask
from .base import AttentionVariant, check_int, check_number, head_scale
from .remap import sub_bias, sub_mask

if TYPE_CHECKING:
    from ..nn.kv_cache import KVCache

__all__ = ["SKIP_MODES", "MixtureOfHeads", "Routing", "load_balance", "pack_rows"]

SKIP_MODES = ("eval", "always", "never")
PACKED_CHUNK = 128  #: packed query rows per attention call of the routed heads (see _attend_packed)


class Routing(NamedTuple):
    """gates (B, N, H), zero on routed heads not chosen; chosen (B, N, Hr) bool; probs (B, N, Hr)."""

    gates: Tensor
    chosen: Tensor
    probs: Tensor


def load_balance(chosen: Tensor, probs: Tensor) -> Tensor:
    """L_b = sum_i f_i P_i over routed heads: chosen (B, N, Hr) bool, probs (B, N, Hr) -> scalar."""
    f = chosen.to(probs.dtype).mean(dim=(0, 1))  # (Hr,): fraction of tokens that chose head i
    p = probs.mean(dim=(0, 1))  # (Hr,): mean router probability
    return (f * p).sum()


def pack_rows(chosen: Tensor) -> tuple[Tensor, Tensor]:
    """Per routed head, the positions of the tokens that chose it, first m of them in order.

    chosen (B, N, Hr) bool -> rows (B, Hr, m) int64 and valid (B, Hr, m) bool, m = the largest count;
    a head chosen by fewer tokens is padded by repeating its last position (valid False), so positions
    never decrease along m.
    """
    sel = chosen.transpose(1, 2)  # (B, Hr, N)
    count = sel.sum(-1)  # (B, Hr)
    m = int(count.max()) if count.numel() else 0
    order = torch.argsort((~sel).to(torch.int32), dim=-1, stable=True)[..., :m]  # (B, Hr, m): chosen first
    valid = torch.arange(m, device=chosen.device) < count.unsqueeze(-1)  # (B, Hr, m)
    last = order.gather(-1, (count - 1).clamp(min=0).unsqueeze(-1))  # (B, Hr, 1): last chosen position
    return torch.where(valid, order, last), valid


def _visible_prefix(mask: Mask | None, whole: MaskContext, lo: int, hi: int, L: int) -> int:
    """n such that ``mask`` hides keys [n, L) from every query position in [lo, hi]; L if it cannot say.

    Asks the mask's analytic tile classifier whether the tile (queries [lo, hi], keys after the last
    query's bottom-right aligned position) is empty: true for causal, sliding windows and their
    combinations with padding; masks without that analysis keep every key.
    """
    cut = max(1, min(L, hi + whole.offset + 1))
    if mask is None or cut >= L:
        return L
    t = torch.tensor  # one tile: rows [lo, hi + 1), keys [cut, L)
    kinds = mask.block_kinds(whole, t([[lo]]), t([[hi + 1]]), t([[cut]]), t([[L]]))
    return cut if kinds is not None and int(kinds.reshape(-1)[0]) == EMPTY else L  # kinds: (1, 1)


class MixtureOfHeads(AttentionVariant):
    """Mixture-of-head attention: shared heads always on, top-k routed heads per token (see module doc).

    Args:
        d_model, n_heads, n_kv_heads, bias, dropout, rotary, backend: as
            :class:`~multihead.MultiHeadAttention`; ``qkv_proj`` and ``o_proj`` have its layout, so an MHA
            state dict loads (``strict=False``: the routers are new).
        n_shared: Hs, heads every token uses, in [1, n_heads - 1]; default max(1, n_heads // 2). With GQA
            it must be a multiple of G so that no kv group is split between shared and routed heads.
        top_k: routed heads per token, in [1, n_heads - n_shared]; default half of them (at least 1).
        balance_weight: beta, the weight of the load-balance loss in ``aux_loss`` (>= 0).
        skip: "eval" (skip unchosen heads' work in eval mode), "always" or "never".

    Parameters: ``router_groups`` (W_h, 2 x d), ``router_shared`` (W_s, Hs x d), ``router_routed``
    (W_r, Hr x d), no biases, as in the paper.

    Raises:
        ValueError: what :class:`AttentionVariant` raises, n_heads < 2, n_shared or top_k out of range,
            n_shared not a multiple of G, balance_weight < 0, an unknown skip.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        n_shared: int | None = None,
        top_k: int | None = None,
        balance_weight: float = 0.01,
        skip: str = "eval",
        bias: bool = True,
        dropout: float = 0.0,
        rotary: nn.Module | None = None,
        backend: str = "auto",
    ):
        super().__init__(
            d_model, n_heads, n_kv_heads, bias=bias, dropout=dropout, rotary=rotary, backend=backend
        )
        owner, H, Hkv, D = "MixtureOfHeads", self.n_heads, self.n_kv_heads, self.head_dim
        if H < 2:
            raise ValueError(f"{owner} needs n_heads >= 2 (a shared and a routed head), got {H}")
        n_shared = max(1, H // 2) if n_shared is None else n_shared
        self.n_shared = check_int(owner, "n_shared", n_shared, 1, H - 1, fix="keep at least one routed head")
        Hr = H - self.n_shared
        top_k = max(1, Hr // 2) if top_k is None else top_k
        fix = f"top_k counts routed heads, n_heads - n_shared = {H} - {self.n_shared} = {Hr}"
        self.top_k = check_int(owner, "top_k", top_k, 1, Hr, fix=fix)
        G = H // Hkv
        if self.n_shared % G:
            raise ValueError(
                f"{owner} n_shared ({self.n_shared}) must be a multiple of the GQA group size "
                f"n_heads // n_kv_heads = {G}, so no kv head serves both shared and routed heads"
            )
        self.balance_weight = check_number(
            owner, "balance_weight", balance_weight, 0.0, float("inf"), open_high=True
        )
        if skip not in SKIP_MODES:
            raise ValueError(f"{owner} skip must be one of {list(SKIP_MODES)}, got {skip!r}")
        self.skip = skip
        self.qkv_proj = nn.Linear(d_model, (H + 2 * Hkv) * D, bias=bias)  # W^Q | W^K | W^V
        self.o_proj = nn.Linear(H * D, d_model, bias=bias)  # W^O
        self.router_groups = nn.Linear(d_model, 2, bias=False)  # W_h
        self.router_shared = nn.Linear(d_model, self.n_shared, bias=False)  # W_s
        self.router_routed = nn.Linear(d_model, Hr, bias=False)  # W_r

    @property
    def n_routed(self) -> int:
        return self.n_heads - self.n_shared

    # -- routing -------------------------------------------------------------------------------
    def route(self, x: Tensor) -> Routing:
        """Two-stage routing of x (B, N, d): gates (B, N, H), chosen (B, N, Hr), probs (B, N, Hr)."""
        alpha = F.softmax(self.router_groups(x), dim=-1)  # (B, N, 2)
        shared = alpha[..., :1] * F.softmax(self.router_shared(x), dim=-1)  # (B, N, Hs)
        probs = F.softmax(self.router_routed(x), dim=-1)  # (B, N, Hr)
        top = probs.topk(self.top_k, dim=-1).indices  # (B, N, k)
        chosen = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, top, True)  # (B, N, Hr)
        routed = alpha[..., 1:] * probs * chosen  # (B, N, Hr)
        return Routing(torch.cat([shared, routed], dim=-1), chosen, probs)

    def skips(self) -> bool:
        """Whether this call runs the routed heads on the chosen tokens only."""
        return self.skip == "always" or (self.skip == "eval" and not self.training)

    # -- forward -------------------------------------------------------------------------------
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
        H, D = self.n_heads, self.head_dim
        r = self.route(x)
        self.aux_loss = self.balance_weight * load_balance(r.chosen, r.probs)
        pos = None
        if self.rotary is not None and context is None:
            pos = self._positions(N, cache, positions, x.device)  # (N,) or (B, N)
        k, v = self._keys_values(x if context is None else context, pos, cache)  # (B, Hkv, L, D) each
        whole = MaskContext(B, H, N, k.shape[2])
        if self.skips():
            shared = self._shared(x, k, v, pos, mask, bias, r, whole)  # (B, Hs, N, D)
            a = torch.cat([shared, self._routed(x, k, v, pos, mask, bias, r, whole)], dim=1)  # (B, H, N, D)
        else:
            a = self._every_head(x, k, v, pos, mask, bias, r)  # (B, H, N, D)
        if head_mask is not None:
            a = a * head_scale(head_mask, B, H).to(a.dtype)  # (B, H, N, D)
        a = a.transpose(1, 2).reshape(B, N, H * D)  # (B, N, H*D)
        return self.out_dropout(self.o_proj(a))  # (B, N, d)

    def _keys_values(self, src: Tensor, pos: Tensor | None, cache: KVCache | None) -> tuple[Tensor, Tensor]:
        """Every head's keys and values, rotated and appended to the cache: 2 x (B, Hkv, L, D)."""
        HD, Hkv, D = self.n_heads * self.head_dim, self.n_kv_heads, self.head_dim
        w, b = self.qkv_proj.weight, self.qkv_proj.bias
        kv = F.linear(src, w[HD:], None if b is None else b[HD:])  # (B, M, 2 Hkv D)
        kv = kv.reshape(src.shape[0], -1, 2 * Hkv, D).transpose(1, 2)  # (B, 2 Hkv, M, D)
        k, v = kv.split(Hkv, dim=1)  # 2 x (B, Hkv, M, D)
        if pos is not None:
            assert self.rotary is not None
            k = self.rotary(k, pos)
        if cache is not None:
            k, v = cache.update(k, v)  # (B, Hkv, L, D) each
        return k, v

    def _queries(self, x: Tensor, heads: slice) -> Tensor:
        """Queries of heads ``heads`` for every token of x: (B, h, N, D)."""
        D = self.head_dim
        rows = slice(heads.start * D, heads.stop * D)
        w, b = self.qkv_proj.weight[rows], None if self.qkv_proj.bias is None else self.qkv_proj.bias[rows]
        return F.linear(x, w, b).reshape(x.shape[0], x.shape[1], -1, D).transpose(1, 2)  # (B, h, N, D)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask, bias) -> Tensor:
        a = attention(q, k, v, mask=mask, bias=bias, dropout_p=self._attn_dropout(), backend=self.backend)
        assert isinstance(a, Tensor)
        return a

    def _every_head(self, x, k, v, pos, mask, bias, r: Routing) -> Tensor:
        """The paper's path: all heads for all tokens, unchosen ones multiplied by 0 -> (B, H, N, D)."""
        q = self._queries(x, slice(0, self.n_heads))  # (B, H, N, D)
        if pos is not None:
            assert self.rotary is not None
            q = self.rotary(q, pos)
        return self._attend(q, k, v, mask, bias) * r.gates.transpose(1, 2).unsqueeze(-1)  # (B, H, N, D)

    def _shared(self, x, k, v, pos, mask, bias, r: Routing, whole: MaskContext) -> Tensor:
        """Shared heads on every token -> (B, Hs, N, D), gated."""
        Hs, G = self.n_shared, self.n_heads // self.n_kv_heads
        q = self._queries(x, slice(0, Hs))  # (B, Hs, N, D)
        if pos is not None:
            assert self.rotary is not None
            q = self.rotary(q, pos)
        kvs = Hs // G  # kv heads read by the shared heads
        a = self._attend(q, k[:, :kvs], v[:, :kvs], sub_mask(mask, whole, 0), sub_bias(bias, whole, 0))
        return a * r.gates[..., :Hs].transpose(1, 2).unsqueeze(-1)  # (B, Hs, N, D)

    def _routed(self, x, k, v, pos, mask, bias, r: Routing, whole: MaskContext) -> Tensor:
        """Routed heads on the tokens that chose them only, scattered back -> (B, Hr, N, D), gated."""
        B, N, d = x.shape
        H, Hs, Hr, D = self.n_heads, self.n_shared, self.n_routed, self.head_dim
        rows, valid = pack_rows(r.chosen)  # (B, Hr, m) each
        m = rows.shape[-1]
        index = rows.unsqueeze(-1).expand(B, Hr, m, d)  # (B, Hr, m, d)
        xg = x.unsqueeze(1).expand(B, Hr, N, d).gather(2, index)  # (B, Hr, m, d): the chosen tokens
        w = self.qkv_proj.weight[Hs * D : H * D].reshape(Hr, D, d)  # (Hr, D, d): W^Q of the routed heads
        q = torch.einsum("bjmc,jec->bjme", xg, w)  # (B, Hr, m, D)
        if self.qkv_proj.bias is not None:
            q = q + self.qkv_proj.bias[Hs * D : H * D].reshape(1, Hr, 1, D)  # (B, Hr, m, D)
        if pos is not None:
            assert self.rotary is not None
            pg = pos.expand(B, N).unsqueeze(1).expand(B, Hr, N).gather(2, rows)  # (B, Hr, m)
            q = q.reshape(B * Hr, 1, m, D)  # (B Hr, 1, m, D): one position row per (batch, head)
            q = self.rotary(q, pg.reshape(B * Hr, m)).reshape(B, Hr, m, D)  # (B, Hr, m, D)
        kvs = Hs // (H // self.n_kv_heads)  # first kv head of the routed heads
        a = self._attend_packed(q, k[:, kvs:], v[:, kvs:], rows, mask, bias, whole)  # (B, Hr, m, D)
        g = r.gates[..., Hs:].transpose(1, 2).gather(2, rows) * valid  # (B, Hr, m): 0 on padding rows
        a = a * g.unsqueeze(-1).to(a.dtype)  # (B, Hr, m, D)
        index = rows.unsqueeze(-1).expand(B, Hr, m, D)  # (B, Hr, m, D)
        return a.new_zeros(B, Hr, N, D).scatter_add(2, index, a)  # (B, Hr, N, D); padding adds zeros

    def _attend_packed(self, q, k, v, rows: Tensor, mask, bias, whole: MaskContext) -> Tensor:
        """Routed attention of packed rows q (B, Hr, m, D) at positions rows (B, Hr, m) -> (B, Hr, m, D).

        In chunks of PACKED_CHUNK rows; each chunk drops the trailing keys that the mask hides from every
        row in it (for a causal mask: the keys after the chunk's last position), which recovers the
        triangle a fused causal kernel skips and packed rows with an explicit mask would not.
        """
        base = None if mask is None else as_mask(mask)
        m, L, Hs = q.shape[2], k.shape[2], self.n_shared
        outs = []
        for r0 in range(0, m, PACKED_CHUNK):
            rc = rows[..., r0 : r0 + PACKED_CHUNK]  # (B, Hr, c)
            n = _visible_prefix(base, whole, int(rc[..., 0].min()), int(rc[..., -1].max()), L)
            outs.append(
                self._attend(
                    q[:, :, r0 : r0 + PACKED_CHUNK],
                    k[:, :, :n],
                    v[:, :, :n],
                    sub_mask(base, whole, Hs, rc),
                    sub_bias(bias, whole, Hs, rc),
                )
            )  # (B, Hr, c, D)
        return torch.cat(outs, dim=2)  # (B, Hr, m, D)

    def extra_repr(self) -> str:
        return (
            super().extra_repr()
            + f", n_shared={self.n_shared}, top_k={self.top_k}, balance_weight={self.balance_weight}, "
            f"skip={self.skip!r}"
        )
