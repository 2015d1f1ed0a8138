"""Put an approximation into a whole model: :func:`apply` (attention) and :func:`low_rank_ffn` (FFN).

Both return a modified deep copy; the original model is untouched, so exact and approximate outputs of
the same weights can be compared side by side (pretrained MiniLM, ``from_hf`` models, a TransformerLM).

:func:`apply` sets the approximation as the ``backend`` of every :class:`~multihead.MultiHeadAttention`
of the copy (what ``MultiHeadAttention(backend=approx)`` does): the same parameters and state-dict keys
(plus the approximation's own, e.g. a learned Linformer's ``approx.proj_k``), the same forward
(projections, rotary, KV cache, head mask), with the approximation serving the core call of eq. (4).

Shape legend: B batch, N query tokens, L keys attended, d = d_model, Hq / Hkv heads, D head dim,
r rank, I / O a linear layer's input / output width.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from ..core.checks import check_int
from ..nn.attention import MultiHeadAttention
from ..nn.feed_forward import FeedForward
from .base import Approximation

__all__ = ["LowRankLinear", "apply", "low_rank_ffn"]


def apply(model: nn.Module, approx: Approximation) -> nn.Module:
    """A deep copy of ``model`` with ``approx`` as the backend of every MultiHeadAttention.

    An approximation with parameters (a learned Linformer) is copied per layer, so each layer learns its
    own; one without is shared. Whatever backend a layer had (a name, another approximation) is
    replaced.

    Args:
        model: any module containing :class:`~multihead.MultiHeadAttention` (TransformerLM, Encoder,
            the pretrained MiniLM, a ``from_hf`` model), or a MultiHeadAttention itself.
        approx: an approximation from :mod:`multihead.approx` (TopK, Nystrom, Performer, ...).

    Returns:
        the modified copy; ``model`` is not changed.

    Raises:
        ValueError: ``approx`` is not an approximation, the model has no MultiHeadAttention, or one of
            them has learned attention sinks (no approximation has a sink term).
    """
    if not isinstance(approx, Approximation):
        raise ValueError(
            f"approx must be a multihead.approx approximation (TopK(k), Nystrom(m), Performer(f), ...), "
            f"got {type(approx).__name__}"
        )
    out = copy.deepcopy(model)
    found = [m for m in out.modules() if isinstance(m, MultiHeadAttention) and m.textbook]
    if not found:
        raise ValueError(f"{type(model).__name__} contains no multihead.MultiHeadAttention to approximate")
    with_sinks = [
        name
        for name, m in out.named_modules()
        if isinstance(m, MultiHeadAttention) and m.textbook and m.sinks is not None
    ]
    if with_sinks:
        raise ValueError(
            f"{approx.name} cannot serve attention with learned sinks (MultiHeadAttention(sinks=True)): "
            f"{', '.join(n or '<model>' for n in with_sinks)}; approximations have no sink term, keep an "
            "exact backend for those layers"
        )
    owns_params = any(True for _ in approx.parameters())
    for m in found:
        m.backend = copy.deepcopy(approx) if owns_params else approx
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
    """A deep copy of ``model`` with every FFN weight matrix replaced by its rank-r SVD.

    Every ``nn.Linear`` inside each :class:`~multihead.FeedForward` (``linear1``/``linear2``, or SwiGLU's
    ``w1``/``w2``/``w3``) becomes a :class:`LowRankLinear`.

    Raises:
        ValueError: ``rank`` not an int >= 1 or larger than a layer's min(in, out) (then the "low-rank"
            factors would be bigger than the matrix), or no FeedForward in the model.
    """
    check_int("rank", rank, 1, owner="low_rank_ffn")
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
