"""``estimate``: the cost of one forward call of a whole model, as a :class:`Cost`.

The rows are the embedding (where the model has one), the layer walk of :func:`walk_layer` once per kind
of layer with ``count`` = how many such layers run, and the final norm and LM head (where the model has
them). Totals multiply each row by its count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from .configs import as_shape
from .kv import kv_cache_bytes
from .ops import Call, Op, linear, norm, step, total
from .roofline import Roof, RooflinePoint, roofline
from .shapes import ModelShape
from .walk import walk_layer

__all__ = ["Cost", "estimate"]

_NORM = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}


@dataclass(frozen=True)
class Cost:
    """One forward call of ``model`` under ``call``: the rows and the memory it needs.

    Memory figures, in bytes at the call's dtype:
        weight_bytes: every parameter once (a tied head counted once).
        activation_bytes: what a forward holds at once outside the scores and the cache (no autograd):
            the residual stream (B, Nq, d) plus the widest intermediate - the fused QKV output
            (B, Nq, (Hq + 2 Hkv) D), the FFN hidden (both halves for SwiGLU) or the logits (B, Nq, V).
        score_bytes: one (B, Hq, Nq, Nk) score matrix, as eq. (2) materialises it per layer; the fused
            kernels (``sdpa``, ``tiled``) never hold it.
        kv_cache_bytes: K and V of every layer for the tokens held after the call (at most ``window``
            for a sliding-window model).
    """

    model: ModelShape
    call: Call
    rows: tuple[Op, ...]
    weight_bytes: int
    activation_bytes: int
    score_bytes: int
    kv_cache_bytes: int

    @property
    def flops(self) -> int:
        return self.total().flops

    @property
    def bytes(self) -> int:
        return self.total().bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte of the whole call."""
        return self.total().intensity

    @property
    def matmul_flops(self) -> int:
        """FLOPs of the matmul rows: what ``torch.utils.flop_counter.FlopCounterMode`` counts."""
        return sum(o.flops * o.count for o in self.rows if o.is_matmul)

    @property
    def params(self) -> int:
        return self.model.params

    def total(self) -> Op:
        return total(list(self.rows))

    def memory(self) -> dict[str, int]:
        """The four memory figures by name."""
        return {
            "weights": self.weight_bytes,
            "activations": self.activation_bytes,
            "attention scores": self.score_bytes,
            "KV cache": self.kv_cache_bytes,
        }

    def roofline(self, peak_flops: float, bandwidth: float) -> list[RooflinePoint]:
        """Each row under a roof of ``peak_flops`` FLOP/s and ``bandwidth`` bytes/s (see :class:`Roof`).

        Raises:
            ValueError: a rate that is not positive.
        """
        return roofline(self.rows, Roof(peak_flops, bandwidth))

    def seconds(self, roof: Roof) -> float:
        """The roofline's lower bound on the call's time: the sum over rows of max(compute, memory)."""
        return sum(p.seconds for p in roofline(self.rows, roof))

    def as_dict(self) -> dict[str, Any]:
        c = self.call
        return {
            "model": self.model.describe(),
            "call": {
                "batch": c.batch,
                "seq_len": c.seq_len,
                "phase": c.phase,
                "cached": c.cached,
                "Nq": c.Nq,
                "Nk": c.Nk,
                "dtype": str(c.dtype).replace("torch.", ""),
            },
            "rows": [o.as_dict() for o in self.rows],
            "flops": self.flops,
            "bytes": self.bytes,
            "intensity": self.intensity,
            "matmul_flops": self.matmul_flops,
            "params": self.params,
            "memory": self.memory(),
        }


def _embedding_ops(m: ModelShape, c: Call) -> list[Op]:
    """Token lookup, position / token-type adds and BERT's embedding norm."""
    if not m.vocab_size:
        return []
    d, x = m.d_model, (c.batch, c.Nq, m.d_model)
    ops = [step(c, "E = embed(ids)", "-", [("W_E rows", x)], x, 0)]
    extra: list[tuple[str, tuple[int, ...]]] = (
        [("P", (c.Nq, d))] if m.positions in ("learned", "sinusoidal") else []
    )
    extra += [("T", x)] if m.token_types else []
    if extra:
        name = "X = E + " + " + ".join(label for label, _ in extra)
        ops.append(step(c, name, "-", [("E", x), *extra], x, len(extra) * math.prod(x)))
    if m.embed_norm:
        ops.append(norm(c, m.embed_norm, f"X = {_NORM[m.embed_norm]}(X)", "-", "X", d))
    return ops


