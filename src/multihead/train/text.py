"""A small byte-level language model trained on the standard library's docstrings, one per head design.

The text ships with every Python: :func:`multihead.pretrained.stdlib_docstrings` gives the same list on
the same interpreter. Its UTF-8 bytes (vocabulary 256, no tokenizer) are split once, 90% for training and
the last 10% held out. Each design replaces the self-attention of the same seeded
:class:`~multihead.TransformerLM` (:func:`multihead.variants.swap`) and trains with the same batches,
steps and AdamW schedule, so the designs differ only in their attention.

Measured per design (:class:`TextResult`):

    bits_per_byte      held-out cross-entropy in bits per byte (lower is better)
    decode_tok_s       tokens/s of greedy KV-cached generation, batch 1, after a seq_len prompt
                       (``decode_cached`` False: the design cannot use a KV cache and recomputes):
                       the median of repeated runs (:func:`multihead.cost.timing.measure`), None
                       when too short to measure (``decode_why`` says why)
    kv_bytes_per_token what one token adds to the KV cache of all layers (model dtype)
    first_token_share  mean attention weight on the first position of each held-out window, over the
                       layers, heads and query rows past the first quarter (None when the design's
                       weights cannot be recorded); a softmax with nowhere else to put its mass parks it
                       there ("attention sink"), which learned sinks and output gates are said to remove

Shape legend: B batch, N tokens (seq_len).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import threads
from ..core.checks import check_int
from ..cost import timing
from ..cost.timing import Timing
from ..models.generation import generate
from ..models.lm import TransformerLM

__all__ = ["TextConfig", "TextResult", "byte_corpus", "decode_timing", "train_text_lm"]

#: Bytes are the tokens.
VOCAB = 256


@dataclass(frozen=True)
class TextConfig:
    """Everything that decides a run; equal configs give equal models (CPU)."""

    seq_len: int = 128
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 128
    steps: int = 200
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 20
    docs: int = 600
    eval_windows: int = 64
    decode_tokens: int = 32
    seed: int = 0
    #: a name of :data:`multihead.variants.NAMES`
    attention: str = "mha"

    def __post_init__(self) -> None:
        for name in ("seq_len", "d_model", "n_layers", "n_heads", "d_ff", "steps", "batch", "docs"):
            check_int(name, getattr(self, name), 1, owner="TextConfig")
        from ..variants import NAMES

        if self.attention not in NAMES:
            raise ValueError(f"TextConfig attention must be one of {list(NAMES)}, got {self.attention!r}")


@dataclass
class TextResult:
    """Held-out quality, decode speed and cache size of one design's text LM."""

    bits_per_byte: float
    losses: list[float]
    seconds: float
    decode_tok_s: float | None
    decode_cached: bool
    kv_bytes_per_token: int
    first_token_share: float | None
    params: int
    config: dict[str, Any] = field(default_factory=dict)
    decode_why: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def byte_corpus(docs: int) -> tuple[Tensor, Tensor]:
    """(train, held_out) int64 byte ids of the first ``docs`` standard-library docstrings joined by
    blank lines: the first 90% and the last 10%."""
    from ..pretrained.corpus import stdlib_docstrings

    data = "\n\n".join(stdlib_docstrings(docs)).encode("utf-8")
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()  # (T,)
    cut = int(0.9 * ids.numel())
    return ids[:cut], ids[cut:]


def _windows(ids: Tensor, starts: Tensor, n: int) -> Tensor:
    """(len(starts), n + 1) windows of ``ids`` starting at ``starts``."""
    offsets = torch.arange(n + 1)  # (n+1,)
    return ids[starts[:, None] + offsets]  # (B, n+1)


def _model(cfg: TextConfig) -> TransformerLM:
    torch.manual_seed(cfg.seed)
    model = TransformerLM(VOCAB, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, max_len=cfg.seq_len * 2)
    if cfg.attention != "mha":
        from ..variants import swap

        torch.manual_seed(cfg.seed + 1)
        swapped = swap(model, cfg.attention)
        assert isinstance(swapped, TransformerLM)
        model = swapped
    return model


