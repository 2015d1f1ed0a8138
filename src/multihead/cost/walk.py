"""The walk of one Transformer layer through eq. (1)-(13) of docs/equations.md, one :class:`Op` row per step.

A layer is a :class:`LayerSpec` (its architecture) run by a :class:`Call` (batch, tokens, phase, dtype).
:func:`walk_layer` is the one walk; :func:`layer_walk` is its flat-argument front for a single layer and
:func:`multihead.cost.estimate` runs it for every kind of layer of a whole model.

Post-LN (the original Transformer's layer) reads::

    Q, K, V = X W^Q, X W^K, X W^V  (1)/(3)      T2 = X + T1          (9)
    S = Q K^T, P = softmax(S / sqrt(D)), A = P V   T3 = Norm(T2)        (10)
                                     (2)/(4)    T4 = FFN(T3)         (11)
    T1 = concat(A) W^O             (5)/(8)      T5 = T4 + T3, H = Norm(T5)  (12)/(13)

Pre-LN (GPT-2, LLaMA) normalises before each sub-layer instead: ``Xn = Norm(X)`` feeds the projections,
``T3 = Norm(T2)`` feeds the FFN and ``H = T2 + T4``. SwiGLU replaces ``ReLU(T3 W1) W2`` by
``(SiLU(T3 W1) * (T3 W3)) W2``; rotary adds one elementwise step on Q and K.

Shape legend: B batch, Nq new rows, Nk keys, d = d_model, Hq / Hkv query / kv heads, D head dim, F = d_ff.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.checks import check_int
from .ops import (
    ACTIVATION_FLOPS,
    NORM_FLOPS,
    ROPE_FLOPS,
    SOFTMAX_FLOPS,
    Call,
    Op,
    add,
    linear,
    norm,
    norm_params,
    step,
)

__all__ = ["LayerSpec", "layer_walk", "walk_layer"]

_ACT_NAMES = {"relu": "ReLU", "gelu": "GELU", "gelu_tanh": "GELU", "silu": "SiLU"}
_NORM_NAMES = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}


@dataclass(frozen=True)
class LayerSpec:
    """The architecture of one layer; ``ffn=False`` is a bare attention block (eq. (1)-(5) only)."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    activation: str = "relu"
    norm: str = "layernorm"
    norm_first: bool = False
    bias: bool = True
    rotary: bool = False
    ffn: bool = True

    @classmethod
    def make(
        cls,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        d_ff: int = 0,
        *,
        head_dim: int | None = None,
        activation: str = "relu",
        norm: str = "layernorm",
        norm_first: bool = False,
        bias: bool = True,
        rotary: bool = False,
        ffn: bool = True,
    ) -> LayerSpec:
        """Fill ``n_kv_heads = n_heads`` and ``head_dim = d_model // n_heads``; check every field.

        Raises:
            ValueError: non-positive sizes, ``n_heads`` not divisible by ``n_kv_heads``, ``d_model`` not
                divisible by ``n_heads`` without ``head_dim``, an unknown activation or norm.
        """
        sizes = (("d_model", d_model), ("n_heads", n_heads)) + ((("d_ff", d_ff),) if ffn else ())
        for name, val in sizes:
            check_int(name, val, 1, fix="pass the model's size")
        kv = n_heads if n_kv_heads is None else n_kv_heads
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or n_heads % kv:
            raise ValueError(
                f"n_heads ({n_heads}) must be divisible by n_kv_heads ({kv}); pick a divisor of n_heads "
                "(1 = MQA, n_heads = MHA)"
            )
        if head_dim is None and d_model % n_heads:
            raise ValueError(
                f"d_model ({d_model}) must be divisible by n_heads ({n_heads}), or pass head_dim"
            )
        D = d_model // n_heads if head_dim is None else head_dim
        check_int("head_dim", D, 1, fix="pass head_dim >= 1")
        if activation not in ACTIVATION_FLOPS:
            raise ValueError(f"activation must be one of {list(ACTIVATION_FLOPS)}, got {activation!r}")
        if norm not in NORM_FLOPS:
            raise ValueError(f"norm must be one of {list(NORM_FLOPS)}, got {norm!r}")
        F = d_ff if ffn else 0
        return cls(d_model, n_heads, kv, D, F, activation, norm, bool(norm_first), bool(bias), rotary, ffn)

    @property
    def params(self) -> int:
        """Parameters of the layer: projections (+ biases), FFN matrices (+ biases), norm weights."""
        d, F, qkv = self.d_model, self.d_ff, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        n = d * qkv + self.n_heads * self.head_dim * d + (qkv + d if self.bias else 0)
        if not self.ffn:
            return n
        mats = 3 if self.activation == "swiglu" else 2
        n += mats * d * F + ((mats - 1) * F + d if self.bias else 0)
        return n + 2 * norm_params(self.norm, d)


