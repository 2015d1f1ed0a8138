"""What every head design shares: the template of :class:`~multihead.MultiHeadAttention`, sizes derived
from d_model, an optional refusal of the KV cache, and the aux loss.

Every design in :mod:`multihead.variants` is a drop-in for :class:`~multihead.MultiHeadAttention` and a
subclass of it: built from ``(d_model, n_heads, [n_kv_heads], *, bias, dropout, rotary, backend, ...)``,
called as ``forward(x, context=None, *, mask=None, bias=None, cache=None, positions=None,
head_mask=None)``, (B, N, d) -> (B, N, d). Each overrides only the steps of the template it changes
(``project``, ``apply_positions``, ``attend``, ``mix_heads``, ``heads``; see :mod:`multihead.nn.attention`)
and sets ``self.aux_loss`` (a scalar tensor, zero when it has none) on every forward;
:func:`multihead.variants.aux_loss` sums them over a model for the training loss.

Shape legend: B batch, N query tokens, M context tokens, L keys attended, d = d_model, Hq query heads,
Hkv kv heads, D = d_model // Hq head dim, Dv per-head output width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from ..backends import registry
from ..core.checks import check_int
from ..nn.attention import MultiHeadAttention

if TYPE_CHECKING:
    from ..nn.kv_cache import KVCache

__all__ = ["AttentionVariant"]


class AttentionVariant(MultiHeadAttention):
    """Base of the head designs: MultiHeadAttention with D = d_model // n_heads and an ``aux_loss``.

    Args:
        d_model: model width d.
        n_heads: query heads Hq; ``d_model`` must be divisible by it (D = d_model // n_heads).
        n_kv_heads: key/value heads Hkv for designs that support GQA / MQA (default Hq); must divide Hq.
        bias: biases on the projections.
        dropout: attention-weight and output dropout, training only.
        rotary: a ``RotaryEmbedding`` applied to q and k in self-attention.
        backend: backend name for :func:`multihead.attention` ("auto" picks per call).

    Raises:
        ValueError: sizes that are not positive ints or do not divide, dropout outside [0, 1), an unknown
            backend.
    """

    textbook = False  # the designs change the textbook steps: approximations and the like refuse them
    #: why the design cannot use a ``KVCache``; None when it can (:meth:`check_call` refuses one)
    no_cache: ClassVar[str | None] = None
    aux_loss: Tensor

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        bias: bool = True,
        dropout: float = 0.0,
        rotary: nn.Module | None = None,
        backend: str | registry.Backend = "auto",
    ):
        owner = type(self).__name__
        check_int("d_model", d_model, 1, owner=owner)
        check_int("n_heads", n_heads, 1, owner=owner)
        if d_model % n_heads:
            raise ValueError(
                f"{owner} d_model ({d_model}) must be divisible by n_heads ({n_heads}): its head dim is "
                "d_model // n_heads; change one of them"
            )
        super().__init__(
            d_model,
            n_heads,
            n_kv_heads,
            head_dim=d_model // n_heads,
            bias=bias,
            dropout=dropout,
            rotary=rotary,
            backend=backend,
        )
        self.aux_loss = torch.zeros(())

    def check_call(
        self,
        x: Tensor,
        context: Tensor | None,
        cache: KVCache | None,
        positions: Tensor | None,
        head_mask: Tensor | None,
    ) -> None:
        """:meth:`MultiHeadAttention.check_call`, a refusal of any cache when :attr:`no_cache` says why;
        then the call's ``aux_loss`` starts at zero (x's device and dtype) for a later step to set.

        Raises:
            ValueError: what MultiHeadAttention.check_call raises; a cache the design cannot use.
        """
        super().check_call(x, context, cache, positions, head_mask)
        if cache is not None and self.no_cache is not None:
            raise ValueError(f"{type(self).__name__} cannot use a KVCache: {self.no_cache}; pass cache=None")
        self.aux_loss = x.new_zeros(())

    def __getstate__(self) -> dict[str, Any]:
        # The aux loss of the last forward carries autograd history, which deepcopy and pickle refuse;
        # a copy keeps its value only.
        state = super().__getstate__()
        state["aux_loss"] = state["aux_loss"].detach()
        return state
