"""Recover what head surgery (``prune``, ``to_gqa``, ``to_mla``) cost, by distilling the original model
into the changed one (knowledge distillation, Hinton, Vinyals and Dean, 2015, "Distilling the Knowledge
in a Neural Network"; layer-wise hidden-state matching as in TinyBERT, Jiao et al., 2020).

The loss on a batch of texts, averaged over real (non-pad) tokens:

    layers     (1/L) sum_l ||h_l^S - h_l^T||^2 / mean(h_l^T ^2)       every layer's output, scale-free
    encoders   + (1 - cos(mean-pool h^S, mean-pool h^T))               the sentence embedding
    LMs        + KL(softmax(z^T) || softmax(z^S))                      the next-token distribution

By default only what the surgery changed is trained: the student's parameters that the teacher lacks,
has in another shape, or holds with other values; everything else stays frozen (and bit-identical).

The defaults are the steadiest recipe measured on all-MiniLM-L6-v2 (BENCHMARKS.md, "Head surgery that
keeps quality"), so that ``recover(student, teacher, texts, minutes=8)`` is the recipe:

- **mixed lengths**: texts are cut into sentences and 1-3 word spans as well (:func:`mixed_lengths`).
  On whole docstrings alone recovery drifts toward long inputs: Lee rises past the original while
  WordSim's words and polarity's sentences fall (91.3% of the original after 8 minutes at lr 1e-4);
- **lr 2e-5** with a 10-step warm-up and a cosine decay to zero at the end of the budget: 5e-5 and
  1e-4 drifted (93.96% and 91.28% after 8 minutes); 2e-5 kept Lee 105%, WordSim 99.6%, polarity
  97.99%. For an LM the default is 1e-4 (not measured at scale here);
- **a held-out stop**: 64 inputs are set aside and the distillation loss on them is checked 20 times
  over the budget; the student ends with the parameters of the best check (the unrecovered one
  included), and training stops after 6 checks without improvement.

Minutes buy steps, so a step wastes nothing: a batch of mixed lengths (a word beside a 128-token
docstring, most of one padded pass being padding) runs as a few parts of similar length, each padded to its
own longest, with the loss written as sums over inputs normalised by the whole batch's totals, so the loss
and the gradient are those of the one padded pass; and the frozen teacher's outputs are kept (up to
``teacher_cache_mb``) so that later passes over the inputs skip it. Together: 1.9x the steps of one padded
pass in the same minutes on MiniLM (BENCHMARKS.md, "Head surgery that keeps quality").

Shape legend: B batch, N tokens, d width, V vocabulary.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..models.lm import TransformerLM
from ..pretrained.bert import Bert
from ..pretrained.sentence_encoder import SentenceEncoder
from .access import model_device, to_id_lists
from .distill import HeldOut, Layers, TeacherCache, batch_loss, distillation_loss, schedule, split_holdout

__all__ = ["ENCODER_LR", "LM_LR", "changed_parameters", "distillation_loss", "mixed_lengths", "recover"]


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


def _progress(total: float, label: str, enabled: bool) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
        console=Console(file=sys.stderr), disable=not enabled, transient=False,
    )  # fmt: skip
    return bar, bar.add_task(label, total=total, info="")


#: The recovery recipe's defaults for a sentence encoder (BENCHMARKS.md, "Head surgery that keeps
#: quality"): lr 2e-5 kept MiniLM MLA r=128 steadiest (Lee 105%, WordSim 99.6%, polarity 97.99% after 8
#: minutes on mixed lengths), where 5e-5 and 1e-4 drifted (polarity 93.96% and 91.28% after 8 minutes).
ENCODER_LR = 2e-5
#: For an LM (recovery of a converted TransformerLM's changed attention only; not measured at scale here:
#: the held-out stop keeps the best state whatever the rate does).
LM_LR = 1e-4


def _check_args(student: nn.Module, teacher: nn.Module, minutes: Any, sizes: dict[str, Any]) -> None:
    """The argument checks of :func:`recover`.

    Raises:
        ValueError: see :func:`recover`.
    """
    if minutes is None and sizes["steps"] is None:
        raise ValueError("recover needs minutes= (wall time) or steps= (optimizer steps), or both")
    if minutes is not None and not (isinstance(minutes, (int, float)) and minutes > 0):
        raise ValueError(f"minutes must be a number > 0, got {minutes!r}")
    for name, v in sizes.items():
        low = 0 if name in ("holdout", "patience") else 1
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    if type(student) is not type(teacher):
        raise ValueError(
            f"student ({type(student).__name__}) and teacher ({type(teacher).__name__}) must be the same "
            "kind of model: the student is a changed copy of the teacher"
        )
    if not isinstance(student, (SentenceEncoder, Bert, TransformerLM)):
        raise ValueError(
            f"recover runs SentenceEncoder, Bert and TransformerLM, got {type(student).__name__}"
        )


def _trained_names(student: nn.Module, teacher: nn.Module, train: Any) -> list[str]:
    """The parameter names ``train`` picks.

    Raises:
        ValueError: an unknown choice or name, nothing to train.
    """
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
    return names


class _Average:
    """An exponential moving average of the trained parameters (Polyak averaging; decay ramped in as
    min(decay, (1 + t) / (10 + t)) so the first steps do not pull it toward the unrecovered start)."""

    def __init__(self, params: list[torch.Tensor], decay: float):
        self.params, self.decay = params, decay
        self.avg = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self, t: int) -> None:
        d = min(self.decay, (1 + t) / (10 + t))
        torch._foreach_lerp_(self.avg, [p.detach() for p in self.params], 1 - d)

    @torch.no_grad()
    def copy_to_params(self) -> None:
        for p, a in zip(self.params, self.avg):
            p.copy_(a)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The averaged parameters in place of the trained ones inside the block."""
        kept = [p.detach().clone() for p in self.params]
        self.copy_to_params()
        try:
            yield
        finally:
            with torch.no_grad():
                for p, k in zip(self.params, kept):
                    p.copy_(k)