def _head_ops(m: ModelShape, c: Call) -> list[Op]:
    """The final norm of a pre-LN stack and the LM head; forward() projects every new row."""
    ops = []
    h = "H"
    if m.final_norm:
        ops.append(norm(c, m.final_norm, f"Hf = {_NORM[m.final_norm]}(H)", "-", "H", m.d_model))
        h = "Hf"
    if m.lm_head:
        w = "W_E^T" if m.tie_embeddings else "W_out"
        ops.append(linear(c, f"logits = {h} {w}", "-", h, w, m.d_model, m.vocab_size, False))
    return ops


def _layer_ops(m: ModelShape, c: Call) -> list[Op]:
    ops, first = [], 0
    for spec, n in m.layers:
        part = "layer" if len(m.layers) == 1 else f"layers {first}-{first + n - 1}"
        ops += [replace(o, count=n, part=part) for o in walk_layer(spec, c)]
        first += n
    return ops


def _check_positions(m: ModelShape, c: Call) -> None:
    table = m.positions in ("learned", "sinusoidal")
    if table and m.max_len is not None and c.tokens > m.max_len:
        raise ValueError(
            f"seq_len covers {c.tokens} positions (cached {c.cached} + new {c.Nq}) but {m.name}'s "
            f"{m.positions} position table has max_len={m.max_len}; use seq_len <= {m.max_len}"
        )


def _memory(m: ModelShape, c: Call) -> tuple[int, int, int, int]:
    """weights, activations, scores, KV cache (bytes); see :class:`Cost`."""
    size = c.itemsize
    widest = max(
        max((s.n_heads + 2 * s.n_kv_heads) * s.head_dim, s.d_ff * (2 if s.activation == "swiglu" else 1))
        for s, _ in m.layers
    )
    widest = max(widest, m.vocab_size if m.lm_head else 0)
    activations = c.rows * (m.d_model + widest) * size
    scores = max(c.batch * s.n_heads * c.Nq * c.Nk for s, _ in m.layers) * size
    held = c.tokens if m.window is None else min(c.tokens, m.window)
    cache = sum(kv_cache_bytes(n, c.batch, held, s.n_kv_heads, s.head_dim, c.dtype) for s, n in m.layers)
    return m.params * size, activations, scores, cache


def estimate(
    model_or_config: Any,
    batch: int,
    seq_len: int,
    *,
    phase: str = "prefill",
    dtype: torch.dtype | None = None,
    cached: int | None = None,
) -> Cost:
    """FLOPs, bytes, intensity and memory of one forward call, per operation of eq. (1)-(13).

    Args:
        model_or_config: a multihead ``TransformerLM``, ``Encoder``, ``Bert``, ``SentenceEncoder``,
            ``TransformerLayer`` or ``MultiHeadAttention``; a config dict (Hugging Face config.json of
            bert / gpt2 / llama / mistral / qwen2, or ``multihead-lm`` / ``multihead-encoder``); a
            preset name (:data:`multihead.cost.PRESETS`); or a :class:`ModelShape`.
        batch: B sequences.
        seq_len: tokens per sequence; prefill runs all of them, decode the one that brings the context
            to ``seq_len``.
        phase: ``"prefill"`` (Nq = seq_len rows against cached + seq_len keys) or ``"decode"`` (Nq = 1
            row against cached + 1 keys, at most ``window`` of them for a sliding-window model).
        dtype: element type of weights and activations; default the model's own (its parameters', the
            config's ``torch_dtype``), else float32.
        cached: tokens already in the KV cache; default 0 for prefill, ``seq_len - 1`` for decode.

    Returns:
        A :class:`Cost`: ``rows`` (each an :class:`Op` with its ``count`` and ``part``), totals
        ``.flops``, ``.bytes``, ``.intensity``, ``.matmul_flops`` and the memory figures.

    Raises:
        ValueError: an unknown preset or model type, a bad phase, ``seq_len`` or ``batch`` < 1,
            ``cached < 0``, more positions than a learned position table holds.
    """
    m = as_shape(model_or_config)
    dt = dtype if dtype is not None else m.dtype or torch.float32
    c = Call.make(seq_len, batch, dt, phase, cached, m.window)
    _check_positions(m, c)
    embedding = [replace(o, part="embedding") for o in _embedding_ops(m, c)]
    head = [replace(o, part="head") for o in _head_ops(m, c)]
    rows = (*embedding, *_layer_ops(m, c), *head)
    return Cost(m, c, rows, *_memory(m, c))
