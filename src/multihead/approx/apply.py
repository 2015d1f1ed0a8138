"""Put an approximation into a whole model: :func:`apply` (attention) and :func:`low_rank_ffn` (FFN).

Both return a modified deep copy; the original model is untouched, so exact and approximate outputs of
the same weights can be compared side by side (pretrained MiniLM, ``from_hf`` models, a TransformerLM).

:func:`apply` turns every :class:`~multihead.MultiHeadAttention` into an
:class:`ApproxMultiHeadAttention`: the same parameters and state-dict keys (plus the approximation's own,
e.g. a learned Linformer's ``approx.proj_k``), the same forward (projections, rotary, KV cache, head
mask), with the approximation in place of the exact core call of eq. 9.34.

Shape legend: B batch, N query tokens, L keys attended, d = d_model, Hq / Hkv heads, D head dim,
r rank, I / O a linear layer's input / output width.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from ..attention_module import MultiHeadAttention, check_model_input
from ..feed_forward import FeedForward
from ._common import Approximation, check_int

__all__ = ["ApproxMultiHeadAttention", "LowRankLinear", "apply", "low_rank_ffn"]


class ApproxMultiHeadAttention(MultiHeadAttention):
    """:class:`~multihead.MultiHeadAttention` whose core call is ``self.approx(q, k, v, ...)``.

    Built by :func:`apply` from an existing module (its class is switched on a copy); ``approx`` is a
    registered submodule.
    """

    approx: Approximation

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask=None,
        bias=None,
        cache=None,
        positions: Tensor | None = None,
        head_mask: Tensor | None = None,
    ) -> Tensor:
        """As :meth:`MultiHeadAttention.forward`, (B, N, d) -> (B, N, d), attention approximated.

        Raises:
            ValueError: what :meth:`MultiHeadAttention.forward` raises, and what the approximation
                raises for masks, biases or dropout it cannot apply.
        """
        check_model_input(x, self.d_model, "x")
        if context is not None:
            check_model_input(context, self.d_model, "context")
            if context.shape[0] != x.shape[0]:
                raise ValueError(f"context batch {context.shape[0]} differs from x batch {x.shape[0]}")
            if cache is not None:
                raise ValueError("cache is for self-attention; pass context=None or cache=None")
        if positions is not None and (self.rotary is None or context is not None):
            raise ValueError("positions are only used by rotary self-attention; drop positions")
        B, N, _ = x.shape
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self._project(x, context)
        q = q.reshape(B, N, Hq, D).transpose(1, 2)  # (B, Hq, N, D)
        k = k.reshape(B, -1, Hkv, D).transpose(1, 2)  # (B, Hkv, L, D)
        v = v.reshape(B, -1, Hkv, D).transpose(1, 2)  # (B, Hkv, L, D)
        if self.rotary is not None and context is None:
            if positions is None:
                start = 0 if cache is None else int(cache.position)
                positions = torch.arange(start, start + N, device=x.device)  # (N,)
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if cache is not None:
            k, v = cache.update(k, v)  # (B, Hkv, L, D) each
        dropout_p = self.dropout if self.training else 0.0
        a = self.approx(q, k, v, mask=mask, bias=bias, dropout_p=dropout_p)  # (B, Hq, N, D)
        if head_mask is not None:
            a = a * self._head_scale(head_mask, B).to(a.dtype)  # (B, Hq, N, D)
        a = a.transpose(1, 2).reshape(B, N, Hq * D)  # (B, N, Hq*D)
        return self.out_dropout(self.o_proj(a))  # (B, N, d)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", approximated"


def apply(model: nn.Module, approx: Approximation) -> nn.Module:
    """A deep copy of ``model`` with every MultiHeadAttention computing ``approx`` instead of exact attention.

    An approximation with parameters (a learned Linformer) is copied per layer, so each layer learns its
    own; one without is shared.

    Args:
        model: any module containing :class:`~multihead.MultiHeadAttention` (TransformerLM, Encoder,
            the pretrained MiniLM, a ``from_hf`` model), or a MultiHeadAttention itself.
        approx: an approximation from :mod:`multihead.approx` (TopK, Nystrom, Performer, ...).

    Returns:
        the modified copy; ``model`` is not changed.

    Raises:
        ValueError: ``approx`` is not an approximation, or the model has no MultiHeadAttention.
    """
    if not isinstance(approx, Approximation):
        raise ValueError(
            f"approx must be a multihead.approx approximation (TopK(k), Nystrom(m), Performer(f), ...), "
            f"got {type(approx).__name__}"
        )
    out = copy.deepcopy(model)
    found = [m for m in out.modules() if isinstance(m, MultiHeadAttention)]
    if not found:
        raise ValueError(f"{type(model).__name__} contains no multihead.MultiHeadAttention to approximate")
    owns_params = any(True for _ in approx.parameters())
    for m in found:
        m.__class__ = ApproxMultiHeadAttention
        m.approx = copy.deepcopy(approx) if owns_params else approx
    return out


class LowRankLinear(nn.Module):
    """``W ~ U V^T`` of rank r as two linears: ``x -> down (I -> r) -> up (r -> O) (+ bias)``.

    From a Linear by truncated SVD ``W = U S V^T``: ``down.weight = sqrt(S_r) V_r^T``, ``up.weight =
    U_r sqrt(S_r)``: the best rank-r approximation of W (Eckart-Young), (I + O) r weights instead of I O.
    """

    def __init__(self, linear: nn.Linear, rank: int):
        super().__init__()
        w = linear.weight.detach()
        u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)  # (O, k), (k,), (k, I)
        root = s[:rank].sqrt()
        fk = {"device": w.device, "dtype": w.dtype}
        self.down = nn.Linear(w.shape[1], rank, bias=False, **fk)
        self.up = nn.Linear(rank, w.shape[0], bias=linear.bias is not None, **fk)
        with torch.no_grad():
            self.down.weight.copy_(root[:, None] * vh[:rank])  # (r, I)
            self.up.weight.copy_(u[:, :rank] * root)  # (O, r)
            if linear.bias is not None:
                self.up.bias.copy_(linear.bias)
        self.rank = rank

    def forward(self, x: Tensor) -> Tensor:
        return self.up(self.down(x))  # (..., I) -> (..., r) -> (..., O)

    def extra_repr(self) -> str:
        return f"in={self.down.in_features}, out={self.up.out_features}, rank={self.rank}"


def low_rank_ffn(model: nn.Module, rank: int) -> nn.Module:
    """A deep copy of ``model`` with every FFN weight matrix replaced by its rank-r SVD (seed 003 §3.2.1).

    Every ``nn.Linear`` inside each :class:`~multihead.FeedForward` (``linear1``/``linear2``, or SwiGLU's
    ``w1``/``w2``/``w3``) becomes a :class:`LowRankLinear`.

    Raises:
        ValueError: ``rank`` not an int >= 1 or larger than a layer's min(in, out) (then the "low-rank"
            factors would be bigger than the matrix), or no FeedForward in the model.
    """
    check_int("low_rank_ffn", "rank", rank, 1)
    out = copy.deepcopy(model)
    ffns = [m for m in out.modules() if isinstance(m, FeedForward)]
    if not ffns:
        raise ValueError(f"{type(model).__name__} contains no multihead.FeedForward to factorise")
    for ffn in ffns:
        for name, lin in list(ffn.named_children()):
            if not isinstance(lin, nn.Linear):
                continue
            full = min(lin.in_features, lin.out_features)
            if rank > full:
                raise ValueError(
                    f"low_rank_ffn rank={rank} exceeds min(in, out)={full} of FFN layer {name} "
                    f"({lin.in_features} -> {lin.out_features}); use rank <= {full}"
                )
            setattr(ffn, name, LowRankLinear(lin, rank))
    return out