def _batches(seqs: list[list[int]], batch_size: int, g: torch.Generator) -> Iterator[list[int]]:
    """Batches of indices into ``seqs`` forever, reshuffled (seeded) every pass."""
    order = torch.empty(0, dtype=torch.long)
    while True:
        if order.numel() < batch_size:
            order = torch.cat([order, torch.randperm(len(seqs), generator=g)])
        idx, order = order[:batch_size], order[batch_size:]
        yield idx.tolist()


def _step(
    student: nn.Module, teacher: nn.Module, hooks: tuple[Layers, Layers], seqs: list[list[int]],
    batch: list[int], cache: TeacherCache, lm: bool, opt: torch.optim.Optimizer, lr: float,
) -> float:  # fmt: skip
    """One optimizer step on the inputs ``batch`` (indices into ``seqs``; run in parts of similar length,
    the teacher's outputs from ``cache`` where kept); the loss."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    device = model_device(student)
    loss = batch_loss(student, teacher, hooks, [seqs[i] for i in batch], device, lm=lm, backward=True,
                      keys=batch, cache=cache)  # fmt: skip
    opt.step()
    return loss


#: what ``recover(minutes=...)`` counts: elapsed time, or the process's CPU time over all its threads
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def recover(
    student: nn.Module,
    teacher: nn.Module,
    texts: Any,
    *,
    minutes: float | None = None,
    steps: int | None = None,
    clock: str = "wall",
    lr: float | None = None,
    lengths: str = "mixed",
    batch_size: int = 16,
    max_tokens: int = 128,
    train: str | Sequence[str] = "changed",
    holdout: int = 64,
    checks: int = 20,
    patience: int = 6,
    teacher_cache_mb: float = 1024,
    average: float | None = None,
    seed: int = 0,
    progress: bool = True,
    report: dict[str, Any] | None = None,
) -> nn.Module:
    """Distil ``teacher`` into ``student`` (a changed copy of it) on ``texts``; see the module docstring.

    The defaults are the recipe measured on all-MiniLM-L6-v2 (BENCHMARKS.md, "Head surgery that keeps
    quality"; docs in README "Head surgery"): texts cut into mixed lengths, lr 2e-5 (1e-4 for an LM),
    warm-up then cosine decay to zero over the budget, and a held-out distillation loss checked
    ``checks`` times over the budget: training stops after ``patience`` checks without improvement and
    the student ends with the parameters of its best check (the unrecovered student counts as one).

    Args:
        student: the changed model (trained in place), a SentenceEncoder, Bert or TransformerLM.
        teacher: the original (not changed; frozen).
        texts: training inputs: texts (SentenceEncoder) or token ids ((n, N) int tensor, id lists).
        minutes: stop after this much time on ``clock``.
        steps: stop after this many optimizer steps (at least one of minutes and steps is needed; with
            both, whichever comes first).
        clock: what ``minutes`` counts: "wall" (elapsed time) or "cpu" (this process's CPU time, all its
            threads: ``time.process_time``), a budget that a machine shared with other work does not
            shrink; 8 CPU-minutes are about 4 minutes of wall time on two idle cores.
        lr: AdamW peak learning rate (no weight decay); None: 2e-5 (encoders) or 1e-4 (LMs).
        lengths: "mixed" (texts only): train on :func:`mixed_lengths` of the texts - the texts, their
            sentences and 1-3 word spans - so that short inputs do not drift; "as-given": the inputs as
            they are (token ids are always as given).
        batch_size: inputs per step; the inputs are reshuffled (seeded) every pass.
        max_tokens: each input is cut to its first ``max_tokens`` tokens.
        train: "changed" (:func:`changed_parameters`), "attention" (every self-attention parameter),
            "all", or a list of parameter names.
        holdout: inputs set aside (seeded; at most half) for the held-out loss; 0: no held-out checks
            (the last state is kept).
        checks: held-out evaluations over the budget (evenly spaced in steps, or in time with minutes).
        patience: stop after this many checks in a row without a better held-out loss; 0: never early.
        teacher_cache_mb: MiB of the teacher's outputs kept (each input's layer outputs and final output,
            real tokens only) so that later passes over the inputs skip the teacher; 0: run the teacher
            on every batch. MiniLM on the default 2000 docstrings needs about 1 GiB.
        average: None, or the decay (0 < average < 1) of an exponential moving average of the trained
            parameters (ramped in as min(average, (1 + t) / (10 + t)) at step t): the held-out checks
            score the average and the student ends with the best checked one (without held-out checks,
            the last average).
        seed: the split and the order of the inputs; with ``steps`` the result is the same on every run.
        progress: a progress bar on stderr.
        report: None, or a dict that receives ``steps``, ``best_step``, ``heldout`` ([(step, loss)]),
            ``stopped`` ("steps", "minutes" or "patience") and ``lr``.

    Returns:
        the student, in eval mode, with ``requires_grad`` as it was.

    Raises:
        ValueError: neither minutes nor steps, bad sizes or teacher_cache_mb, an unknown lengths, train
            choice or parameter name, an unknown clock, nothing to train, models of different kinds or
            layer counts.
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {list(CLOCKS)} (what minutes counts), got {clock!r}")
    now = CLOCKS[clock]
    sizes = {"steps": steps, "batch_size": batch_size, "max_tokens": max_tokens, "holdout": holdout,
             "checks": checks, "patience": patience}  # fmt: skip
    _check_args(student, teacher, minutes, sizes)
    if lengths not in ("mixed", "as-given"):
        raise ValueError(f"lengths must be 'mixed' or 'as-given', got {lengths!r}")
    lm = isinstance(student, TransformerLM)
    lr = (LM_LR if lm else ENCODER_LR) if lr is None else lr
    if not (isinstance(lr, (int, float)) and 0 < lr < math.inf):
        raise ValueError(f"lr must be a number > 0 or None, got {lr!r}")
    if average is not None and not (
        isinstance(average, (int, float)) and not isinstance(average, bool) and 0 < average < 1
    ):
        raise ValueError(f"average must be None or a decay between 0 and 1 (e.g. 0.99), got {average!r}")
    ok = isinstance(teacher_cache_mb, (int, float)) and not isinstance(teacher_cache_mb, bool)
    if not (ok and 0 <= teacher_cache_mb < math.inf):
        raise ValueError(f"teacher_cache_mb must be a number >= 0 (MiB), got {teacher_cache_mb!r}")
    names = _trained_names(student, teacher, train)
    strings = isinstance(texts, Sequence) and not isinstance(texts, str) and len(texts) > 0
    if lengths == "mixed" and strings and all(isinstance(t, str) for t in texts):
        texts = mixed_lengths(texts, seed=seed)
    params = dict(student.named_parameters())
    trained = {n: params[n] for n in names}
    was = {n: p.requires_grad for n, p in params.items()}
    g = torch.Generator().manual_seed(seed)
    seqs, held = split_holdout([s[:max_tokens] for s in to_id_lists(student, texts)], holdout, g)
    device = model_device(student)
    opt = torch.optim.AdamW(list(trained.values()), lr=lr, weight_decay=0.0)
    hooks = (Layers(student), Layers(teacher))
    cache = TeacherCache(int(teacher_cache_mb * 2**20))
    judge = HeldOut(held, batch_size, device, lm, cache) if held else None
    ema = _Average(list(trained.values()), average) if average else None
    teacher_mode, limit = teacher.training, None if minutes is None else 60.0 * minutes
    student.eval()
    teacher.eval()
    for n, p in params.items():
        p.requires_grad_(n in trained)
    bar, task = _progress(float(steps) if steps is not None else float(limit or 0.0), "recover", progress)
    start, step, stopped, stale, next_check = now(), 0, "", 0, 0.0
    batches = _batches(seqs, batch_size, g)

    def check(at: int) -> bool:  # the held-out loss of the student (of its average, with one)
        assert judge is not None
        with ema.swapped() if ema else contextlib.nullcontext():
            return judge.check(student, teacher, hooks, trained, at)

    try:
        with bar:
            if judge is not None:
                check(0)  # the unrecovered student is a candidate
            while True:
                elapsed = now() - start
                done = max(0.0 if steps is None else step / steps, 0.0 if limit is None else elapsed / limit)
                if done >= 1.0:
                    stopped = "steps" if steps is not None and step >= steps else "minutes"
                    break
                if judge is not None and step > 0 and done >= next_check + 1.0 / checks:
                    next_check = done
                    stale = 0 if check(step) else stale + 1
                    if patience and stale >= patience:
                        stopped = "patience"
                        break
                rate = schedule(lr, step, done)
                loss = _step(student, teacher, hooks, seqs, next(batches), cache, lm, opt, rate)
                step += 1
                if ema:
                    ema.update(step)
                shown = step if steps is not None else min(now() - start, limit or 0.0)
                bar.update(task, completed=shown, info=f"step {step} loss {loss:.4f}")
            if judge is not None and judge.history[-1][0] != step:
                check(step)
        if judge is not None:
            judge.restore(trained)
        elif ema:
            ema.copy_to_params()
    finally:
        for h in hooks:
            h.close()
        for n, p in params.items():
            p.requires_grad_(was[n])
        teacher.train(teacher_mode)
    if report is not None:
        best = step if judge is None else judge.best_step
        report.update(
            steps=step, stopped=stopped, lr=lr, best_step=best, heldout=(judge and judge.history) or []
        )
    return student.eval()
