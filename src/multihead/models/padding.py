"""Real-token masks of a language model: ``attention_mask`` (B, T), 1 = real token, 0 = padding.

:class:`TrailingKeyPadding` turns one into a key-padding :class:`~multihead.core.masks.Mask` read at the
keys an attention call sees; :func:`left_pad` batches prompts of different lengths for generation and
:func:`check_left_padding` validates such a batch.

Shape legend: B batch, T tokens seen so far, Nk keys of one attention call, N prompt length.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..core.masks import Mask, MaskContext

__all__ = ["TrailingKeyPadding", "as_real", "check_left_padding", "left_pad"]


class TrailingKeyPadding(Mask):
    """Key padding from a (B, T) real-token mask over all T tokens seen, read at the last Nk keys.

    The keys an attention call sees are the last ``Nk`` of those T positions (a dense cache holds all of
    them, a sliding cache the most recent ones), so key j is real iff ``real[b, j + T - Nk]``.
    """

    #: the hidden keys are the model's own pad slots (finite activations of pad tokens); clearing them
    #: would copy the whole KV cache at every decode step
    clear_hidden_keys = False

    def __init__(self, real: Tensor):
        self.real = real

    def validate(self, ctx: MaskContext) -> None:
        B, T = self.real.shape
        if B != ctx.B or ctx.Nk > T:
            raise ValueError(
                f"attention_mask of shape {(B, T)} cannot cover B={ctx.B} rows and Nk={ctx.Nk} keys"
            )

    def evaluate(self, b, h, q, k, ctx):
        return self.real.to(k.device)[b, k + (self.real.shape[1] - ctx.Nk)]

    def default_size(self):
        B, T = self.real.shape
        return (B, T, T)

    def __repr__(self):
        return f"attention_mask({tuple(self.real.shape)})"


def as_real(attention_mask: Any, B: int, T: int, what: str) -> Tensor:
    """A (B, T) bool or 0/1 attention mask as bool (True = real token)."""
    am = attention_mask
    if not isinstance(am, Tensor) or tuple(am.shape) != (B, T):
        shape = tuple(am.shape) if isinstance(am, Tensor) else type(am).__name__
        raise ValueError(f"attention_mask must have shape (B, T) = ({B}, {T}) ({what}), got {shape}")
    if am.dtype != torch.bool:
        if not bool(((am == 0) | (am == 1)).all()):
            raise ValueError("attention_mask must be bool or hold only 0 and 1 (1 = real token)")
        am = am != 0
    return am


def check_left_padding(attention_mask: Any, B: int, N: int) -> Tensor | None:
    """Validate a generate() prompt mask: (B, N), every row 0s then at least one 1. None if all real."""
    real = as_real(attention_mask, B, N, "the prompt's shape")
    if bool(real.all()):
        return None
    if not bool(real[:, -1].all()) or bool((real[:, :-1] & ~real[:, 1:]).any()):
        bad = [r for r in range(B) if not bool(real[r, -1]) or bool((real[r, :-1] & ~real[r, 1:]).any())]
        raise ValueError(
            f"attention_mask rows {bad} are not left-padded: generate() needs each row to be pad tokens "
            "(0) followed by at least one prompt token (1); pad prompts on the left (see left_pad())"
        )
    return real


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Batch prompts of different lengths for :meth:`TransformerLM.generate`: left padding.

    Returns ``ids`` (B, N) and ``attention_mask`` (B, N) bool, N the longest prompt, each row
    ``[pad_id] * (N - len) + prompt`` with mask False on the pads.

    Raises:
        ValueError: no prompts, or an empty prompt.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        lengths = [len(p) for p in prompts]
        raise ValueError(f"left_pad needs at least one prompt and no empty prompt, got lengths {lengths}")
    N = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), N), pad_id, dtype=torch.long)  # (B, N)
    mask = torch.zeros(len(prompts), N, dtype=torch.bool)  # (B, N)
    for r, p in enumerate(prompts):
        ids[r, N - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        mask[r, N - len(p) :] = True
    return ids, mask
