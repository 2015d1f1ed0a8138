"""Analytic cost of one Transformer layer, walked through seed 000 eq. 9.31-9.43.

Each step of the post-LN layer becomes an :class:`Op` row: its shapes, FLOPs, bytes moved and arithmetic
intensity (FLOPs per byte, seed 001 §2.3). A row whose intensity is below the machine's FLOP/byte ratio is
memory-bound: batch-1 decoding multiplies every weight matrix by a single vector, so the projections do
2 FLOPs per weight element read - about 1 FLOP/byte at 16-bit, 0.5 at fp32 - while batching B requests
shares each weight read and raises that to about B.

Conventions:
    * A matmul (m x k) @ (k x n) costs ``2 m k n`` FLOPs (the convention of
      ``torch.utils.flop_counter``); bias adds ride in the matmul's epilogue and are not counted.
    * The model is *unfused*: every op reads its inputs and writes its output once, at ``dtype``'s size
      (weights included). The attention scores S and weights P are materialised (B, Hq, Nq, Nk) as in
      eq. 9.32 - the traffic a fused kernel (``sdpa``, ``tiled``) saves.
    * GQA/MQA: the K and V projections are ``Hkv * D`` wide and K/V are read once per kv head (never
      repeated); scores are still computed for all ``Hq`` query heads.
    * ``prefill``: Nq = seq_len new rows against Nk = cached + seq_len keys.
      ``decode``: one new row per sequence against Nk = cached + 1 keys read from the KV cache.

Shape legend: B batch, Nq new rows, Nk keys, d = d_model, Hq / Hkv query / kv heads, D head dim, F = d_ff.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

__all__ = [
    "KVVariant",
    "LayerShape",
    "Op",
    "compare_kv_heads",
    "kv_cache_bytes",
    "layer_walk",
    "total",
]

# Elementwise FLOPs per element (rough, documented counts; none of these is a matmul).
SOFTMAX_FLOPS = 7  # scale, mask select, row max, subtract, exp, row sum, divide
LAYERNORM_FLOPS = 7  # mean, centre, square, sum, normalise, scale gamma, add beta
RESIDUAL_FLOPS = 1  # one add
RELU_FLOPS = 1  # one max


@dataclass(frozen=True)
class Op:
    """One step of the walk: ``flops`` and ``bytes`` (reads + writes) for the whole batch."""

    name: str
    eq: str
    in_shape: str
    out_shape: str
    flops: int
    bytes: int
    is_matmul: bool

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte moved (0.0 for a pure copy)."""
        return self.flops / self.bytes if self.bytes else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "intensity": self.intensity}


