"""What every head design shares: argument checks, the forward contract, rotary positions, the aux loss.

Every design in :mod:`multihead.variants` is a drop-in for :class:`~multihead.MultiHeadAttention`: it is
built from ``(d_model, n_heads, [n_kv_heads], *, bias, dropout, rotary, backend, ...)`` and called as
``forward(x, context=None, *, mask=None, bias=None, cache=None, positions=None, head_mask=None)``,
(B, N, d) -> (B, N, d). Each sets ``self.aux_loss`` (a scalar tensor, zero when it has none) on every
forward; :func:`multihead.variants.aux_loss` sums them over a model for the training loss.

Shape legend: B batch, N query tokens, L keys attended, d = d_model, Hq query heads, Hkv kv heads,
G = Hq // Hkv, D head dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..core.functional import backends
from ..nn.attention import check_model_input
from ..nn.feed_forward import check_dropout

if TYPE_CHECKING:
    from ..nn.kv_cache import KVCache

__all__ = ["AttentionVariant", "check_int", "check_number", "head_scale"]


def check_int(owner: str, name: str, value: Any, low: int, high: int | None = None, fix: str = "") -> int:
    """Return ``value`` after checking it is an int in [low, high] (bool excluded).

    Raises:
        ValueError: naming the owner, the argument, the value and (when given) the fix.
    """
    bad = isinstance(value, bool) or not isinstance(value, int) or value < low
    if not bad and high is not None and value > high:
        bad = True
    if bad:
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{owner} {name} must be an int {span}, got {value!r}" + (f"; {fix}" if fix else ""))
    return value


def check_number(owner: str, name: str, value: Any, low: float, high: float, *, open_high: bool) -> float:
    """Return ``value`` as a float after checking it lies in [low, high) or [low, high].

    Raises:
        ValueError: naming the owner, the argument and the value.
    """
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    ok = ok and low <= value and (value < high if open_high else value <= high)
    if not ok:
        span = f"[{low}, {high})" if open_high else f"[{low}, {high}]"
        raise ValueError(f"{owner} {name} must be a number in {span}, got {value!r}")
    return float(value)


def head_scale(head_mask: Any, B: int, H: int) -> Tensor:
    """Validate a (H,) or (B, H) float head mask and shape it (B or 1, H, 1, 1) to scale head outputs.

    Raises:
        ValueError: not a float tensor of one of those shapes.
    """
    ok = isinstance(head_mask, Tensor) and head_mask.is_floating_point()
    if not ok or tuple(head_mask.shape) not in ((H,), (B, H)):
        shape = tuple(head_mask.shape) if isinstance(head_mask, Tensor) else type(head_mask).__name__
        raise ValueError(
            f"head_mask must be a float tensor of shape (Hq,) = ({H},) or (B, Hq) = ({B}, {H}), got "
            f"{shape}; use 1.0 to keep a head and 0.0 to prune it"
        )
    return head_mask.reshape(-1, H, 1, 1)  # (B or 1, H, 1, 1)


class AttentionVariant(nn.Module):
    """Base of the head designs: validated sizes and the checks of the shared forward contract.

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
        backend: str = "auto",
    ):
        super().__init__()
        owner = type(self).__name__
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        for name, val in (("d_model", d_model), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            check_int(owner, name, val, 1)
        if n_heads % n_kv_heads:
            raise ValueError(
                f"{owner} n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads}); "
                "pick n_kv_heads among the divisors of n_heads (1 = MQA, n_heads = MHA)"
            )
        if d_model % n_heads:
            raise ValueError(f"{owner} d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        if backend != "auto" and backend not in backends():
            raise ValueError(f"{owner} backend must be 'auto' or one of {backends()}, got {backend!r}")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.dropout = check_dropout(dropout)
        self.backend = backend
        self.rotary = rotary
        self.out_dropout = nn.Dropout(self.dropout)
        self.aux_loss = torch.zeros(())

    # -- the forward contract -----------------------------------------------------------------------
    def _check_call(
        self,
        x: Tensor,
        context: Tensor | None,
        cache: KVCache | None,
        positions: Tensor | None,
        *,
        no_cache: str | None = None,
        no_context: str | None = None,
    ) -> None:
        """Validate the common forward arguments; ``no_cache`` / ``no_context`` say why a design refuses.

        Raises:
            ValueError: bad x or context, a cache with context, a cache or a context the design cannot
                use, positions without rotary self-attention.
        """
        owner = type(self).__name__
        check_model_input(x, self.d_model, "x")
        if context is not None:
            if no_context is not None:
                raise ValueError(f"{owner} cannot cross-attend (context given): {no_context}")
            check_model_input(context, self.d_model, "context")
            if context.shape[0] != x.shape[0]:
                raise ValueError(f"context batch {context.shape[0]} differs from x batch {x.shape[0]}")
            if cache is not None:
                raise ValueError("cache is for self-attention; pass context=None or cache=None")
        if cache is not None and no_cache is not None:
            raise ValueError(f"{owner} cannot use a KVCache: {no_cache}; pass cache=None")
        if positions is not None and (self.rotary is None or context is not None):
            raise ValueError(
                "positions are only used by rotary self-attention; this call has "
                f"rotary={'set' if self.rotary is not None else 'None'}, "
                f"context={'set' if context is not None else 'None'}: drop positions"
            )

    def _positions(self, N: int, cache: KVCache | None, positions: Tensor | None, device) -> Tensor:
        """Rotary positions of the N new tokens: given, or ``arange(p, p + N)`` after p cached ones."""
        if positions is not None:
            return positions
        start = 0 if cache is None else int(cache.position)
        return torch.arange(start, start + N, device=device)  # (N,)

    def _attn_dropout(self) -> float:
        return self.dropout if self.training else 0.0

    def __getstate__(self) -> dict[str, Any]:
        # The aux loss of the last forward carries autograd history, which deepcopy and pickle refuse;
        # a copy keeps its value only.
        state = super().__getstate__()
        state["aux_loss"] = state["aux_loss"].detach()
        return state

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
            f"head_dim={self.head_dim}, dropout={self.dropout}, backend={self.backend!r}"
        )
