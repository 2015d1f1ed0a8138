"""The pieces of ``mh.heads.recover``: each layer's output collected by hooks, the distillation loss, the
learning-rate schedule and the held-out check that keeps the best state (see :mod:`multihead.heads.recover`).

Shape legend: B batch, N tokens, d width, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .access import forward_ids, layers_of, pad_batch

__all__ = ["HeldOut", "Layers", "distillation_loss", "schedule", "split_holdout"]


class Layers:
    """Collects every TransformerLayer's output (B, N, d) of a model during a forward pass."""

    def __init__(self, model: nn.Module):
        self.outs: list[Tensor] = []
        self.handles = [
            layer.register_forward_hook(lambda _m, _a, out: self.outs.append(out))
            for layer in layers_of(model)
        ]

    def take(self) -> list[Tensor]:
        outs, self.outs = self.outs, []
        return outs

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def distillation_loss(
    s_layers: Sequence[Tensor],
    t_layers: Sequence[Tensor],
    s_out: Tensor,
    t_out: Tensor,
    real: Tensor,
    *,
    lm: bool,
) -> Tensor:
    """The loss of the module docstring for one batch.

    Args:
        s_layers, t_layers: each layer's output (B, N, d), student and teacher (same count).
        s_out, t_out: the final output: hidden states (B, N, d) of an encoder or logits (B, N, V) of an LM.
        real: (B, N) bool, True on real tokens.
        lm: KL on logits (True) or cosine of the mean-pooled embeddings (False).

    Returns:
        a scalar tensor.

    Raises:
        ValueError: layer counts that differ.
    """
    if len(s_layers) != len(t_layers):
        raise ValueError(f"student has {len(s_layers)} layers and teacher {len(t_layers)}; they must match")
    w = real.unsqueeze(-1).to(s_out.dtype)  # (B, N, 1)
    n = w.sum()
    loss = s_out.new_zeros(())
    for hs, ht in zip(s_layers, t_layers):
        scale = (ht.square() * w).sum() / (n * ht.shape[-1])
        loss = loss + ((hs - ht).square() * w).sum() / (n * ht.shape[-1] * scale.clamp(min=1e-12))
    loss = loss / max(1, len(s_layers))
    if lm:
        logp_s = F.log_softmax(s_out.float(), dim=-1)  # (B, N, V)
        logp_t = F.log_softmax(t_out.float(), dim=-1)  # (B, N, V)
        kl = (logp_t.exp() * (logp_t - logp_s)).sum(-1)  # (B, N)
        return loss + (kl * real).sum() / n
    pooled_s = (s_out * w).sum(1) / w.sum(1)  # (B, d)
    pooled_t = (t_out * w).sum(1) / w.sum(1)  # (B, d)
    return loss + (1 - F.cosine_similarity(pooled_s, pooled_t, dim=-1)).mean()


def schedule(lr: float, step: int, progress: float) -> float:
    """Linear warm-up over 10 steps, then cosine decay to 0 at the end of the budget (``progress`` in
    [0, 1]: the larger of steps done / steps and seconds spent / seconds given), so the last steps take
    small updates and the run does not drift away at its end."""
    return lr * min(1.0, (step + 1) / 10) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def split_holdout(
    seqs: list[list[int]], holdout: int, g: torch.Generator
) -> tuple[list[list[int]], list[list[int]]]:
    """A seeded held-out share of the inputs (``holdout`` of them, at most half) and the rest."""
    k = min(holdout, len(seqs) // 2)
    perm = torch.randperm(len(seqs), generator=g).tolist()
    return [seqs[i] for i in perm[k:]], [seqs[i] for i in perm[:k]]


class HeldOut:
    """The distillation loss on held-out inputs, and the trained parameters where it was lowest."""

    def __init__(self, seqs: list[list[int]], batch_size: int, device: Any, lm: bool):
        self.batches = [pad_batch(seqs[i : i + batch_size], device) for i in range(0, len(seqs), batch_size)]
        self.lm, self.best, self.best_step = lm, math.inf, 0
        self.best_state: dict[str, Tensor] | None = None
        self.history: list[tuple[int, float]] = []

    @torch.no_grad()
    def check(self, student: nn.Module, teacher: nn.Module, hooks: tuple[Layers, Layers],
              trained: Mapping[str, Tensor], step: int) -> bool:  # fmt: skip
        """Score the student; keep its trained parameters when best. Returns whether it improved."""
        total = 0.0
        for ids, real in self.batches:  # (B, N) each
            t_out = forward_ids(teacher, ids, real)
            t_layers = hooks[1].take()
            s_out = forward_ids(student, ids, real)
            total += float(distillation_loss(hooks[0].take(), t_layers, s_out, t_out, real, lm=self.lm))
        loss = total / max(1, len(self.batches))
        self.history.append((step, loss))
        if loss < self.best * (1 - 1e-4):
            self.best, self.best_step = loss, step
            self.best_state = {n: p.detach().clone() for n, p in trained.items()}
            return True
        return False

    @torch.no_grad()
    def restore(self, trained: Mapping[str, Tensor]) -> None:
        if self.best_state is not None:
            for n, p in trained.items():
                p.copy_(self.best_state[n])
