"""The rows of the cost model: :class:`Op` (one step's FLOPs and bytes), :class:`Call` (one forward call's
batch, tokens, phase and dtype) and the builders every walk uses - one unfused step, a linear layer, a
norm, a residual add.

Conventions: a matmul (m x k) @ (k x n) costs ``2 m k n`` FLOPs (``torch.utils.flop_counter``'s); bias
adds ride in the epilogue. Every step reads its inputs and writes its output once at the call's dtype.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..core.checks import check_int

__all__ = [
    "ACTIVATION_FLOPS",
    "NORM_FLOPS",
    "Call",
    "Op",
    "add",
    "linear",
    "norm",
    "norm_params",
    "step",
    "total",
]

# Elementwise FLOPs per element (rough, documented counts; none of these is a matmul).
SOFTMAX_FLOPS = 7  # scale, mask select, row max, subtract, exp, row sum, divide
NORM_FLOPS = {"layernorm": 7, "rmsnorm": 4}  # LN: mean, centre, square, sum, normalise, gamma, beta
RESIDUAL_FLOPS = 1  # one add
ROPE_FLOPS = 3  # x * cos + rotate_half(x) * sin
#: per element of the FFN hidden (R); "swiglu" is SiLU(G) * U.
ACTIVATION_FLOPS = {"relu": 1, "gelu": 8, "gelu_tanh": 8, "silu": 4, "swiglu": 5}


@dataclass(frozen=True)
class Op:
    """One step: ``flops`` and ``bytes`` (reads + writes) of one run over the whole batch.

    ``count`` is how many times the step runs in the model (``n_layers`` for a layer's step) and ``part``
    where it sits ("embedding", "layer", "head"); totals (:func:`total`) multiply by ``count``.
    """

    name: str
    eq: str
    in_shape: str
    out_shape: str
    flops: int
    bytes: int
    is_matmul: bool
    count: int = 1
    part: str = "layer"

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte moved (0.0 for a pure copy)."""
        return self.flops / self.bytes if self.bytes else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "intensity": self.intensity}


def norm_params(norm: str, d: int) -> int:
    """Weights of one norm over d features: LayerNorm gamma and beta, RMSNorm gamma only."""
    return 2 * d if norm == "layernorm" else d


@dataclass(frozen=True)
class Call:
    """One forward call: ``prefill`` runs Nq = seq_len new rows against Nk = cached + seq_len keys;
    ``decode`` one new row per sequence against Nk = cached + 1 keys, at most ``window`` of them (the
    sliding KV cache of a windowed model)."""

    batch: int
    seq_len: int
    phase: str
    cached: int
    dtype: torch.dtype
    window: int | None = None

    @classmethod
    def make(
        cls,
        seq_len: int,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        phase: str = "prefill",
        cached: int | None = None,
        window: int | None = None,
    ) -> Call:
        """Check the sizes; ``cached`` defaults to 0 for prefill and ``seq_len - 1`` for decode (the step
        that brings the context to seq_len tokens).

        Raises:
            ValueError: ``seq_len`` or ``batch`` < 1, an unknown phase, ``cached < 0``, a dtype that is
                not a ``torch.dtype``.
        """
        check_int("seq_len", seq_len, 1, fix="pass the number of tokens in the sequence, e.g. 1024")
        check_int("batch", batch, 1, fix="pass the number of sequences, e.g. 1")
        if phase not in ("prefill", "decode"):
            raise ValueError(
                f"phase must be 'prefill' or 'decode', got {phase!r}; prefill processes the prompt, "
                "decode one new token per sequence"
            )
        if cached is None:
            cached = seq_len - 1 if phase == "decode" else 0
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise ValueError(f"cached must be >= 0 tokens, got {cached!r}; pass 0 for an empty KV cache")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}; e.g. torch.float32")
        return cls(batch, seq_len, phase, cached, dtype, window)

    @property
    def Nq(self) -> int:
        return 1 if self.phase == "decode" else self.seq_len

    @property
    def tokens(self) -> int:
        """Tokens seen after the call: cached + Nq."""
        return self.cached + self.Nq

    @property
    def Nk(self) -> int:
        if self.phase == "decode" and self.window is not None:
            return min(self.tokens, self.window)
        return self.tokens

    @property
    def rows(self) -> int:
        """Token rows every position-wise op (projections, FFN, norms) processes: B * Nq."""
        return self.batch * self.Nq

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


# -- the row builder ----------------------------------------------------------------------------------
Shape = tuple[int, ...]


def _dims(shape: Shape) -> str:
    return "x".join(str(s) for s in shape)


def step(
    call: Call, name: str, eq: str, ins: list[tuple[str, Shape]], out: Shape, flops: int, matmul: bool = False
) -> Op:
    """One unfused op: reads every tensor of ``ins`` once and writes ``out`` once, at the call's dtype."""
    elems = sum(math.prod(s) for _, s in ins) + math.prod(out)
    parts = [f"{label}[{_dims(s)}]" for label, s in ins]
    text = " @ ".join(parts[:2]) + "".join(f" + {p}" for p in parts[2:]) if matmul else ", ".join(parts)
    return Op(name, eq, text, _dims(out), flops, elems * call.itemsize, matmul)


def linear(call: Call, name: str, eq: str, x: str, w: str, d_in: int, d_out: int, bias: bool) -> Op:
    """``x (B, Nq, d_in) @ W (d_in, d_out) + b``: ``2 * B*Nq * d_in * d_out`` FLOPs (bias in the epilogue)."""
    ins = [(x, (call.batch, call.Nq, d_in)), (w, (d_in, d_out))] + ([("b", (d_out,))] if bias else [])
    return step(call, name, eq, ins, (call.batch, call.Nq, d_out), 2 * call.rows * d_in * d_out, True)


def norm(call: Call, kind: str, name: str, eq: str, x: str, d: int) -> Op:
    """A LayerNorm / RMSNorm over the rows of x (B, Nq, d); reads its d (or 2d) weights too."""
    shape = (call.batch, call.Nq, d)
    ins = [(x, shape), ("gamma,beta" if kind == "layernorm" else "gamma", (norm_params(kind, d),))]
    return step(call, name, eq, ins, shape, NORM_FLOPS[kind] * math.prod(shape))


def add(call: Call, name: str, eq: str, a: str, b: str, d: int) -> Op:
    """A residual add of two (B, Nq, d) tensors."""
    shape = (call.batch, call.Nq, d)
    return step(call, name, eq, [(a, shape), (b, shape)], shape, RESIDUAL_FLOPS * math.prod(shape))


def total(ops: list[Op], name: str = "total") -> Op:
    """Sum ops (each times its ``count``) into one row (no shapes; ``is_matmul`` if every op is one)."""
    flops = sum(o.flops * o.count for o in ops)
    nbytes = sum(o.bytes * o.count for o in ops)
    return Op(name, "", "", "", flops, nbytes, bool(ops) and all(o.is_matmul for o in ops), 1, "")