def _lr(cfg: TextConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def _first_token_share(model: TransformerLM, x: Tensor) -> float | None:
    """Mean weight on key 0 over layers, heads and query rows past N/4 (None if nothing recorded)."""
    from ..heads.maps import capture_attention

    with capture_attention(model, designs=True) as records, torch.no_grad():
        model(x)
    shares = []
    for calls in records:
        for w in calls:  # (B, Hq, N, N)
            shares.append(w[:, :, w.shape[2] // 4 :, 0].mean().item())
    return sum(shares) / len(shares) if shares else None


def _train_steps(model: nn.Module, opt: torch.optim.Optimizer, cfg: TextConfig, train_ids: Tensor,
                 g: torch.Generator, losses: list[float]) -> None:  # fmt: skip
    """The training steps of :func:`train_text_lm`; appends each step's loss to ``losses``."""
    from ..variants import aux_loss

    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        starts = torch.randint(0, train_ids.numel() - cfg.seq_len - 1, (cfg.batch,), generator=g)
        w = _windows(train_ids, starts, cfg.seq_len)  # (B, N+1)
        logits = model(w[:, :-1])  # (B, N, V)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), w[:, 1:].reshape(-1)) + aux_loss(model)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())


def train_text_lm(cfg: TextConfig) -> TextResult:
    """Train ``cfg``'s design on the docstrings; held-out bits/byte, decode speed, cache, sink share."""
    from ..heads.gqa import kv_cache_bytes_per_token

    train_ids, held = byte_corpus(cfg.docs)
    if held.numel() < cfg.seq_len + 2 or train_ids.numel() < cfg.seq_len + 2:
        raise ValueError(f"TextConfig docs={cfg.docs} gives too little text for seq_len {cfg.seq_len}")
    model = _model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    g = torch.Generator().manual_seed(cfg.seed)
    losses: list[float] = []
    t0 = time.perf_counter()
    model.train()
    with threads.training(model, cfg.batch * cfg.seq_len):  # small: 1 thread
        _train_steps(model, opt, cfg, train_ids, g, losses)
    seconds = time.perf_counter() - t0
    model.eval()
    n_eval = min(cfg.eval_windows, (held.numel() - 1) // cfg.seq_len)
    starts = torch.arange(n_eval) * cfg.seq_len  # (n_eval,): disjoint windows
    w = _windows(held, starts, cfg.seq_len)  # (n_eval, N+1)
    with torch.no_grad():
        logits = model(w[:, :-1])  # (n_eval, N, V)
        nats = F.cross_entropy(logits.reshape(-1, VOCAB), w[:, 1:].reshape(-1)).item()
    share = _first_token_share(model, w[:8, :-1])
    prompt = w[:1, :-1]  # (1, N)
    cached = not any(getattr(layer.self_attn, "no_cache", None) for layer in model.layers)
    cache = "dense" if cached else None  # a design that cannot cache recomputes the whole prefix
    decode = decode_timing(model, prompt, cfg.decode_tokens, cache)
    return TextResult(
        bits_per_byte=nats / math.log(2),
        losses=losses,
        seconds=seconds,
        decode_tok_s=decode.rate(cfg.decode_tokens),
        decode_cached=cached,
        kv_bytes_per_token=kv_cache_bytes_per_token(model),
        first_token_share=share,
        params=sum(p.numel() for p in model.parameters()),
        config=asdict(cfg),
        decode_why=decode.why,
    )


def decode_timing(
    model: TransformerLM,
    prompt: Tensor,
    new: int,
    cache: str | None,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Seconds per greedy ``generate(model, prompt, new)`` of ``prompt`` (1, N): after a warm-up, the
    median of repeated runs (at least 3, long enough for ``clock``), or "too short to measure"."""
    generate(model, prompt, 2, cache=cache)  # warm-up
    run = lambda: generate(model, prompt, new, cache=cache)  # noqa: E731
    # a generate of tens of tokens is never microseconds: 64 calls per sample are plenty
    return timing.measure(run, min_samples=3, max_inner=64, max_seconds=5.0, warmup=0, clock=clock)
