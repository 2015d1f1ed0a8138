"""The fused projection's two state-dict forms: ``qkv_proj.{weight,bias}`` (rows ``[q | k | v]``, each
block head by head) and separate ``q_proj`` / ``k_proj`` / ``v_proj`` keys (Hugging Face LLaMA style).
:class:`~multihead.nn.attention.MultiHeadAttention` loads the separate form through
:func:`fuse_split_qkv` and exports it with :func:`split_qkv`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["fuse_split_qkv", "split_qkv"]


def fuse_split_qkv(module, state_dict, prefix, *_args) -> None:
    """load_state_dict pre-hook: replace ``q_proj/k_proj/v_proj.{weight,bias}`` by ``qkv_proj.*``.

    Only for modules with the fused layout: a design with its own ``q_proj`` / ``k_proj`` / ``v_proj``
    (and no ``qkv_proj``) loads them as they are.
    """
    if not isinstance(getattr(module, "qkv_proj", None), nn.Linear):
        return
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{p}_proj.{kind}" for p in "qkv"]
        if all(k in state_dict for k in keys):
            state_dict[f"{prefix}qkv_proj.{kind}"] = torch.cat([state_dict.pop(k) for k in keys], dim=0)


def split_qkv(sd: dict[str, Tensor], slices: tuple[slice, slice, slice]) -> dict[str, Tensor]:
    """``sd`` with ``qkv_proj.*`` split into ``q_proj``, ``k_proj``, ``v_proj`` (cloned) by the row
    slices of q, k and v; the inverse of :func:`fuse_split_qkv`. Changes and returns ``sd``."""
    for kind in ("weight", "bias"):
        fused = sd.pop(f"qkv_proj.{kind}", None)
        if fused is not None:
            for p, s in zip("qkv", slices):
                sd[f"{p}_proj.{kind}"] = fused[s].clone()
    return sd
