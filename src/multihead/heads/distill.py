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

__all__ = [
    "HeldOut", "Layers", "TeacherCache", "Totals", "batch_loss", "distillation_loss", "layer_norms",
    "length_groups", "loss_part", "schedule", "split_holdout",
]  # fmt: skip


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
    totals = Totals(layer_norms(t_layers, real), float(real.sum()), real.shape[0])
    return loss_part(s_layers, t_layers, s_out, t_out, real, totals, lm=lm)


class Totals:
    """What a batch's loss is normalised by, summed over the whole batch: each layer's teacher energy
    ``norms`` (L,) = sum over real tokens of ||h_l^T||^2, the real tokens ``tokens`` and the inputs
    ``seqs``. With them the batch's loss is a sum over its inputs, computed in parts by :func:`loss_part`."""

    def __init__(self, norms: Tensor, tokens: float, seqs: int):
        self.norms, self.tokens, self.seqs = norms, tokens, seqs


def layer_norms(t_layers: Sequence[Tensor], real: Tensor) -> Tensor:
    """Each layer's sum over real tokens of ||h_l||^2: (L,) from outputs (B, N, d) and ``real`` (B, N)."""
    if not t_layers:
        return real.new_zeros(0, dtype=torch.float32)
    w = real.unsqueeze(-1).to(t_layers[0].dtype)  # (B, N, 1)
    return torch.stack([(ht.square() * w).sum() for ht in t_layers])  # (L,)


def loss_part(
    s_layers: Sequence[Tensor],
    t_layers: Sequence[Tensor],
    s_out: Tensor,
    t_out: Tensor,
    real: Tensor,
    totals: Totals,
    *,
    lm: bool,
) -> Tensor:
    """The share of a batch's loss (:func:`distillation_loss`) that some of its inputs carry, normalised by
    the whole batch's ``totals``: the shares of any split of a batch add up to its loss.

    Each layer's term is sum ||h^S - h^T||^2 / sum ||h^T||^2 over the batch's real tokens (the module
    docstring's mean ratio, the token and width counts cancelling); the LM's KL is summed over the part's
    real tokens and divided by the batch's; the encoder's 1 - cosine is summed over the part's inputs and
    divided by the batch's count.

    Args: as :func:`distillation_loss`, for the part's inputs (b, n); ``totals`` of the whole batch.

    Raises:
        ValueError: layer counts that differ.
    """
    if len(s_layers) != len(t_layers):
        raise ValueError(f"student has {len(s_layers)} layers and teacher {len(t_layers)}; they must match")
    w = real.unsqueeze(-1).to(s_out.dtype)  # (b, n, 1)
    d = t_out.shape[-1] if not s_layers else s_layers[0].shape[-1]
    floor = 1e-12 * totals.tokens * d  # the per-value mean energy's floor, 1e-12
    loss = s_out.new_zeros(())
    for l, (hs, ht) in enumerate(zip(s_layers, t_layers)):
        loss = loss + ((hs - ht).square() * w).sum() / totals.norms[l].clamp(min=floor)
    loss = loss / max(1, len(s_layers))
    if lm:
        logp_s = F.log_softmax(s_out.float(), dim=-1)  # (b, n, V)
        logp_t = F.log_softmax(t_out.float(), dim=-1)  # (b, n, V)
        kl = (logp_t.exp() * (logp_t - logp_s)).sum(-1)  # (b, n)
        return loss + (kl * real).sum() / totals.tokens
    pooled_s = (s_out * w).sum(1) / w.sum(1)  # (b, d)
    pooled_t = (t_out * w).sum(1) / w.sum(1)  # (b, d)
    return loss + (1 - F.cosine_similarity(pooled_s, pooled_t, dim=-1)).sum() / totals.seqs


def length_groups(lengths: Sequence[int], overhead: int = 64) -> list[list[int]]:
    """Split a batch into parts of similar length, so that padding costs little: the indices of
    ``lengths``, sorted by length, cut where it makes sum over parts of (overhead + count x longest)
    smallest (a part's padded tokens plus a fixed cost per forward pass, in tokens).

    A random batch of mixed lengths is mostly padding (inputs of 3 to 128 tokens padded to the longest);
    run as a few parts, each padded to its own longest, the same loss takes a fraction of the work.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0.0] + [math.inf] * n  # best[j]: cheapest split of the first j (sorted)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            c = best[i] + overhead + (j - i) * lengths[order[j - 1]]
            if c < best[j]:
                best[j], cut[j] = c, i
    parts, j = [], n
    while j > 0:
        parts.append(order[cut[j] : j])
        j = cut[j]
    return parts[::-1]


class TeacherCache:
    """The teacher's outputs for inputs seen before, up to ``budget`` bytes: each input's layer outputs
    (L, n, d) and final output (n, d) or (n, V), its real tokens only, kept under a key of the caller's
    (its index). The teacher is frozen, so an input's targets never change: a recovery that passes over its
    inputs several times runs the teacher once per input while the budget lasts, and as before past it."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self.store: dict[Any, tuple[Tensor, Tensor]] = {}

    def __contains__(self, key: Any) -> bool:
        return key in self.store

    def put(self, key: Any, layers: Tensor, out: Tensor) -> None:
        """Keep ``layers`` (L, n, d) and ``out`` (n, ...) under ``key`` if the budget allows."""
        size = layers.numel() * layers.element_size() + out.numel() * out.element_size()
        if key not in self.store and self.used + size <= self.budget:
            self.store[key] = (layers.clone(), out.clone())
            self.used += size

    def padded(self, keys: Sequence[Any], n: int) -> tuple[list[Tensor], Tensor]:
        """The kept outputs of ``keys`` right-padded with zeros to n tokens: each layer's (b, n, d) and the
        final (b, n, ...), as one padded teacher pass gives them at the real tokens."""
        layers, out = self.store[keys[0]]
        lay = layers.new_zeros(layers.shape[0], len(keys), n, layers.shape[-1])  # (L, b, n, d)
        fin = out.new_zeros(len(keys), n, *out.shape[1:])  # (b, n, ...)
        for r, key in enumerate(keys):
            layers, out = self.store[key]
            lay[:, r, : out.shape[0]] = layers
            fin[r, : out.shape[0]] = out
        return list(lay.unbind(0)), fin


