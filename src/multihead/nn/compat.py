"""``MultiheadAttention``: a drop-in replacement for ``torch.nn.MultiheadAttention`` on our core.

Same constructor, forward signature, return values, parameter names and ``state_dict`` keys as torch, so
``ours.load_state_dict(torch_mha.state_dict())`` gives the same results; parameters are created and
initialised in torch's order, so under one RNG seed both modules even start from the same weights. The
attention itself is one call of :func:`multihead.attention` (docs/equations.md, eq. (2)). torch's mask
conventions hold at this boundary and are converted once, here:

    torch (this module)                                  multihead core
    key_padding_mask bool, True = IGNORE this key   ->   mh.key_padding(~kpm), True = may attend
    attn_mask bool, True = NOT allowed              ->   mask tensor ~attn_mask, True = may attend
    float key_padding_mask / attn_mask              ->   bias= tensor, added to the scaled scores
    bias_k / bias_v, add_zero_attn                  ->   extra keys appended; masks padded with "allowed"

Shape legend: B batch, L target (query) length, S source (key) length, S' = S + the appended keys (one for
``add_bias_kv``, one for ``add_zero_attn``), E embed_dim, H num_heads, hd = E // H, Ek kdim, Ev vdim.

Differences from torch, on purpose:
    * A query row whose keys are all masked gets zero weights and a zero attention output, so its
      ``attn_output`` row is ``out_proj.bias`` (zeros without bias); gradients there are zero. torch
      returns NaN for such rows when ``need_weights=True`` and on its inference fast path.
    * Bad arguments raise ``ValueError`` naming the argument (torch raises AssertionError/RuntimeError);
      mixing a bool and a float mask is accepted without torch's deprecation warning.
    * No NestedTensor inputs (torch accepts them only on its fast path).

Inside ``nn.TransformerEncoderLayer`` in eval mode without grad, torch's fused layer kernel reads this
module's parameters and calls :meth:`MultiheadAttention.merge_masks` instead of :meth:`forward`, exactly as
it does with torch's own module, so results there are torch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn import Parameter

from ..core.functional import attention
from ..core.masks import Mask, as_mask, custom, key_padding
from ..core.problem import AttentionOutput

__all__ = ["MultiheadAttention"]


def _top_left_causal(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """torch SDPA's ``is_causal=True``: query i sees keys j <= i, counted from the first key (top-left)."""
    return k <= q


