"""Recover what head surgery (``prune``, ``to_gqa``, ``to_mla``) cost, by distilling the original model
into the changed one (knowledge distillation, Hinton, Vinyals and Dean, 2015, "Distilling the Knowledge
in a Neural Network"; layer-wise hidden-state matching as in TinyBERT, Jiao et al., 2020).

The loss on a batch of texts, averaged over real (non-pad) tokens:

    layers     (1/L) sum_l ||h_l^S - h_l^T||^2 / mean(h_l^T ^2)       every layer's output, scale-free
    encoders   + (1 - cos(mean-pool h^S, mean-pool h^T))               the sentence embedding
    LMs        + KL(softmax(z^T) || softmax(z^S))                      the next-token distribution

By default only what the surgery changed is trained: the student's parameters that the teacher lacks,
has in another shape, or holds with other values; everything else stays frozen (and bit-identical).

Shape legend: B batch, N tokens, d width, V vocabulary.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models.lm import TransformerLM
from ..pretrained.bert import Bert
from ..pretrained.sentence_encoder import SentenceEncoder
from .access import forward_ids, layers_of, model_device, pad_batch, to_id_lists

__all__ = ["changed_parameters", "distillation_loss", "mixed_lengths", "recover"]


def mixed_lengths(texts: Sequence[str], seed: int = 0) -> list[str]:
    """Recovery texts of every length from ``texts``: the texts, their sentences (8-200 characters) and a
    1-3 word span of each, shuffled (seeded).

    Distilling on long texts alone restores long-text behaviour and lets short inputs (single words,
    one-sentence reviews) drift; cutting the same texts into sentences and word spans keeps both
    (BENCHMARKS.md, "Head surgery that keeps quality").

    Raises:
        ValueError: ``texts`` not a sequence of strings.
    """
    import random
    import string

    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise ValueError("mixed_lengths takes a list of texts (strings); token ids have no sentences to cut")
    rng = random.Random(seed)
    out = list(texts)
    for text in texts:
        sentences = (s.strip() for s in text.replace("\n", " ").split(". "))
        out += [s for s in sentences if 8 <= len(s) <= 200]
        words = text.split()
        if words:
            i = rng.randrange(len(words))
            span = " ".join(words[i : i + rng.randint(1, 3)]).strip(string.punctuation)  # adjacent words
            if any(c.isalpha() for c in span):
                out.append(span)
    rng.shuffle(out)
    return out


def changed_parameters(student: nn.Module, teacher: nn.Module) -> list[str]:
    """Names of the student's parameters that the teacher lacks, has in another shape, or holds with other
    values (what a surgery changed), in module order."""
    theirs = dict(teacher.named_parameters())
    out = []
    for name, p in student.named_parameters():
        t = theirs.get(name)
        if t is None or t.shape != p.shape or not torch.equal(t.detach().to(p.device), p.detach()):
            out.append(name)
    return out


class _Layers:
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


def _progress(total: float, label: str, enabled: bool) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
        console=Console(file=sys.stderr), disable=not enabled, transient=False,
    )  # fmt: skip
    return bar, bar.add_task(label, total=total, info="")


def recover(
    student: nn.Module,
    teacher: nn.Module,
    texts: Any,
    *,
    minutes: float | None = None,
    steps: int | None = None,
    lr: float = 5e-5,
    batch_size: int = 16,
    max_tokens: int = 128,
    train: str | Sequence[str] = "changed",
    seed: int = 0,
    progress: bool = True,
) -> nn.Module:
    """Distil ``teacher`` into ``student`` (a changed copy of it) on ``texts``; see the module docstring.

    Args:
        student: the changed model (trained in place), a SentenceEncoder, Bert or TransformerLM.
        teacher: the original (not changed; frozen).
        texts: training inputs: texts (SentenceEncoder) or token ids ((n, N) int tensor, id lists).
        minutes: stop after this much wall time.
        steps: stop after this many optimizer steps (at least one of minutes and steps is needed; with
            both, whichever comes first).
        lr: AdamW learning rate (no weight decay), after a linear warm-up over the first 10 steps.
        batch_size: inputs per step; the inputs are reshuffled (seeded) every pass.
        max_tokens: each input is cut to its first ``max_tokens`` tokens.
        train: "changed" (:func:`changed_parameters`), "attention" (every self-attention parameter),
            "all", or a list of parameter names.
        seed: the order of the inputs; with ``steps`` the result is the same on every run.
        progress: a progress bar on stderr.

    Returns:
        the student, in eval mode, with ``requires_grad`` as it was.

    Raises:
        ValueError: neither minutes nor steps, bad sizes, an unknown train choice or parameter name,
            nothing to train, models of different kinds or layer counts.
    """
    if minutes is None and steps is None:
        raise ValueError("recover needs minutes= (wall time) or steps= (optimizer steps), or both")
    if minutes is not None and not (isinstance(minutes, (int, float)) and minutes > 0):
        raise ValueError(f"minutes must be a number > 0, got {minutes!r}")
    for name, v in (("steps", steps), ("batch_size", batch_size), ("max_tokens", max_tokens)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if type(student) is not type(teacher):
        raise ValueError(
            f"student ({type(student).__name__}) and teacher ({type(teacher).__name__}) must be the same "
            "kind of model: the student is a changed copy of the teacher"
        )
    lm = isinstance(student, TransformerLM)
    if not isinstance(student, (SentenceEncoder, Bert, TransformerLM)):
        raise ValueError(
            f"recover runs SentenceEncoder, Bert and TransformerLM, got {type(student).__name__}"
        )
    params = dict(student.named_parameters())
    if train == "changed":
        names = changed_parameters(student, teacher)
    elif train == "attention":
        names = [n for n in params if ".self_attn." in f".{n}"]
    elif train == "all":
        names = list(params)
    elif isinstance(train, Sequence) and not isinstance(train, str):
        names = list(train)
        unknown = [n for n in names if n not in params]
        if unknown:
            raise ValueError(f"train names {unknown[:3]} are not parameters of the student")
    else:
        raise ValueError(f"train must be 'changed', 'attention', 'all' or a list of names, got {train!r}")
    if not names:
        raise ValueError(
            "nothing to train: the student's parameters equal the teacher's (train='all' to force)"
        )
    chosen = set(names)
    was = {n: p.requires_grad for n, p in params.items()}
    seqs = [s[:max_tokens] for s in to_id_lists(student, texts)]
    device = model_device(student)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW([params[n] for n in names], lr=lr, weight_decay=0.0)
    s_hooks, t_hooks = _Layers(student), _Layers(teacher)
    teacher_mode, limit = teacher.training, None if minutes is None else 60.0 * minutes
    student.eval()
    teacher.eval()
    for n, p in params.items():
        p.requires_grad_(n in chosen)
    bar, task = _progress(float(steps) if steps is not None else float(limit or 0.0), "recover", progress)
    start, step, order = time.perf_counter(), 0, torch.empty(0, dtype=torch.long)
    try:
        with bar:
            while True:
                elapsed = time.perf_counter() - start
                if (steps is not None and step >= steps) or (limit is not None and elapsed >= limit):
                    break
                if order.numel() < batch_size:
                    order = torch.cat([order, torch.randperm(len(seqs), generator=g)])
                idx, order = order[:batch_size], order[batch_size:]
                ids, real = pad_batch([seqs[i] for i in idx.tolist()], device)  # (B, N) each
                with torch.no_grad():
                    t_out = forward_ids(teacher, ids, real)  # (B, N, d) or (B, N, V)
                    t_layers = t_hooks.take()
                s_out = forward_ids(student, ids, real)
                loss = distillation_loss(s_hooks.take(), t_layers, s_out, t_out, real, lm=lm)
                for group in opt.param_groups:
                    group["lr"] = lr * min(1.0, (step + 1) / 10)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                done = step if steps is not None else min(time.perf_counter() - start, limit or 0.0)
                bar.update(task, completed=done, info=f"step {step} loss {loss.item():.4f}")
    finally:
        s_hooks.close()
        t_hooks.close()
        for n, p in params.items():
            p.requires_grad_(was[n])
        teacher.train(teacher_mode)
    return student.eval()