def _targets(
    teacher: nn.Module, hooks: tuple[Layers, Layers], ids: Tensor, real: Tensor, keys: Sequence[Any] | None,
    cache: TeacherCache | None,
) -> tuple[list[Tensor], Tensor]:  # fmt: skip
    """The teacher's layer outputs [(b, n, d)] and final output for one padded part ``ids`` (b, n): from
    ``cache`` when it holds every input of the part, else from a teacher pass (kept in the cache)."""
    if cache is not None and keys is not None and all(k in cache for k in keys):
        return cache.padded(keys, ids.shape[1])
    t_out = forward_ids(teacher, ids, real)  # (b, n, d) or (b, n, V)
    t_layers = hooks[1].take()
    if cache is not None and keys is not None:
        lengths = real.sum(1).tolist()
        stacked = torch.stack(t_layers)  # (L, b, n, d)
        for r, (key, n) in enumerate(zip(keys, lengths)):
            cache.put(key, stacked[:, r, :n], t_out[r, :n])
    return t_layers, t_out


def batch_loss(student: nn.Module, teacher: nn.Module, hooks: tuple[Layers, Layers],
               seqs: Sequence[Sequence[int]], device: Any, *, lm: bool, backward: bool,
               keys: Sequence[Any] | None = None, cache: TeacherCache | None = None) -> float:  # fmt: skip
    """The distillation loss of one batch of id lists, computed in parts of similar length
    (:func:`length_groups`; the same value as one padded pass, in a fraction of the work); with
    ``backward`` each part's gradient is accumulated into the student's parameters as it goes. ``keys``
    (one per input) and ``cache`` reuse the teacher's outputs for inputs seen before."""
    groups = length_groups([len(s) for s in seqs])
    parts = [pad_batch([seqs[i] for i in g], device) for g in groups]  # [(ids (b, n), real (b, n))]
    targets = []
    with torch.no_grad():
        for g, (ids, real) in zip(groups, parts):
            part_keys = None if keys is None else [keys[i] for i in g]
            targets.append(_targets(teacher, hooks, ids, real, part_keys, cache))
        per_part = [layer_norms(t_layers, real) for (t_layers, _), (_, real) in zip(targets, parts)]
        norms = torch.stack(per_part).sum(0)  # (L,): each layer's energy over the whole batch
    tokens = sum(int(real.sum()) for _, real in parts)
    totals = Totals(norms, float(tokens), len(seqs))
    total = 0.0
    for (ids, real), (t_layers, t_out) in zip(parts, targets):
        with torch.set_grad_enabled(backward):
            s_out = forward_ids(student, ids, real)
            part = loss_part(hooks[0].take(), t_layers, s_out, t_out, real, totals, lm=lm)
        if backward:
            part.backward()
        total += float(part.detach())
    return total


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

    def __init__(self, seqs: list[list[int]], batch_size: int, device: Any, lm: bool,
                 cache: TeacherCache | None = None):  # fmt: skip
        self.batches = [seqs[i : i + batch_size] for i in range(0, len(seqs), batch_size)]
        self.device, self.lm, self.cache, self.best, self.best_step = device, lm, cache, math.inf, 0
        self.best_state: dict[str, Tensor] | None = None
        self.history: list[tuple[int, float]] = []

    @torch.no_grad()
    def check(self, student: nn.Module, teacher: nn.Module, hooks: tuple[Layers, Layers],
              trained: Mapping[str, Tensor], step: int) -> bool:  # fmt: skip
        """Score the student; keep its trained parameters when best. Returns whether it improved."""
        total = sum(
            batch_loss(student, teacher, hooks, b, self.device, lm=self.lm, backward=False, cache=self.cache,
                       keys=[("held", j, i) for i in range(len(b))])
            for j, b in enumerate(self.batches)
        )  # fmt: skip
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
