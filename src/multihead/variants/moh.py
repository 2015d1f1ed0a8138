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
follow the rows (:mod:`.remap`); the packed rows go in chunks that drop the keys the mask hides from all
of a chunk's rows (with a causal mask, the keys after its last position). With balanced routing
m ~ N top_k / Hr, so query projection and attention work of the routed heads shrink by about that
factor; keys, values, W^O and the shared heads are unchanged. Outputs and gradients equal the
compute-everything path (``skip="never"``), which is faster for short sequences, where gathering costs
more than it saves (``python -m multihead.bench.moh`` measures both).

What it changes of :class:`~multihead.MultiHeadAttention`: the ``heads`` step, since routing decides
which (token, head) pairs are computed at all: it routes, sets the aux loss and gates each head's output,
either through the template's own project / positions / cache / attend steps on every head
(``skip="never"``) or with the routed queries projected and attended on packed rows. head_mask, W^O,
GQA, rotary, the cache and cross-attention are the template's.

Shape legend: B batch, N query tokens, L keys, d = d_model, H = Hq heads, Hkv kv heads, G = H // Hkv,
Hs / Hr shared / routed heads, D head dim, m packed rows per routed head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..backends import registry
from ..core.biases import Bias
from ..core.checks import check_int, check_number
from ..core.masks import EMPTY, Mask, MaskContext, as_mask
from .base import AttentionVariant
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
        backend: str | registry.Backend = "auto",
    ):
        super().__init__(
            d_model, n_heads, n_kv_heads, bias=bias, dropout=dropout, rotary=rotary, backend=backend
        )
        owner, H, Hkv = "MixtureOfHeads", self.n_heads, self.n_kv_heads
        if H < 2:
            raise ValueError(f"{owner} needs n_heads >= 2 (a shared and a routed head), got {H}")
        n_shared = max(1, H // 2) if n_shared is None else n_shared
        fix = "keep at least one routed head"
        self.n_shared = check_int("n_shared", n_shared, 1, H - 1, owner=owner, fix=fix)
        Hr = H - self.n_shared
        top_k = max(1, Hr // 2) if top_k is None else top_k
        fix = f"top_k counts routed heads, n_heads - n_shared = {H} - {self.n_shared} = {Hr}"
        self.top_k = check_int("top_k", top_k, 1, Hr, owner=owner, fix=fix)
        G = H // Hkv
        if self.n_shared % G:
            raise ValueError(
                f"{owner} n_shared ({self.n_shared}) must be a multiple of the GQA group size "
                f"n_heads // n_kv_heads = {G}, so no kv head serves both shared and routed heads"
            )
        self.balance_weight = check_number(
            "balance_weight", balance_weight, 0.0, float("inf"), open_high=True, owner=owner
        )
        if skip not in SKIP_MODES:
            raise ValueError(f"{owner} skip must be one of {list(SKIP_MODES)}, got {skip!r}")
        self.skip = skip
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

    # -- the heads step ----------------------------------------------------------------------------
    def heads(
        self,
        x: Tensor,
        context: Tensor | None,
        *,
        mask: Mask | Tensor | None,
        bias: Bias | Tensor | None,
        cache: KVCache | None,
        positions: Tensor | None,
    ) -> Tensor:
        """The gated heads g_i head_i (B, H, N, D), unchosen routed heads zero; sets ``aux_loss``.

        Arguments as :meth:`multihead.MultiHeadAttention.forward` (already checked).
        """
        r = self.route(x)
        self.aux_loss = self.balance_weight * load_balance(r.chosen, r.probs)
        if self.skips():
            return self._skipping(x, context, r, mask, bias, cache, positions)  # (B, H, N, D)
        a = super().heads(x, context, mask=mask, bias=bias, cache=cache, positions=positions)  # (B, H, N, D)
        return a * r.gates.transpose(1, 2).unsqueeze(-1)  # (B, H, N, D): the paper's path, 0 if not chosen

    def _skipping(self, x, context, r: Routing, mask, bias, cache, positions) -> Tensor:
        """The template's steps with only the shared heads' queries projected up front; the routed heads
        run on the tokens that chose them (:meth:`_routed`). Returns the gated heads (B, H, N, D)."""
        B, N, _ = x.shape
        q = self.project_queries(x, slice(0, self.n_shared))  # (B, Hs, N, D): the shared heads only
        k, v = self.project_keys_values(x if context is None else context)  # (B, Hkv, M or N, D) each
        pos = None
        if context is None:
            if self.rotary is not None:
                pos = self.token_positions(N, cache, positions, x.device)  # (N,) or (B, N)
            q, k = self.apply_positions(q, k, positions, cache)  # (B, Hs, N, D), (B, Hkv, N, D)
        if cache is not None:
            k, v = self.update_cache(cache, k, v)  # (B, Hkv, L, D) each
        whole = MaskContext(B, self.n_heads, N, k.shape[2])
        shared = self._shared(q, k, v, mask, bias, r, whole)  # (B, Hs, N, D)
        return torch.cat([shared, self._routed(x, k, v, pos, mask, bias, r, whole)], dim=1)  # (B, H, N, D)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask, bias) -> Tensor:
        """One attention call of the skipping path (the shared heads, or a chunk of packed rows)."""
        return self.attend(q, k, v, mask=mask, bias=bias)  # (B, h, m, D)

    def _shared(self, q, k, v, mask, bias, r: Routing, whole: MaskContext) -> Tensor:
        """Shared heads' queries q (B, Hs, N, D) on every token -> (B, Hs, N, D), gated."""
        Hs, G = self.n_shared, self.n_heads // self.n_kv_heads
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
        w, b = self.query_rows(slice(Hs, H))  # (Hr*D, d), (Hr*D,): W^Q of the routed heads
        q = torch.einsum("bjmc,jec->bjme", xg, w.reshape(Hr, D, d))  # (B, Hr, m, D)
        if b is not None:
            q = q + b.reshape(1, Hr, 1, D)  # (B, Hr, m, D)
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