class MultiheadAttention(nn.Module):
    """Drop-in for ``torch.nn.MultiheadAttention``; the module docstring lists where it differs.

    Args:
        embed_dim: E, the model width; must be divisible by ``num_heads``.
        num_heads: H; each head has hd = E // H features.
        dropout: dropout on the attention weights in training, in [0, 1).
        bias: learn ``in_proj_bias`` (3E,) and ``out_proj.bias`` (E,).
        add_bias_kv: learn ``bias_k`` / ``bias_v`` (1, 1, E), appended as one extra key/value position.
        add_zero_attn: append one all-zero key/value position (after ``bias_k`` when both are set).
        kdim, vdim: Ek, Ev, the key/value input widths (default E). When either differs from E the
            projections are ``q_proj_weight`` (E, E), ``k_proj_weight`` (E, Ek), ``v_proj_weight`` (E, Ev)
            instead of the packed ``in_proj_weight`` (3E, E).
        batch_first: inputs and output are (B, N, feature) instead of (N, B, feature).
        device, dtype: of the parameters.

    Raises:
        ValueError: ``embed_dim`` / ``num_heads`` / ``kdim`` / ``vdim`` not positive integers,
            ``embed_dim`` not divisible by ``num_heads``, ``dropout`` outside [0, 1).
    """

    in_proj_weight: Parameter | None
    q_proj_weight: Parameter | None
    k_proj_weight: Parameter | None
    v_proj_weight: Parameter | None
    in_proj_bias: Parameter | None
    bias_k: Parameter | None
    bias_v: Parameter | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_config(embed_dim, num_heads, dropout, kdim, vdim)
        fk: dict = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = float(dropout)
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.add_zero_attn = add_zero_attn
        # Registration order is torch's: same state_dict key order, and the same RNG draws (out_proj's
        # own init first, then _reset_parameters), so one seed gives both modules the same weights.
        if self._qkv_same_embed_dim:
            self.in_proj_weight = Parameter(torch.empty((3 * embed_dim, embed_dim), **fk))
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        else:
            self.q_proj_weight = Parameter(torch.empty((embed_dim, embed_dim), **fk))
            self.k_proj_weight = Parameter(torch.empty((embed_dim, self.kdim), **fk))
            self.v_proj_weight = Parameter(torch.empty((embed_dim, self.vdim), **fk))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = Parameter(torch.empty(3 * embed_dim, **fk))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **fk)
        if add_bias_kv:
            self.bias_k = Parameter(torch.empty((1, 1, embed_dim), **fk))
            self.bias_v = Parameter(torch.empty((1, 1, embed_dim), **fk))
        else:
            self.register_parameter("bias_k", None)
            self.register_parameter("bias_v", None)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch's init: xavier_uniform on the in-projections, zero biases, xavier_normal on bias_k/v."""
        for w in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
            if w is not None:
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        for b in (self.bias_k, self.bias_v):
            if b is not None:
                nn.init.xavier_normal_(b)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention of ``query`` over ``key``/``value``, with torch's arguments and return values.

        Args:
            query: (L, B, E), or (B, L, E) with ``batch_first``, or unbatched (L, E).
            key: (S, B, Ek), (B, S, Ek) or unbatched (S, Ek).
            value: (S, B, Ev), (B, S, Ev) or unbatched (S, Ev).
            key_padding_mask: (B, S), unbatched (S,). Bool: True = IGNORE that key; float: added.
            need_weights: also return the attention weights (computed by the ``matrix`` backend).
            attn_mask: (L, S), or (B * H, L, S) with row ``b * H + h`` for batch b, head h (unbatched:
                (H, L, S)). Bool: True = NOT allowed; float: added to the scaled scores.
            average_attn_weights: return the weights averaged over heads instead of per head.
            is_causal: torch's hint that ``attn_mask`` is the causal mask; needs ``attn_mask``. As in
                torch, when it is set with ``need_weights=False`` and no ``key_padding_mask``, the
                content of ``attn_mask`` is ignored and SDPA's top-left causal mask over all S' keys is
                used, so appended ``bias_k`` / zero keys are hidden from rows before them.

        Returns:
            ``(attn_output, attn_weights)``: attn_output in the layout of ``query``; attn_weights
            (B, L, S') averaged or (B, H, L, S') per head ((L, S') / (H, L, S') unbatched), after dropout,
            or None when ``need_weights`` is False.

        Raises:
            ValueError: wrong ranks or feature sizes, batch or length mismatches, masks of the wrong
                dtype or shape, ``is_causal=True`` without ``attn_mask``, nested tensors.
        """
        is_batched = _check_inputs(self, query, key, value)
        if is_batched:
            seq, batch = (1, 0) if self.batch_first else (0, 1)
            bsz, tgt_len, src_len = query.shape[batch], query.shape[seq], key.shape[seq]
        else:
            bsz, tgt_len, src_len = 1, query.shape[0], key.shape[0]
        _check_masks(key_padding_mask, attn_mask, is_batched, bsz, self.num_heads, tgt_len, src_len)
        if is_causal and attn_mask is None:
            raise ValueError(
                "is_causal=True is only a hint in torch.nn.MultiheadAttention and needs attn_mask; pass the "
                "causal mask, e.g. attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(L)"
            )
        q, k, v = (self._batch_first(x, is_batched) for x in (query, key, value))  # (B, L|S, E|Ek|Ev)
        if key_padding_mask is not None and not is_batched:
            key_padding_mask = key_padding_mask.unsqueeze(0)  # (1, S)
        q, k, v = self._project(q, k, v)  # (B, L, E), (B, S, E), (B, S, E)
        k, v, n_extra = self._append_keys(k, v)  # (B, S', E)
        mask: Mask | None
        bias: Tensor | None
        if is_causal and key_padding_mask is None and not need_weights:
            mask, bias = custom(_top_left_causal), None  # torch hands SDPA is_causal=True here
        else:
            mask, bias = _convert_masks(key_padding_mask, attn_mask, bsz, self.num_heads, tgt_len, n_extra)
        out, weights = self._attend(q, k, v, mask, bias, need_weights)  # (B, L, E), (B, H, L, S')
        out = self.out_proj(out)  # (B, L, E)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (B, L, S')
        if not is_batched:
            out = out.squeeze(0)  # (L, E)
            weights = None if weights is None else weights.squeeze(0)  # (L, S') or (H, L, S')
        elif not self.batch_first:
            out = out.transpose(0, 1)  # (L, B, E)
        return out, weights

    def merge_masks(
        self, attn_mask: Tensor | None, key_padding_mask: Tensor | None, query: Tensor
    ) -> tuple[Tensor | None, int | None]:
        """torch's helper for its fused kernels (``nn.TransformerEncoderLayer``'s fast path calls it).

        Takes torch-convention masks, already float (-inf = masked) when both are given, and a (B, L, E)
        self-attention ``query``; returns ``(merged_mask, mask_type)``: the key padding mask (B, L) with
        type 1, or the attention mask expanded to (B, H, L, L) (plus the padding mask) with type 2, or
        ``(None, None)``.
        """
        if attn_mask is None:
            return key_padding_mask, (None if key_padding_mask is None else 1)
        batch_size, seq_len, _ = query.shape
        if attn_mask.dim() == 3:
            merged = attn_mask.view(batch_size, -1, seq_len, seq_len)  # (B, H, L, L)
        else:
            merged = attn_mask.view(1, 1, seq_len, seq_len)  # (1, 1, L, L)
            merged = merged.expand(batch_size, self.num_heads, -1, -1)  # (B, H, L, L)
        if key_padding_mask is not None:
            kpm = key_padding_mask.view(batch_size, 1, 1, seq_len)  # (B, 1, 1, L)
            merged = merged + kpm.expand(-1, self.num_heads, -1, -1)  # (B, H, L, L)
        return merged, 2

    def _batch_first(self, x: Tensor, is_batched: bool) -> Tensor:
        """Any accepted input layout -> (B, N, feature)."""
        if not is_batched:
            return x.unsqueeze(0)  # (1, N, feature)
        return x if self.batch_first else x.transpose(0, 1)  # (B, N, feature)

    def _project(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The input projections: packed ``in_proj_weight`` rows [q; k; v], or the three separate ones."""
        if self.in_proj_weight is not None:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)  # (E, E) each
        else:
            assert self.q_proj_weight is not None and self.k_proj_weight is not None
            assert self.v_proj_weight is not None
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight  # (E, E|Ek|Ev)
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)  # (E,) each
        return _linear(q, w_q, b_q), _linear(k, w_k, b_k), _linear(v, w_v, b_v)

    def _append_keys(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, int]:
        """Append ``bias_k``/``bias_v`` and then a zero key/value, as torch does; return how many."""
        n_extra = 0
        B = k.shape[0]
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.expand(B, 1, -1)], dim=1)  # (B, S + 1, E)
            v = torch.cat([v, self.bias_v.expand(B, 1, -1)], dim=1)  # (B, S + 1, E)
            n_extra += 1
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(B, 1, k.shape[2])], dim=1)  # (B, S', E)
            v = torch.cat([v, v.new_zeros(B, 1, v.shape[2])], dim=1)  # (B, S', E)
            n_extra += 1
        return k, v, n_extra

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, bias: Tensor | None, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Split heads, run :func:`multihead.attention`, merge heads: (B, L, E) and (B, H, L, S') weights."""
        B, L, E = q.shape
        H, hd = self.num_heads, self.head_dim
        qh = q.view(B, L, H, hd).transpose(1, 2)  # (B, H, L, hd)
        kh = k.view(B, k.shape[1], H, hd).transpose(1, 2)  # (B, H, S', hd)
        vh = v.view(B, v.shape[1], H, hd).transpose(1, 2)  # (B, H, S', hd)
        res = attention(
            qh,
            kh,
            vh,
            mask=mask,
            bias=bias,
            dropout_p=self.dropout if self.training else 0.0,
            backend="matrix" if need_weights else "auto",  # only `matrix` returns the weights
            return_weights=need_weights,
        )
        out, weights = (res.out, res.weights) if isinstance(res, AttentionOutput) else (res, None)
        return out.transpose(1, 2).reshape(B, L, E), weights  # (B, L, E), (B, H, L, S') or None


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``x @ w.T + b``; a bias of another dtype than the weight (a double module with a half
    ``in_proj_bias``) is added after the matmul with type promotion, as torch's module does for its
    (L, B, E) inputs, instead of failing in ``addmm``."""
    if b is None or b.dtype == w.dtype:
        return F.linear(x, w, b)
    return F.linear(x, w) + b


def _convert_masks(
    kpm: Tensor | None, attn_mask: Tensor | None, B: int, H: int, L: int, n_extra: int
) -> tuple[Mask | None, Tensor | None]:
    """torch's masks -> (our mask, True = may attend; our additive bias), padded for the appended keys.

    ``kpm`` is (B, S) and ``attn_mask`` (L, S) or (B * H, L, S). The ``n_extra`` appended keys are allowed
    (torch pads its float masks with 0); float masks are summed as torch sums them.
    """
    mask: Mask | None = None
    bias: Tensor | None = None
    if attn_mask is not None:
        am = attn_mask if attn_mask.dim() == 2 else attn_mask.view(B, H, L, -1)  # (L, S) or (B, H, L, S)
        if am.dtype == torch.bool:
            mask = as_mask(F.pad(~am, (0, n_extra), value=True))  # (.., L, S')
        else:
            bias = F.pad(am, (0, n_extra))  # (.., L, S')
    if kpm is not None:
        if kpm.dtype == torch.bool:
            real = key_padding(F.pad(~kpm, (0, n_extra), value=True))  # (B, S'), True = real key
            mask = real if mask is None else mask & real
        else:
            kb = F.pad(kpm, (0, n_extra)).view(B, 1, 1, -1)  # (B, 1, 1, S')
            bias = kb if bias is None else bias + kb  # (B, H|1, L|1, S')
    return mask, bias


# -- validation at the public boundary ------------------------------------------------------------
def _check_config(embed_dim: int, num_heads: int, dropout: float, kdim: int | None, vdim: int | None) -> None:
    for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads), ("kdim", kdim), ("vdim", vdim)):
        if val is None and name in ("kdim", "vdim"):
            continue
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if embed_dim % num_heads != 0:
        raise ValueError(
            f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}); each head gets "
            f"embed_dim // num_heads features - choose e.g. num_heads in "
            f"{[h for h in range(1, embed_dim + 1) if embed_dim % h == 0][:8]}"
        )
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")


def _check_inputs(m: MultiheadAttention, query: Tensor, key: Tensor, value: Tensor) -> bool:
    """Ranks, feature sizes, batch and length agreement of query/key/value; return whether batched."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            raise ValueError(
                f"{name} is a nested tensor, which mh.compat.MultiheadAttention does not support; pad it "
                "with torch.nested.to_padded_tensor(x, 0.0) and pass key_padding_mask (True at the pad "
                "positions), or keep torch.nn.MultiheadAttention for nested inputs"
            )
    if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            f"query, key, value must all be 3-D (batched) or all 2-D (unbatched), got {query.dim()}-D, "
            f"{key.dim()}-D and {value.dim()}-D; layout (L, B, E), (B, L, E) with batch_first, or (L, E)"
        )
    for name, t, want in (("query", query, m.embed_dim), ("key", key, m.kdim), ("value", value, m.vdim)):
        if t.shape[-1] != want:
            arg = {"query": "embed_dim", "key": "kdim", "value": "vdim"}[name]
            raise ValueError(
                f"{name} has {t.shape[-1]} features (shape {tuple(t.shape)}) but {arg}={want}; "
                f"project it or build the module with {arg}={t.shape[-1]}"
            )
    is_batched = query.dim() == 3
    seq = 1 if is_batched and m.batch_first else 0
    if key.shape[seq] != value.shape[seq]:
        raise ValueError(
            f"key and value must have the same length S, got key {tuple(key.shape)} and value "
            f"{tuple(value.shape)} (batch_first={m.batch_first})"
        )
    if is_batched:
        bdim = 0 if m.batch_first else 1
        if not query.shape[bdim] == key.shape[bdim] == value.shape[bdim]:
            raise ValueError(
                f"batch sizes differ along dim {bdim} (batch_first={m.batch_first}): query "
                f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
    return is_batched


def _check_masks(
    kpm: Tensor | None, attn_mask: Tensor | None, is_batched: bool, B: int, H: int, L: int, S: int
) -> None:
    """Dtypes and shapes of torch's key_padding_mask and attn_mask (before any padding)."""
    for name, t in (("key_padding_mask", kpm), ("attn_mask", attn_mask)):
        if t is not None and (
            not isinstance(t, Tensor) or not (t.dtype == torch.bool or t.is_floating_point())
        ):
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be a bool tensor (True = not allowed) or a float tensor (added to the "
                f"scores), got {got}; convert with .bool()"
            )
    if kpm is not None:
        want_kpm = (B, S) if is_batched else (S,)
        if tuple(kpm.shape) != want_kpm:
            raise ValueError(
                f"key_padding_mask has shape {tuple(kpm.shape)} but must be {want_kpm} "
                f"({'(B, S)' if is_batched else '(S,) for unbatched input'}), B={B}, S={S}"
            )
    if attn_mask is not None:
        want_3d = (B * H, L, S) if is_batched else (H, L, S)
        if tuple(attn_mask.shape) not in ((L, S), want_3d):
            legend = "(B * num_heads, L, S)" if is_batched else "(num_heads, L, S)"
            raise ValueError(
                f"attn_mask has shape {tuple(attn_mask.shape)} but must be (L, S)={(L, S)} or "
                f"{legend}={want_3d} with B={B}, num_heads={H}, L={L}, S={S}"
            )
