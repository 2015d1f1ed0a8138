"""Keys that no query may attend, and why their contents must not reach a kernel.

A padded batch or a preallocated buffer often holds garbage (NaN, Inf, 1e30) in its pad slots. A mask
that hides a key from every query of its (batch, head) should make its contents irrelevant, but kernels
leak them: an additive ``-inf`` mask plus a NaN score is NaN (SDPA's math path, the fused tiled kernel),
and a zero weight times a NaN value is NaN in P @ V (every backend), in the output and in dq.

:func:`clear_dead_keys` zeroes those keys and values once, before any backend runs, with ``torch.where``
(so their gradients are exactly zero, as in a clean run). It only reads what a mask's structure says
cheaply: ``padding``, ``key_padding``, a bool tensor mask (reduced over its query axis), and ``&`` / ``|``
of those; other masks (causal, windows, documents) leave every key to some query, or are not known to
hide any, and cost nothing. The mask ``TransformerLM.generate`` builds for a left-padded batch is not
read either: the pad slots of its cache are written by the model itself (finite activations of the pad
tokens), and clearing them would copy the whole cache at every decode step.

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Nk keys; "B|1" a dim that may be 1.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .masks import (
    AndMask,
    KeyPadding,
    Mask,
    MaskContext,
    NotMask,
    OrMask,
    Padding,
    TensorMask,
    check_broadcast,
)
from .problem import Problem

__all__ = ["clear_dead_keys", "dead_keys"]


def dead_keys(mask: Mask | None, ctx: MaskContext, device: torch.device) -> Tensor | None:
    """(B|1, Hq|1, Nk) bool, True where no query row of that (batch, head) may attend the key; None when
    the mask's structure says nothing cheaply (a subset of the truly dead keys is always safe to clear).

    A mask class outside this module may say it with a method ``dead_keys(ctx, device)``.
    """
    if mask is None or isinstance(mask, NotMask):
        return None
    if isinstance(mask, OrMask):  # dead for a | b: dead for both (OrMask derives from AndMask: first)
        a, b = dead_keys(mask.a, ctx, device), dead_keys(mask.b, ctx, device)
        return None if a is None or b is None else a & b
    if isinstance(mask, AndMask):  # dead for a & b: dead for either
        a, b = dead_keys(mask.a, ctx, device), dead_keys(mask.b, ctx, device)
        return a if b is None else b if a is None else a | b
    if isinstance(mask, Padding):
        keys = torch.arange(ctx.Nk, device=device)  # (Nk,)
        return (keys >= mask.lengths.to(device)[:, None])[:, None, :]  # (B, 1, Nk)
    if isinstance(mask, KeyPadding):
        return ~mask.mask.to(device)[:, None, :]  # (B, 1, Nk)
    if isinstance(mask, TensorMask):
        return ~check_broadcast(mask.t, ctx, "mask").to(device).any(dim=-2)  # (B|1, Hq|1, Nk|1)
    own = getattr(mask, "dead_keys", None)
    return own(ctx, device) if callable(own) else None


def clear_dead_keys(p: Problem) -> Problem:
    """``p`` with k and v zeroed at the keys no query of their (batch, kv head) may attend (see the
    module docstring); ``p`` itself when the mask hides no key from every query.

    A kv head's key is dead only when it is dead for all G query heads that read it.
    """
    dead = dead_keys(p.mask, p.ctx, p.k.device)
    if dead is None:
        return p
    if dead.shape[-1] == 1:  # a tensor mask constant over keys: nothing to clear per key
        return p
    if dead.shape[1] != 1:  # per query head -> per kv head
        dead = dead.reshape(dead.shape[0], p.Hkv, p.G, p.Nk).all(dim=2)  # (B|1, Hkv, Nk)
    if p.k.device.type == "cpu" and not bool(dead.any()):
        return p  # nothing dead: no copies (on a GPU, asking would wait for the device)
    zero = torch.zeros((), dtype=p.k.dtype, device=p.k.device)
    hide = dead[..., None]  # (B|1, Hkv|1, Nk, 1)
    return replace(p, k=torch.where(hide, zero, p.k), v=torch.where(hide, zero, p.v))
