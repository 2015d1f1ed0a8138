"""A tiny trainer: a 2-layer :class:`~multihead.TransformerLM` learns MQAR (:func:`multihead.data.mqar`).

Exact attention solves MQAR with an induction head (layer 1 copies each token's predecessor into it,
layer 2 matches the query key against those copies); the point of training the same model with an
approximation (``approx=`` any :mod:`multihead.approx` object, set as every attention's backend) is to see
which of them keep that ability.

Recipe (:class:`TrainConfig` defaults): d_model 64, 2 layers, 2 heads, LLaMA blocks (pre-LN RMSNorm,
SwiGLU, rotary), token embeddings N(0, 1/d) (see ``embed_std``), AdamW lr 3e-3 with warm-up and cosine
decay, batch 32, 5000 steps of which the first 2000 are a curriculum at a quarter of the size (seq_len
64, 4 pairs: see ``short_steps``), fresh examples every step (no example repeats), loss only at the
query positions. The
model is causal unless the approximation has no causal form (Linformer, Nystrom mix the whole sequence):
MQAR puts no answer after its query, so a bidirectional model cannot read the answer off the input.

Like every induction-head task MQAR trains through a plateau and a sudden drop. Trained directly at the
Zoology's size (seq_len 256, 16 pairs, vocab 8192) the plateau outlasted 2500 steps (d_model 64 or 128);
at a quarter of the size the drop comes after ~1500 steps of 4x cheaper steps, and the mechanism
(a previous-token head and a match on rotary-relative positions) carries over to the full length at
once (the loss falls from 4.5 to 0.07 within 100 full-size steps). The default recipe reaches >= 99%
held-out accuracy at the full size in ~20-25 CPU minutes (BENCHMARKS.md, "MQAR").

Shape legend: B batch, N tokens (seq_len), d = d_model, V = vocab, Q = query positions in a batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import threads
from ..core.masks import Mask, causal
from ..data import IGNORE_INDEX, mqar
from ..models.lm import TransformerLM
from ..variants import aux_loss

__all__ = ["TrainConfig", "TrainResult", "accuracy", "build_model", "train_mqar"]

_EVAL_OFFSET = (
    1 << 31
)  # held-out set: seed (cfg.seed << 32) + 2^31; training batch `step`: (cfg.seed << 32) + step


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a run; two runs with equal configs give equal models (CPU)."""

    seq_len: int = 256
    n_pairs: int = 16
    vocab: int = 8192
    power_a: float = 0.01
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2
    d_ff: int = 128
    steps: int = 5000
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    eval_examples: int = 1000
    seed: int = 0
    #: the attention design (:data:`multihead.variants.NAMES`: "mha", "gqa", "moh", "dcmha", ...)
    attention: str = "mha"
    #: curriculum: the first ``short_steps`` steps train on sequences of ``seq_len // 4`` with
    #: ``n_pairs // 4`` pairs (at least 1) - 4x cheaper steps in which the induction mechanism forms
    #: (it is length-independent with rotary positions); the rest, and the evaluation, at full size.
    #: None: 40% of ``steps`` (2000 of the default 5000); 0: no curriculum
    short_steps: int | None = None
    #: std of the (tied) token embedding at initialisation, default d_model^-0.5 (rows of norm ~1). GPT-2's
    #: 0.02 makes every logit ~0 and the model must first grow 8192 rows that each appear a few times per
    #: batch (MQAR stalls); N(0, 1) makes the initial logits huge
    embed_std: float | None = None

    def size_at(self, step: int) -> tuple[int, int]:
        """(seq_len, n_pairs) of training step ``step`` (see ``short_steps``)."""
        short = 2 * self.steps // 5 if self.short_steps is None else self.short_steps
        if step < short:
            n = max(4 * max(1, self.n_pairs // 4), (self.seq_len // 4) // 2 * 2)
            return n, max(1, self.n_pairs // 4)
        return self.seq_len, self.n_pairs

    def __post_init__(self) -> None:
        for name in (
            "seq_len",
            "n_pairs",
            "vocab",
            "d_model",
            "n_layers",
            "n_heads",
            "d_ff",
            "steps",
            "batch",
        ):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"TrainConfig {name} must be an int >= 1, got {val!r}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig lr must be > 0, got {self.lr!r}")
        ss = self.short_steps
        if ss is not None and (isinstance(ss, bool) or not isinstance(ss, int) or ss < 0):
            raise ValueError(f"TrainConfig short_steps must be an int >= 0 or None, got {ss!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"TrainConfig warmup must be an int >= 0, got {self.warmup!r}")
        from ..variants import NAMES

        if self.attention not in NAMES:
            raise ValueError(f"TrainConfig attention must be one of {list(NAMES)}, got {self.attention!r}")
        if self.embed_std is not None and not self.embed_std > 0:
            raise ValueError(
                f"TrainConfig embed_std must be > 0 or None (d_model^-0.5), got {self.embed_std!r}"
            )


@dataclass
class TrainResult:
    """Held-out accuracy (fraction of query positions answered right) and the run's record."""

    accuracy: float
    losses: list[float]
    seconds: float
    config: dict[str, Any]
    approx: str
    causal: bool
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_model(cfg: TrainConfig, approx: Any = None) -> TransformerLM:
    """The config's TransformerLM (seeded), with every attention replaced by ``approx`` when given."""
    torch.manual_seed(cfg.seed)
    model = TransformerLM(cfg.vocab, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, max_len=cfg.seq_len)
    std = cfg.d_model**-0.5 if cfg.embed_std is None else cfg.embed_std
    torch.nn.init.normal_(model.embed.weight, std=std)  # tied: also the output projection
    if cfg.attention != "mha":
        from ..variants import swap

        if approx is not None:
            raise ValueError(
                f"train either a head design (attention={cfg.attention!r}) or an approximation "
                f"({approx!r}) on plain MHA, not both"
            )
        torch.manual_seed(cfg.seed + 1)
        swapped = swap(model, cfg.attention)
        assert isinstance(swapped, TransformerLM)
        model = swapped
    if approx is None:
        return model
    from ..approx import apply

    out = apply(model, approx)
    assert isinstance(out, TransformerLM)
    return out


def _mask_for(approx: Any) -> Mask | None:
    """causal() unless the approximation has no causal form."""
    return causal() if approx is None or getattr(approx, "supports_causal", True) else None


def _hidden(model: TransformerLM, ids: Tensor, mask: Mask | None) -> Tensor:
    """The final hidden states (B, N, d): TransformerLM.forward without the vocabulary projection, so the
    loss can project only the Q query positions (the (B*N, V) logits would cost more than the model)."""
    x = model.embed(ids)  # (B, N, d)
    if model.pos_embed is not None:
        x = x + model.pos_embed(torch.arange(ids.shape[1], device=ids.device))  # (B, N, d)
    for layer in model.layers:
        x = layer(x, mask=mask)  # (B, N, d)
    return model.final_norm(x)


def _query_logits(model: TransformerLM, ids: Tensor, labels: Tensor, mask: Mask | None) -> Tensor:
    """Logits (Q, V) at the positions that carry a label."""
    h = _hidden(model, ids, mask)
    return model.lm_head(h[labels != IGNORE_INDEX])  # (Q, V)


@torch.no_grad()
def accuracy(
    model: TransformerLM, inputs: Tensor, labels: Tensor, *, mask: Mask | None, batch: int = 250
) -> float:
    """Fraction of query positions whose arg-max prediction is the right value (eval mode)."""
    was = model.training
    model.eval()
    right = total = 0
    for i in range(0, inputs.shape[0], batch):
        ids, lab = inputs[i : i + batch], labels[i : i + batch]
        pred = _query_logits(model, ids, lab, mask).argmax(-1)  # (Q,)
        right += int((pred == lab[lab != IGNORE_INDEX]).sum())
        total += int((lab != IGNORE_INDEX).sum())
    model.train(was)
    return right / max(total, 1)


def _lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def train_mqar(
    cfg: TrainConfig | None = None,
    approx: Any = None,
    *,
    progress: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Train the config's model on fresh MQAR batches and report held-out accuracy.

    Args:
        cfg: the run (default :class:`TrainConfig`).
        approx: None for exact attention, or an approximation from :mod:`multihead.approx`.
        progress: called as ``progress(step, loss)`` after every step (drives the CLI's progress bar).

    Returns:
        a :class:`TrainResult` with the accuracy on ``cfg.eval_examples`` held-out examples.

    Raises:
        ValueError: what :class:`TrainConfig`, :func:`multihead.data.mqar` and the approximation raise.
    """
    cfg = TrainConfig() if cfg is None else cfg
    model = build_model(cfg, approx)
    mask = _mask_for(approx)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    test_x, test_y = mqar(
        cfg.eval_examples, cfg.seq_len, cfg.n_pairs, cfg.vocab, cfg.power_a, (cfg.seed << 32) + _EVAL_OFFSET
    )
    losses: list[float] = []
    start = time.perf_counter()
    model.train()
    with threads.training(model, cfg.batch * cfg.seq_len):  # small: 1 thread
        _steps(model, opt, cfg, mask, losses, progress)
    seconds = time.perf_counter() - start
    acc = accuracy(model, test_x, test_y, mask=mask)
    name = ("exact" if cfg.attention == "mha" else cfg.attention) if approx is None else repr(approx)
    extra = {
        "params": sum(p.numel() for p in model.parameters()),
        "flops": forward_flops(model, test_x[:1], mask),
    }
    return TrainResult(acc, losses, seconds, asdict(cfg), name, mask is not None, extra)


def _steps(model: TransformerLM, opt: torch.optim.Optimizer, cfg: TrainConfig, mask: Mask | None,
           losses: list[float], progress: Callable[[int, float], None] | None) -> None:  # fmt: skip
    """The training steps of :func:`train_mqar`; appends each step's loss to ``losses``."""
    for step in range(cfg.steps):
        n, pairs = cfg.size_at(step)
        x, y = mqar(cfg.batch, n, pairs, cfg.vocab, cfg.power_a, (cfg.seed << 32) + step)
        for group in opt.param_groups:
            group["lr"] = _lr_at(cfg, step)
        loss = F.cross_entropy(_query_logits(model, x, y, mask), y[y != IGNORE_INDEX])
        loss = loss + aux_loss(model)  # MoH's load balance, GatedHeads' L0 penalty; 0 otherwise
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step, losses[-1])


def forward_flops(model: TransformerLM, ids: Tensor, mask: Mask | None) -> int:
    """Matmul FLOPs of one forward pass over ``ids`` (B, N), as ``FlopCounterMode`` counts them.

    The counter does not see the fused CPU flash kernel, so for the count every module whose ``backend``
    is a name runs the ``matrix`` backend (the same attention as explicit matmuls); a backend object (an
    approximation) computes what it computes.
    """
    from torch.utils.flop_counter import FlopCounterMode

    was = model.training
    saved = {m: m.backend for m in model.modules() if isinstance(getattr(m, "backend", None), str)}
    model.eval()
    try:
        for m in saved:
            setattr(m, "backend", "matrix")  # noqa: B010 - nn.Module's __setattr__ types it as a Tensor
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            _hidden(model, ids, mask)
    finally:
        for m, b in saved.items():
            setattr(m, "backend", b)  # noqa: B010
        model.train(was)
    return int(counter.get_total_flops())