@dataclass(frozen=True)
class LayerShape:
    """The sizes of one layer and one call of it (built and validated by :meth:`make`)."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    seq_len: int
    batch: int
    dtype: torch.dtype
    phase: str
    cached: int
    bias: bool

    @property
    def Nq(self) -> int:
        return 1 if self.phase == "decode" else self.seq_len

    @property
    def Nk(self) -> int:
        return self.cached + self.Nq

    @property
    def rows(self) -> int:
        """Token rows every position-wise op (projections, FFN, norms) processes: B * Nq."""
        return self.batch * self.Nq

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def make(
        cls,
        d_model: int = 512,
        n_heads: int = 8,
        n_kv_heads: int | None = None,
        d_ff: int = 2048,
        seq_len: int = 1024,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        phase: str = "prefill",
        cached: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
    ) -> LayerShape:
        """Fill defaults (``n_kv_heads = n_heads``, ``head_dim = d_model // n_heads``, ``cached``: 0 for
        prefill, ``seq_len - 1`` for decode - the step that brings the context to seq_len).

        Raises:
            ValueError: non-positive sizes, ``n_heads`` not divisible by ``n_kv_heads``, ``d_model`` not
                divisible by ``n_heads`` without ``head_dim``, an unknown phase, ``cached < 0``.
        """
        for name, val in (
            ("d_model", d_model),
            ("n_heads", n_heads),
            ("d_ff", d_ff),
            ("seq_len", seq_len),
            ("batch", batch),
        ):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        kv = n_heads if n_kv_heads is None else n_kv_heads
        if kv < 1 or n_heads % kv:
            raise ValueError(f"n_heads ({n_heads}) must be divisible by n_kv_heads ({kv})")
        if head_dim is None and d_model % n_heads:
            raise ValueError(
                f"d_model ({d_model}) must be divisible by n_heads ({n_heads}), or pass head_dim"
            )
        D = d_model // n_heads if head_dim is None else head_dim
        if D < 1:
            raise ValueError(f"head_dim must be >= 1, got {D}")
        if phase not in ("prefill", "decode"):
            raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
        if cached is None:
            cached = seq_len - 1 if phase == "decode" else 0
        if cached < 0:
            raise ValueError(f"cached must be >= 0 tokens, got {cached}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
        return cls(d_model, n_heads, kv, D, d_ff, seq_len, batch, dtype, phase, cached, bias)


def _dims(*sizes: int) -> str:
    return "x".join(str(s) for s in sizes)


def _linear(s: LayerShape, name: str, eq: str, x: str, d_in: int, d_out: int) -> Op:
    """``x (B*Nq, d_in) @ W (d_in, d_out) + b``: reads x, W, b; writes the output."""
    m = s.rows
    elems = m * d_in + d_in * d_out + (d_out if s.bias else 0) + m * d_out
    return Op(
        name=name,
        eq=eq,
        in_shape=f"{x}[{_dims(s.batch, s.Nq, d_in)}] @ W[{_dims(d_in, d_out)}]",
        out_shape=_dims(s.batch, s.Nq, d_out),
        flops=2 * m * d_in * d_out,
        bytes=elems * s.itemsize,
        is_matmul=True,
    )


def _elementwise(
    s: LayerShape,
    name: str,
    eq: str,
    shape: tuple[int, ...],
    flops_per: int,
    reads: int,
    extra_elems: int = 0,
) -> Op:
    """An op over every element of ``shape``: reads ``reads`` such tensors, writes one."""
    n = math.prod(shape)
    elems = (reads + 1) * n + extra_elems
    return Op(name, eq, _dims(*shape), _dims(*shape), flops_per * n, elems * s.itemsize, False)


def _attention_ops(s: LayerShape) -> list[Op]:
    """Eq. 9.31-9.35: projections, scores, softmax, weighted values, concat, output projection."""
    B, Hq, Hkv, D, Nq, Nk, d = s.batch, s.n_heads, s.n_kv_heads, s.head_dim, s.Nq, s.Nk, s.d_model
    size = s.itemsize
    scores = B * Hq * Nq * Nk
    q_el, k_el, o_el = B * Hq * Nq * D, B * Hkv * Nk * D, B * Hq * Nq * D
    kt = "K cache" if s.phase == "decode" or s.cached else "K"
    vt = "V cache" if s.phase == "decode" or s.cached else "V"
    return [
        _linear(s, "Q = X W^Q", "9.31/9.33", "X", d, Hq * D),
        _linear(s, "K = X W^K", "9.31/9.33", "X", d, Hkv * D),
        _linear(s, "V = X W^V", "9.31/9.33", "X", d, Hkv * D),
        Op(
            name="S = Q K^T",
            eq="9.32",
            in_shape=f"Q[{_dims(B, Hq, Nq, D)}] @ {kt}^T[{_dims(B, Hkv, D, Nk)}]",
            out_shape=_dims(B, Hq, Nq, Nk),
            flops=2 * scores * D,
            bytes=(q_el + k_el + scores) * size,  # K read once per kv head, not per query head
            is_matmul=True,
        ),
        _elementwise(s, "P = softmax(mask(S / sqrt(D)))", "9.32", (B, Hq, Nq, Nk), SOFTMAX_FLOPS, 1),
        Op(
            name="A = P V",
            eq="9.32/9.34",
            in_shape=f"P[{_dims(B, Hq, Nq, Nk)}] @ {vt}[{_dims(B, Hkv, Nk, D)}]",
            out_shape=_dims(B, Hq, Nq, D),
            flops=2 * scores * D,
            bytes=(scores + k_el + o_el) * size,
            is_matmul=True,
        ),
        Op("concat heads", "9.35", _dims(B, Hq, Nq, D), _dims(B, Nq, Hq * D), 0, 2 * o_el * size, False),
        _linear(s, "T1 = concat W^O", "9.35/9.38", "A", Hq * D, d),
    ]


def _add_norm(s: LayerShape, add: tuple[str, str], norm: tuple[str, str]) -> list[Op]:
    """A residual add (``add`` = (name, eq)) followed by a LayerNorm (``norm`` = (name, eq))."""
    shape = (s.batch, s.Nq, s.d_model)
    return [
        _elementwise(s, add[0], add[1], shape, RESIDUAL_FLOPS, 2),
        _elementwise(s, norm[0], norm[1], shape, LAYERNORM_FLOPS, 1, extra_elems=2 * s.d_model),
    ]


def _ffn_ops(s: LayerShape) -> list[Op]:
    """Eq. 9.41: FFN(x) = ReLU(x W1 + b1) W2 + b2, applied to every row."""
    return [
        _linear(s, "U = T3 W1 (FFN up)", "9.41", "T3", s.d_model, s.d_ff),
        _elementwise(s, "R = ReLU(U)", "9.41", (s.batch, s.Nq, s.d_ff), RELU_FLOPS, 1),
        _linear(s, "T4 = R W2 (FFN down)", "9.41", "R", s.d_ff, s.d_model),
    ]


def layer_walk(
    d_model: int = 512,
    n_heads: int = 8,
    n_kv_heads: int | None = None,
    d_ff: int = 2048,
    seq_len: int = 1024,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    phase: str = "prefill",
    cached: int | None = None,
    *,
    head_dim: int | None = None,
    bias: bool = True,
) -> list[Op]:
    """Walk the post-LN layer of eq. 9.31-9.43 and cost every step (see the module conventions).

    Defaults are the original Transformer's sizes (d 512, 8 heads of 64, d_ff 2048) at N = 1024.

    Args:
        n_kv_heads: kv heads for GQA/MQA (default ``n_heads``: MHA).
        phase: ``"prefill"`` (seq_len new rows) or ``"decode"`` (one new row per sequence).
        cached: tokens already in the KV cache; default 0 for prefill, ``seq_len - 1`` for decode.
        head_dim: default ``d_model // n_heads``.
        bias: whether the linear layers have biases (their bytes are counted).

    Returns:
        The :class:`Op` rows in the order of the equations; sum them with :func:`total`.

    Raises:
        ValueError: see :meth:`LayerShape.make`.
    """
    s = LayerShape.make(
        d_model, n_heads, n_kv_heads, d_ff, seq_len, batch, dtype, phase, cached, head_dim, bias
    )
    return [
        *_attention_ops(s),
        *_add_norm(s, ("T2 = X + T1", "9.39"), ("T3 = LayerNorm(T2)", "9.40")),
        *_ffn_ops(s),
        *_add_norm(s, ("T5 = T4 + T3", "9.42"), ("H = LayerNorm(T5)", "9.43")),
    ]


def total(ops: list[Op], name: str = "total") -> Op:
    """Sum a list of ops into one row (no shapes; ``is_matmul`` only if every op is a matmul)."""
    flops, nbytes = sum(o.flops for o in ops), sum(o.bytes for o in ops)
    return Op(name, "", "", "", flops, nbytes, bool(ops) and all(o.is_matmul for o in ops))


def kv_cache_bytes(
    n_layers: int, batch: int, seq_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of a dense KV cache: ``2 (K and V) * n_layers * batch * seq_len * n_kv_heads * head_dim``
    elements of ``dtype``.

    Raises:
        ValueError: if a size is negative.
    """
    sizes = {
        "n_layers": n_layers,
        "batch": batch,
        "seq_len": seq_len,
        "n_kv_heads": n_kv_heads,
        "head_dim": head_dim,
    }
    for name, val in sizes.items():
        if val < 0:
            raise ValueError(f"{name} must be >= 0, got {val}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * n_layers * batch * seq_len * n_kv_heads * head_dim * itemsize


@dataclass(frozen=True)
class KVVariant:
    """One row of :func:`compare_kv_heads`."""

    name: str
    n_kv_heads: int
    bytes: int
    vs_mha: float  # bytes / bytes of the MHA cache

    @property
    def mib(self) -> float:
        return self.bytes / 2**20


def _variant_name(n_heads: int, kv: int) -> str:
    if kv == n_heads:
        return "MHA"
    return "MQA" if kv == 1 else f"GQA-{kv}"


def compare_kv_heads(
    n_layers: int,
    batch: int,
    seq_len: int,
    n_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    kv_heads: tuple[int, ...] | None = None,
) -> list[KVVariant]:
    """KV-cache size of MHA vs GQA vs MQA for one model shape.

    ``kv_heads`` defaults to ``(n_heads, n_heads // 4, 1)`` (MHA, a GQA with groups of 4, MQA), with
    duplicates removed.

    Raises:
        ValueError: if some entry of ``kv_heads`` does not divide ``n_heads``.
    """
    if kv_heads is None:
        kv_heads = tuple(dict.fromkeys((n_heads, max(n_heads // 4, 1), 1)))
    for kv in kv_heads:
        if kv < 1 or n_heads % kv:
            raise ValueError(f"n_heads ({n_heads}) must be divisible by n_kv_heads ({kv})")
    mha = kv_cache_bytes(n_layers, batch, seq_len, n_heads, head_dim, dtype)
    rows = []
    for kv in kv_heads:
        nbytes = kv_cache_bytes(n_layers, batch, seq_len, kv, head_dim, dtype)
        rows.append(KVVariant(_variant_name(n_heads, kv), kv, nbytes, nbytes / mha if mha else 0.0))
    return rows
