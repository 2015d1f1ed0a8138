"""The argument checks of :class:`~multihead.nn.attention.MultiHeadAttention`: its head counts and widths
at construction, and the inputs of each call, before any work is done. Each raises a ValueError that
names the values and the fix.

Shape legend: B batch, N query tokens, M context tokens, d = d_model, Hq query heads, Hkv kv heads,
D head dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..core.checks import check_int

if TYPE_CHECKING:
    from .kv_cache import KVCache

__all__ = ["check_call_arguments", "check_model_input", "check_sinks", "head_shape"]


def check_model_input(x: Any, d_model: int, name: str = "x", dtype: torch.dtype | None = None) -> None:
    """Raise ValueError unless ``x`` is a float tensor of shape (B, N, d_model) (and of ``dtype``, the
    module's weights, when given; under autocast any float dtype passes)."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a float tensor of shape (B, N, d_model), got {type(x).__name__}")
    if x.dim() != 3:
        fix = (
            f"add a batch dim with {name}.unsqueeze(0)"
            if x.dim() == 2
            else f"modules take (B, N, d_model): fold the extra dims into B, e.g. "
            f"{name}.reshape(-1, {name}.shape[-2], {name}.shape[-1])"
        )
        raise ValueError(
            f"{name} must have 3 dims (B, N, d_model), got {x.dim()} dims {tuple(x.shape)}; {fix}"
        )
    if dtype is not None and x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
        raise ValueError(
            f"{name} is {x.dtype} but the module's weights are {dtype}; convert one to the other: "
            f"{name}.to({dtype}) or module.to({x.dtype})"
        )
    if x.shape[-1] != d_model:
        raise ValueError(
            f"{name} has width {x.shape[-1]} but the module was built with d_model={d_model}; "
            "project the input to d_model first or build the module with the input width"
        )


def check_sinks(owner: str, sinks: object, *, overrides_attend: bool) -> None:
    """Raise ValueError unless ``sinks`` is a bool, and False when the module overrides ``attend``.

    Raises:
        ValueError: ``sinks`` not a bool, or ``sinks=True`` on a design that computes its own attention
            weights (which have no sink term).
    """
    if not isinstance(sinks, bool):
        raise ValueError(
            f"{owner} sinks must be True or False (learn one attention-sink logit per head), got "
            f"{sinks!r}; load pretrained values into module.sinks after building with sinks=True"
        )
    if sinks and overrides_attend:
        raise ValueError(
            f"{owner} overrides attend() and computes its own attention weights, which have no sink "
            "term; build it with sinks=False (sinks=True is for the textbook attend step)"
        )


def head_shape(
    owner: str, d_model: int, n_heads: int, n_kv_heads: int | None, head_dim: int | None
) -> tuple[int, int]:
    """The checked ``(n_kv_heads, head_dim)`` of a module: Hkv defaults to Hq (MHA) and must divide it;
    D defaults to ``d_model // n_heads``, which must then divide exactly.

    Raises:
        ValueError: a count or width below 1, Hq not divisible by Hkv, or d_model not divisible by Hq
            without an explicit head_dim.
    """
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    for name, val in (("d_model", d_model), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        check_int(name, val, 1, owner=owner)
    if n_heads % n_kv_heads != 0:
        raise ValueError(
            f"{owner} n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads}); "
            "pick n_kv_heads among the divisors of n_heads (1 = MQA, n_heads = MHA)"
        )
    if head_dim is None:
        if d_model % n_heads != 0:
            raise ValueError(
                f"{owner} d_model ({d_model}) is not divisible by n_heads ({n_heads}); "
                "change one of them or pass head_dim explicitly"
            )
        head_dim = d_model // n_heads
    check_int("head_dim", head_dim, 1, owner=owner, fix="or None for d_model // n_heads (the default)")
    return n_kv_heads, head_dim


def check_call_arguments(
    x: Tensor,
    context: Tensor | None,
    cache: KVCache | None,
    positions: Tensor | None,
    head_mask: Tensor | None,
    *,
    d_model: int,
    n_heads: int,
    dtype: torch.dtype | None,
    has_rotary: bool,
) -> None:
    """Validate the arguments of a ``MultiHeadAttention.forward`` call (x (B, N, d), context (B, M, d),
    a KV cache, rotary positions, a head_mask (Hq,) or (B, Hq)) against the module's ``d_model``,
    ``n_heads``, weight ``dtype`` (None: any float) and whether it has a rotary embedding.

    Raises:
        ValueError: x or context not float (B, N, d_model) / (B, M, d_model) with the same B, a cache
            with cross-attention, positions without rotary self-attention, a head_mask that is not
            a float (Hq,) or (B, Hq) tensor.
    """
    check_model_input(x, d_model, "x", dtype)
    if context is not None:
        check_model_input(context, d_model, "context", dtype)
        if context.shape[0] != x.shape[0]:
            raise ValueError(f"context batch {context.shape[0]} differs from x batch {x.shape[0]}")
        if cache is not None:
            raise ValueError("cache is for self-attention; pass context=None or cache=None")
    if positions is not None and (not has_rotary or context is not None):
        raise ValueError(
            "positions are only used by rotary self-attention; this call has "
            f"rotary={'set' if has_rotary else 'None'}, "
            f"context={'set' if context is not None else 'None'}: drop positions"
        )
    if head_mask is not None:
        B, H = x.shape[0], n_heads
        ok = isinstance(head_mask, Tensor) and head_mask.is_floating_point()
        if not ok or tuple(head_mask.shape) not in ((H,), (B, H)):
            shape = tuple(head_mask.shape) if isinstance(head_mask, Tensor) else type(head_mask).__name__
            raise ValueError(
                f"head_mask must be a float tensor of shape (Hq,) = ({H},) or (B, Hq) = ({B}, {H}), "
                f"got {shape}; use 1.0 to keep a head and 0.0 to prune it"
            )