# -- the walk -----------------------------------------------------------------------------------------
def _attention_ops(s: LayerSpec, c: Call, x: str) -> list[Op]:
    """Eq. (1)-(5): projections, (rotary,) scores, softmax, weighted values, concat, output projection.

    GQA/MQA: K and V are ``Hkv * D`` wide and read once per kv head (never repeated); the scores are
    still computed for all Hq query heads.
    """
    B, Hq, Hkv, D, Nq, Nk, d = c.batch, s.n_heads, s.n_kv_heads, s.head_dim, c.Nq, c.Nk, s.d_model
    S = (B, Hq, Nq, Nk)  # scores and weights
    cache = " cache" if c.phase == "decode" or c.cached else ""
    ops = [
        linear(c, f"Q = {x} W^Q", "(1)/(3)", x, "W^Q", d, Hq * D, s.bias),
        linear(c, f"K = {x} W^K", "(1)/(3)", x, "W^K", d, Hkv * D, s.bias),
        linear(c, f"V = {x} W^V", "(1)/(3)", x, "W^V", d, Hkv * D, s.bias),
    ]
    if s.rotary:
        qk = (B, Hq + Hkv, Nq, D)
        rope = [("Q,K", qk), ("cos,sin", (2, Nq, D))]
        ops.append(step(c, "Q, K = RoPE(Q, K)", "RoPE", rope, qk, ROPE_FLOPS * math.prod(qk)))
    Q, Kt, V = (B, Hq, Nq, D), (B, Hkv, D, Nk), (B, Hkv, Nk, D)
    attend = 2 * math.prod(S) * D  # each of S = Q K^T and A = P V
    return [
        *ops,
        step(c, "S = Q K^T", "(2)", [("Q", Q), (f"K{cache}^T", Kt)], S, attend, True),
        step(c, "P = softmax(mask(S / sqrt(D)))", "(2)", [("S", S)], S, SOFTMAX_FLOPS * math.prod(S)),
        step(c, "A = P V", "(2)/(4)", [("P", S), (f"V{cache}", V)], Q, attend, True),
        step(c, "concat heads", "(5)", [("A", Q)], (B, Nq, Hq * D), 0),
        linear(c, "T1 = concat W^O", "(5)/(8)", "A", "W^O", Hq * D, d, s.bias),
    ]


def _ffn_ops(s: LayerSpec, c: Call, x: str) -> list[Op]:
    """Eq. (11): ``act(x W1 + b1) W2 + b2`` (or SwiGLU's ``(SiLU(x W1) * x W3) W2``) on every row."""
    d, F = s.d_model, s.d_ff
    hidden = (c.batch, c.Nq, F)
    act = ACTIVATION_FLOPS[s.activation] * math.prod(hidden)
    down = linear(c, "T4 = R W2 (FFN down)", "(11)", "R", "W2", F, d, s.bias)
    if s.activation == "swiglu":
        return [
            linear(c, f"G = {x} W1 (FFN gate)", "(11)", x, "W1", d, F, s.bias),
            linear(c, f"U = {x} W3 (FFN up)", "(11)", x, "W3", d, F, s.bias),
            step(c, "R = SiLU(G) * U", "(11)", [("G", hidden), ("U", hidden)], hidden, act),
            down,
        ]
    return [
        linear(c, f"U = {x} W1 (FFN up)", "(11)", x, "W1", d, F, s.bias),
        step(c, f"R = {_ACT_NAMES[s.activation]}(U)", "(11)", [("U", hidden)], hidden, act),
        down,
    ]


def walk_layer(s: LayerSpec, c: Call) -> list[Op]:
    """The :class:`Op` rows of one layer ``s`` run by ``c``, in the order of the equations."""
    if not s.ffn:
        return _attention_ops(s, c, "X")
    d, N = s.d_model, _NORM_NAMES[s.norm]
    if s.norm_first:
        return [
            norm(c, s.norm, f"Xn = {N}(X)", "(10) (pre-LN)", "X", d),
            *_attention_ops(s, c, "Xn"),
            add(c, "T2 = X + T1", "(9)", "X", "T1", d),
            norm(c, s.norm, f"T3 = {N}(T2)", "(13) (pre-LN)", "T2", d),
            *_ffn_ops(s, c, "T3"),
            add(c, "H = T2 + T4", "(12)", "T2", "T4", d),
        ]
    return [
        *_attention_ops(s, c, "X"),
        add(c, "T2 = X + T1", "(9)", "X", "T1", d),
        norm(c, s.norm, f"T3 = {N}(T2)", "(10)", "T2", d),
        *_ffn_ops(s, c, "T3"),
        add(c, "T5 = T4 + T3", "(12)", "T4", "T3", d),
        norm(c, s.norm, f"H = {N}(T5)", "(13)", "T5", d),
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
    activation: str = "relu",
    norm: str = "layernorm",
    norm_first: bool = False,
    rotary: bool = False,
) -> list[Op]:
    """Walk one layer of eq. (1)-(13) and cost every step (see :mod:`multihead.cost` for conventions).

    Defaults are the original Transformer's post-LN layer (d 512, 8 heads of 64, d_ff 2048, ReLU) at
    N = 1024. For a whole model use :func:`multihead.cost.estimate`.

    Args:
        n_kv_heads: kv heads for GQA/MQA (default ``n_heads``: MHA).
        phase: ``"prefill"`` (seq_len new rows) or ``"decode"`` (one new row per sequence).
        cached: tokens already in the KV cache; default 0 for prefill, ``seq_len - 1`` for decode.
        head_dim: default ``d_model // n_heads``.
        bias: whether the linear layers have biases (their bytes are counted).
        activation: relu | gelu | gelu_tanh | silu | swiglu (three FFN matrices).
        norm, norm_first: layernorm | rmsnorm; post-LN (the original Transformer's) or pre-LN.
        rotary: add the rotary step on Q and K.

    Returns:
        The :class:`Op` rows in the order of the equations; sum them with :func:`total`.

    Raises:
        ValueError: see :meth:`LayerSpec.make` and :meth:`Call.make`.
    """
    spec = LayerSpec.make(
        d_model,
        n_heads,
        n_kv_heads,
        d_ff,
        head_dim=head_dim,
        bias=bias,
        activation=activation,
        norm=norm,
        norm_first=norm_first,
        rotary=rotary,
    )
    return walk_layer(spec, Call.make(seq_len, batch, dtype, phase, cached))
