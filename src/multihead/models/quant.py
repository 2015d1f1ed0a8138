"""Quantization (docs/equations.md, section 7): int8 weights per output channel, int8 keys and values;
bf16 and fp32 weights with faster batch-1 kernels (native, or prepacked for oneDNN).

``quantize(model, weights="int8", kv="int8")`` returns a copy of a model where

- every ``nn.Linear`` is an :class:`Int8Linear`: ``W ~ scale[o] * W8[o, :]`` with ``W8`` int8 and one fp32
  scale per output channel (``absmax / 127``: linear, symmetric quantization), and every ``nn.Embedding``
  an :class:`Int8Embedding` (one scale per row; a tied output head shares the embedding's int8 storage);
- every attention quantizes its keys and values to int8 per token (:class:`KVInt8`, the int8 format of
  the core's KV cache) while scores, softmax and weights stay in fp16/fp32: mixed precision.
  A :class:`~multihead.TransformerLM` also generates with the ``"int8"`` KV cache by default.

Kernels (the first three library ones):

- ``"fbgemm"``: torch's dynamic quantized linear (``torch.ops.quantized.linear_dynamic``; fbgemm / x86
  engine): activations quantized to int8 per tensor on the fly, int8 x int8 -> int32 products. The fast
  path for fp32 activations on x86 CPUs (about 3-4x fp32 on the 155M model, BENCHMARKS.md), at the price
  of rounding the activations too: about twice the logit error of weight-only int8. The weights are
  packed once, at the first call. bf16/fp16 activations are widened to fp32 for the call (a vector per
  decode step) and the result rounded back.
- ``"int8pack"``: ``torch._weight_int8pack_mm``, weight-only int8 (gpt-fast's CPU kernel): activations
  stay bf16/fp16/fp32; slower than fbgemm on CPU: measured on an AVX-512 CPU with AVX512-BF16 (torch's
  AVX512 kernels), one thread, the batch-1 decode GEMVs of the 155M model: 1.4-2.4x fbgemm's time with
  bf16 activations (all but the smallest layer), 10-40x with fp32 ones (BENCHMARKS.md, "Decoding by
  dtype").
- ``"dequant"``: ``F.linear`` on the weight dequantized per call: any device and dtype, no speed gain.

- ``"native"``: every linear an :class:`Int8GemvLinear` (``group_size`` 32, 64, ... weights per scale
  along the input, or None for one per output channel): one-row calls run the native int8 GEMV
  (:mod:`multihead.native.int8`: activations rounded to int8 per block of 32 as llama.cpp's q8_0,
  VNNI dot products), and a TransformerLM of the LLaMA shape takes every one-token decode step as one
  native call per layer, the int8 KV cache included (:mod:`.native_step`). Calls of several rows (a
  prefill, a batch's step) run the native multi-row product, each row as the one-row GEMV gives it
  (:func:`multihead.native.int8.gemm_q8`); training calls are ``F.linear`` on the dequantized weight.
  On the 155M LLaMA shape, one thread, about 2.4x the fbgemm kernel's decode rate (BENCHMARKS.md,
  "Decoding by dtype") and prompts level with llama.cpp's q8_0 ("int8 prompts and batches").

``"auto"`` takes native for a TransformerLM where the native kernels build (and whenever ``group_size`` is
given); else fbgemm for fp32, bf16 and fp16 activations on a CPU with that engine (speed first: the
activations are rounded too; ``kernel="int8pack"`` keeps bf16 weight-only), int8pack for bf16/fp16
elsewhere, else dequant.
Quantized models are for inference: the int8 weights are buffers and take no gradient.

``quantize(model, weights="bf16" | "fp16" | "fp32", kv=None)`` returns an inference copy in that dtype
whose linears run a faster kernel, chosen by ``kernel``:

- ``"native"`` (what ``"auto"`` picks for a TransformerLM where :mod:`multihead.native` builds, and for
  fp16): every ``nn.Linear`` becomes a :class:`GemvLinear` holding the same tensors (a tied head stays
  tied), whose calls of one to four rows run the native GEMV; and a :class:`~multihead.TransformerLM` of
  the LLaMA shape takes each one-token decode step as one native call for all its layers (:mod:`.native_step`;
  ``why_not_native_steps`` says when it cannot). The 155M LLaMA shape then decodes at 81-90% of the
  memory's bandwidth limit in fp32 and bf16 (fp16: about 70%), about 2x transformers in fp32 and fp16
  and 3x in bf16 (BENCHMARKS.md, "Native decoding"). Greedy tokens equal the eager model's.
- ``"onednn"`` (what ``"auto"`` picks for other models, such as encoders): the oneDNN-prepacked layers
  below, faster than ``F.linear`` for many rows too (the encoding choice; fp32 and bf16 only).

With ``kernel="onednn"``, ``weights="bf16"`` gives a bf16 copy (``model.to(torch.bfloat16)``, the
embedding included) whose every ``nn.Linear`` (the output head too) is a :class:`Bf16Linear`: the
same bf16 weight, reordered once by oneDNN for batch-1 products (``torch.ops.mkldnn._reorder_linear_weight``)
and multiplied by ``torch.ops.mkldnn._linear_pointwise``. The results are those of ``F.linear`` on the
bf16 weight (bit-identical in our tests); a decode step's matrix-vector products take 1.7-2.2x less time
than torch's own bf16 GEMV on an AVX512-BF16 CPU, and the 155M LLaMA shape decodes 1.4-1.7x faster than
transformers in bf16 (BENCHMARKS.md, "Decoding by dtype"). A TransformerLM copy generates with a bf16
"dense" KV cache. A head tied to the embedding gets its own packed copy (the embedding stays plain).
Where oneDNN or its bf16 support is missing (or the weight is not a CPU bf16 one) a Bf16Linear runs
plain ``F.linear`` and says why in ``why_not_packed``.
``quantize(model, weights="fp32", kv=None, kernel="onednn")`` does the same in fp32 (every linear a
:class:`PackedLinear`): no number changes but the order of the sums (results within about 1e-6 relative of
``F.linear``); on an AVX-512 CPU, one thread, oneDNN's packed fp32 product reads a weight that no cache
holds about 1.4x faster than ``F.linear`` (MKL), and the 155M LLaMA shape decodes faster in proportion
(BENCHMARKS.md, "Decoding by dtype").
The packed copy is for inference: its parameters take no gradient, and a Bf16Linear refuses an input
that requires one (oneDNN's op has no backward). It holds only the packed weight (no second copy):
``state_dict()`` gives the plain bf16 ``weight`` (and ``bias``), ``load_state_dict`` repacks, and
``copy.deepcopy`` / pickling go through the plain weight.

Shape legend: I input features, O output features, V vocabulary, d embedding width, ... leading dims.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import native
from ..approx.apply import apply
from ..approx.base import Approximation
from ..backends import registry
from ..backends.auto import first_fit
from ..core.numerics import acc_dtype
from ..core.problem import AttentionOutput, Problem
from ..native import hugepages
from ..native.layout import from_blocked
from ..nn.kv_cache import KVCache, dequantize_int8, int8_rounded, quantize_int8
from . import native_step
from .gemv_linear import GemvLinear
from .gguf_linear import GGUFLinear, dequantize_blocks_, quantize_blocks_
from .int8_gemv_linear import BlockedRows, Int8GemvLinear, check_group_size, dequantize_groups
from .lm import TransformerLM
from .packed_linear import (
    PACKED_DTYPES,
    Bf16Linear,
    PackedLinear,
    bf16_prepack_unavailable,
    prepack_unavailable,
)

__all__ = [
    "FLOAT_KERNELS",
    "KERNELS",
    "PACKED_DTYPES",
    "Bf16Linear",
    "GemvLinear",
    "Int8Embedding",
    "Int8GemvLinear",
    "Int8Linear",
    "KVInt8",
    "PackedLinear",
    "as_quantized_lm",
    "bf16_prepack_unavailable",
    "model_bytes",
    "prepack_unavailable",
    "quantize",
]

KERNELS = ("auto", "fbgemm", "int8pack", "dequant", "native")  # of weights="int8"; Int8Linear: the first 4
#: GGUF's block formats ``quantize`` rounds to (:mod:`.gguf_linear`; the token table and a tied head in Q8_0)
BLOCK_WEIGHTS = ("q4_0", "q4_1")


class _Unasked:
    """The mark of a _QuantizedLM whose structure was not yet checked for native steps: one instance,
    which copies and pickles as itself (a plain ``object()`` copied by ``copy.deepcopy`` or a pickle is
    another object, and a copy made before its first step never ran natively)."""

    def __reduce__(self) -> str:
        return "_UNASKED"  # this module's instance, by name


_UNASKED = _Unasked()
#: kernels of the fp32 / bf16 weights: "auto" (native where it builds, else onednn), "native"
#: (:class:`GemvLinear`, F.linear where the kernel is missing), "onednn" (:class:`PackedLinear`)
FLOAT_KERNELS = ("auto", "native", "onednn")
_FLOAT_WEIGHTS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _has_vnni() -> bool:
    """x86 VNNI (AVX512-VNNI / AVX-VNNI) adds int8 products in int32 without fbgemm's int16 saturation."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


#: fbgemm's 7-bit activations (``reduce_range``) avoid int16 overflow on CPUs without VNNI; with VNNI the
#: full 8 bits are safe and cut the activation rounding error in half
REDUCE_RANGE = not _has_vnni()


def _per_channel(w: Tensor) -> tuple[Tensor, Tensor]:
    """w (O, I) -> int8 (O, I) and fp32 scale (O,), ``scale = absmax(row) / 127`` (kv_cache's format)."""
    q, scale = quantize_int8(w, torch.float32)  # (O, I), (O, 1)
    return q, scale[:, 0]


_FBGEMM_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


#: torch was built with the fbgemm / x86 quantized engine (asked once: the query costs microseconds)
_FBGEMM = any(e in torch.backends.quantized.supported_engines for e in ("fbgemm", "x86"))


def _fbgemm_ready() -> bool:
    return _FBGEMM


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with W stored as int8 per output channel (fp32 scales); see the module doc.

    Args:
        linear: the float layer to quantize (its weight is rounded once, at construction).
        kernel: "auto" | "fbgemm" | "int8pack" | "dequant".

    Raises:
        ValueError: an unknown kernel; at call time, "fbgemm" with input that is not fp32 / bf16 / fp16 on
            the CPU, or without the engine.
    """

    weight_int8: Tensor
    scale: Tensor
    bias: Tensor | None

    def __init__(self, linear: nn.Linear, kernel: str = "auto"):
        super().__init__()
        if kernel not in KERNELS[:4]:
            raise ValueError(
                f"Int8Linear kernel must be one of {list(KERNELS[:4])}, got {kernel!r} (the native int8 "
                "kernel is Int8GemvLinear's)"
            )
        self.in_features, self.out_features, self.kernel = linear.in_features, linear.out_features, kernel
        w8, scale = _per_channel(linear.weight.detach())
        self.register_buffer("weight_int8", w8)  # (O, I) int8
        self.register_buffer("scale", scale)  # (O,) fp32
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self._packed: Any = None  # fbgemm's packed weight, built at the first fbgemm call

    def choose(self, x: Tensor) -> str:
        """The kernel a call with ``x`` runs (resolves "auto")."""
        if self.kernel != "auto":
            return self.kernel
        if _FBGEMM and x.dtype in _FBGEMM_INPUTS and x.device.type == "cpu":
            return "fbgemm"
        return "int8pack" if x.dtype in (torch.bfloat16, torch.float16) else "dequant"

    def forward(self, x: Tensor) -> Tensor:
        kernel = self.choose(x)
        if kernel == "fbgemm":  # any leading dims, no reshape: the decode step's path, kept short
            if x.dtype not in _FBGEMM_INPUTS or x.device.type != "cpu" or not _FBGEMM:
                raise ValueError(
                    f"Int8Linear kernel 'fbgemm' needs fp32, bf16 or fp16 CPU input and torch's fbgemm / x86 "
                    f"quantized engine, got {x.dtype} on {x.device}; use kernel='auto'"
                )
            x32 = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()  # (..., I)
            y = torch.ops.quantized.linear_dynamic(x32, self._fbgemm_weight(), REDUCE_RANGE)  # (..., O)
            y = y if x.dtype == torch.float32 else y.to(x.dtype)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, I)
        if kernel == "int8pack":
            y = torch._weight_int8pack_mm(x2.contiguous(), self.weight_int8, self.scale.to(x.dtype))  # (M, O)
        else:
            y = F.linear(x2, self.weight_int8.to(x.dtype) * self.scale.to(x.dtype)[:, None])  # (M, O)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)  # (..., O)

    def _fbgemm_weight(self) -> Any:
        if self._packed is None:
            zero = torch.zeros(self.out_features, dtype=torch.long)
            with (
                warnings.catch_warnings()
            ):  # torch marks its quantized tensors deprecated; the kernel is current
                warnings.simplefilter("ignore")
                qw = torch._make_per_channel_quantized_tensor(self.weight_int8, self.scale.double(), zero, 0)
                self._packed = torch.ops.quantized.linear_prepack(qw, None)
        return self._packed

    def _apply(self, fn, recurse: bool = True):
        self._packed = None  # moved or cast: repack lazily
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel!r}"


class Int8Embedding(BlockedRows):
    """Embedding rows stored as int8 with one fp32 scale per row; lookup dequantizes the rows it reads.

    Built from an ``nn.Embedding``, or from an :class:`Int8Linear` / :class:`Int8GemvLinear` whose
    weight it is tied to (a tied output head: the head's per-output-channel scales are the embedding's
    per-row scales; its group scales, ``group_size`` wide, the scales of groups of each row; a head whose
    rows hold their scales is changed to keep them apart, so that both read one table).
    """

    weight_int8: Tensor
    scale: Tensor

    def __init__(
        self, source: nn.Embedding | Int8Linear | Int8GemvLinear, dtype: torch.dtype = torch.float32
    ):
        super().__init__()
        self.group_size: int | None = None
        if isinstance(source, (Int8Linear, Int8GemvLinear)):
            if isinstance(source, Int8GemvLinear):
                source.set_packed(False)  # one table for both: the head's rows and scales apart
            w8, scale = source.weight_int8, source.scale  # shared storage, not a copy
            self.group_size = getattr(source, "group_size", None)
            self.blocked = getattr(source, "blocked", False)  # the head's layout: rows read back in order
        else:
            w8, scale = _per_channel(source.weight.detach())
        self.register_buffer("weight_int8", w8)  # (V, d) int8
        self.register_buffer("scale", scale)  # (V,) fp32, or (V, groups) for group_size
        self.dtype = dtype

    def native_table(self) -> tuple[Tensor, Tensor, int, bool] | None:
        """``(weight_int8, scale, group, blocked)`` where the native kernels can read this table's rows as
        :meth:`forward` gives them (fp32, rows and scales of contiguous columns on the CPU, group >= d: one
        scale a row), else None (another dtype or device, no native kernels)."""
        w, s = self.weight_int8, self.scale
        if (
            native.library() is None
            or self.dtype != torch.float32
            or w.device.type != "cpu"
            or w.stride(1) != 1
        ):
            return None
        if w.dtype != torch.int8 or s.dtype != torch.float32 or (s.dim() == 2 and s.stride(1) != 1):
            return None  # a model cast after quantizing (its scales to bf16, say): the module's lookup
        return w, s, w.shape[1] if self.group_size is None else self.group_size, bool(self.blocked)

    def native_row(self, i: int) -> Tensor | None:
        """Row ``i`` as :meth:`forward` gives it (fp32 (d,), the same values) in one native call, for a
        decode step whose interpreter time counts; None where :meth:`native_table` is None."""
        table, lib = self.native_table(), native.library()
        if table is None or lib is None:
            return None
        w, s, G, blocked = table
        if not 0 <= i < w.shape[0]:
            raise IndexError(f"index {i} is out of range for an embedding of {w.shape[0]} rows")
        out = torch.empty(w.shape[1])  # (d,)
        at, s_at = w.data_ptr() + i * w.stride(0), s.data_ptr() + i * s.stride(0) * 4
        lib.mh_dequantize_row_q8(at, s_at, w.shape[1], G, int(blocked), out.data_ptr())
        return out

    def forward(self, ids: Tensor) -> Tensor:
        rows = F.embedding(ids, self.weight_int8)  # (..., d) int8
        if self.blocked:
            rows = from_blocked(rows)  # (..., d) in column order
        if self.group_size is not None:
            return dequantize_groups(rows, self.scale[ids], self.group_size, self.dtype)  # (..., d)
        return dequantize_int8(rows, self.scale[ids].unsqueeze(-1), self.dtype)  # (..., d)


class KVInt8(Approximation):
    """Exact attention on keys and values rounded to int8 per token (the core's int8 KV-cache format).

    ``k, v -> int8 (per (batch, head, position), scale = absmax / 127) -> dequantized``; the scores,
    softmax and weights are computed by :func:`multihead.attention` in the input precision (fp32
    accumulation for half inputs). Any mask, bias and dropout apply. Keys and values that come straight
    from an ``"int8"`` KV cache (:func:`multihead.nn.kv_cache.int8_rounded`) are already rounded and are
    not rounded again.
    """

    supports_causal = True
    supports_any_mask = True
    supports_dropout = True
    summary = "exact attention on keys and values rounded to int8 per token"

    def run(self, p: Problem) -> AttentionOutput:
        """As :meth:`Approximation.run`; keys and values straight from an int8 cache skip the rounding
        (a decode step then rounds only its new token, in the cache).

        Raises:
            ValueError: the reason :meth:`why_not` gives, when it gives one.
        """
        if not (int8_rounded(p.k) and int8_rounded(p.v)):
            return super().run(p)
        reason = self.why_not(p)
        if reason is not None:
            raise ValueError(reason)
        acc = acc_dtype(p.dtype)  # the working dtype of the rounding path, so both paths agree
        out = self._exact(replace(p, q=p.q.to(acc), k=p.k.to(acc), v=p.v.to(acc)))  # (B, Hq, Nq, Dv)
        return AttentionOutput(out.to(p.dtype), None, None)

    def attend(self, p: Problem) -> Tensor:
        k = dequantize_int8(*quantize_int8(p.k, p.k.dtype), p.k.dtype)  # (B, Hkv, Nk, D)
        v = dequantize_int8(*quantize_int8(p.v, p.v.dtype), p.v.dtype)  # (B, Hkv, Nk, Dv)
        return self._exact(replace(p, k=k, v=v))

    @staticmethod
    def _exact(p: Problem) -> Tensor:
        """Exact attention of ``p`` -> (B, Hq, Nq, Dv), its mask, bias, scale and dropout, on the backend
        ``auto`` picks (``p`` is already a checked call: no second validation on a decode step)."""
        return registry.get(first_fit(p)).run(p).out


class _QuantizedLM(TransformerLM):
    """A quantized TransformerLM: caches of ``cache_kind`` ("int8" when K/V are quantized), in the float
    dtype the model had (its embedding no longer holds a float weight to read it from)."""

    cache_kind: str
    cache_dtype: torch.dtype
    native_steps: bool = False  # one-token decode steps through native_step (kernel="native")
    _why_not_native: Any = None

    def make_cache(self, batch_size: int, max_len: int, kind: str | None = None) -> list[KVCache]:
        kind = self.cache_kind if kind is None else kind
        if kind == "sliding" and self.sliding_window is None:
            raise ValueError("a 'sliding' cache needs a model built with sliding_window=...; use 'dense'")
        window = self.sliding_window if kind == "sliding" else None
        device = next(iter([*self.buffers(), *self.parameters()])).device  # int8 weights are buffers
        return [
            KVCache(
                batch_size,
                self.n_kv_heads,
                self.head_dim,
                max_len,
                kind=kind,
                window=window,
                dtype=self.cache_dtype,
                device=device,
            )
            for _ in self.layers
        ]

    def _native_step_fits(self, ids: Tensor, attention_mask: Tensor | None, cache: list[KVCache]) -> bool:
        """Whether this call of :meth:`hidden_states` is a native decode step (:mod:`.native_step`): a
        model quantized with ``kernel="native"``, the call checked every time (its cache of
        ``cache_kind``), the model's structure once."""
        if not self.native_steps or native_step.why_not_call(
            self, ids, attention_mask, cache, self.cache_kind
        ):
            return False
        if self._why_not_native is _UNASKED:
            self._why_not_native = native_step.why_not_model(
                self, self._kv_approx, hooks=False
            )  # hooks: per call
        return self._why_not_native is None

    @property
    def why_not_native_steps(self) -> str | None:
        """None when one-token decode steps run natively, else why they run the eager layers."""
        if not self.native_steps:
            return "the model was not quantized with kernel='native'"
        return native_step.why_not_model(self, self._kv_approx)

    @property
    def _kv_approx(self) -> type | None:
        """The attention of the model's int8 cache (KVInt8), or None with a dense cache."""
        return KVInt8 if self.cache_kind == "int8" else None

    def generate(self, ids: Tensor, max_new_tokens: int, *, cache: str | None = None, **sampling) -> Tensor:
        """As :meth:`TransformerLM.generate`; ``cache`` defaults to the model's ``cache_kind``."""
        return super().generate(
            ids, max_new_tokens, cache=self.cache_kind if cache is None else cache, **sampling
        )


def _pack(model: nn.Module, dtype: torch.dtype, kernel: str) -> None:
    """Swap every Linear of ``model`` (in place) for a GemvLinear (``kernel="native"``) sharing its
    tensors, or for a PackedLinear of ``dtype`` (a Bf16Linear for bf16; a tied head gets its own packed
    copy)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                if kernel == "native":
                    swap: nn.Module = GemvLinear.from_linear(child)
                elif dtype == torch.bfloat16:
                    swap = Bf16Linear(child)
                else:
                    swap = PackedLinear(child, dtype)
                setattr(parent, name, swap)


def _quantize_weights(model: nn.Module, kernel: str, group_size: int | None) -> None:
    """Swap every Linear / Embedding of ``model`` (in place) for its int8 form (an Int8GemvLinear for
    ``kernel="native"``, its rows packed with their scales where every one of them packs well); tied pairs
    share storage (a tied head's scales apart)."""
    linears: dict[int, Int8Linear | Int8GemvLinear] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                key = id(child.weight)
                if key not in linears:
                    native_kernel = kernel == "native"
                    linears[key] = (
                        Int8GemvLinear(child, group_size) if native_kernel else Int8Linear(child, kernel)
                    )
                setattr(parent, name, linears[key])
    native = [m for m in linears.values() if isinstance(m, Int8GemvLinear)]
    if native and all(m.packs_well for m in native):  # one layout for all: a native layer reads one
        for m in native:
            m.set_packed(True)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Embedding):
                tied = linears.get(id(child.weight))
                setattr(parent, name, Int8Embedding(tied if tied is not None else child, child.weight.dtype))


def quantize(
    model: nn.Module,
    weights: str | None = "int8",
    kv: str | None = "int8",
    *,
    kernel: str = "auto",
    group_size: int | None = None,
) -> nn.Module:
    """A quantized copy of ``model``: int8 (or bf16 / fp32 with a faster batch-1 kernel) weights, int8
    keys and values.

    Args:
        model: any module (TransformerLM, Encoder, pretrained MiniLM, ...); it is not changed.
        weights: "int8" (int8 linear and embedding weights), "q4_0" / "q4_1" (GGUF's 4-bit blocks of 32
            by llama.cpp's rounding, :class:`~.gguf_linear.GGUFLinear` on the native block kernels; the
            token table and a tied head in Q8_0 blocks, as llama.cpp's files keep them; linears whose
            input width is not a multiple of 32 stay float), "bf16" (the whole copy in bf16, parameters
            frozen, every linear on the ``kernel`` below), "fp16" (the same in fp16; native kernel only),
            "fp32" (the same in fp32: the same numbers, a faster kernel) or None (keep float weights).
        kv: "int8" (attention on int8-rounded K/V; int8 KV cache for TransformerLM.generate) or None
            (a "dense" cache in the copy's float dtype: bf16 with ``weights="bf16"``).
        kernel: with ``weights="int8"`` one of :data:`KERNELS`: "native" makes every linear an
            :class:`Int8GemvLinear` (the native int8 GEMV for decode steps, with ``group_size``; a
            TransformerLM of the LLaMA shape takes its decode steps natively, the int8 KV cache
            included), "auto" native for a TransformerLM where the kernels build (or whenever
            ``group_size`` is given), else the Int8Linear kernels (see the module docstring);
            with "bf16" / "fp32" one of :data:`FLOAT_KERNELS`: "native" makes every linear a
            :class:`GemvLinear` (the native batch-1 GEMV for decode steps, ``F.linear`` for the rest:
            the decoding choice), "onednn" a :class:`PackedLinear` (oneDNN's packed weight for every
            call: the encoding choice, faster on many rows), "auto" native for a TransformerLM where
            the kernels build (:func:`multihead.native.unavailable`) and for fp16, else onednn.
        group_size: ``weights="int8"`` with the native kernel: weights per scale along the input (32, 64
            or another multiple of 64), or None for one scale per output channel.

    Raises:
        ValueError: an unknown ``weights``, ``kv`` or ``kernel`` (or one of the other weights' kind); a bad
            ``group_size``, or one with another kernel than native / auto or other weights than int8;
            ``kv="int8"`` on a model without MultiHeadAttention; "q4_0" / "q4_1" with a kernel other
            than auto / native, or with a group_size.
    """
    if weights not in ("int8", *BLOCK_WEIGHTS, "bf16", "fp16", "fp32", None):
        raise ValueError(
            f"quantize weights must be 'int8', 'q4_0', 'q4_1', 'bf16', 'fp16', 'fp32' or None, got "
            f"{weights!r}"
        )
    if kv not in ("int8", None):
        raise ValueError(f"quantize kv must be 'int8' or None, got {kv!r}")
    kernel = _resolve_kernel(model, weights, kernel, group_size)
    float_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    out = apply(model, KVInt8()) if kv == "int8" else copy.deepcopy(model)
    if weights is not None:  # a GGUF file's kept blocks read back to float, then rounded as asked
        dequantize_blocks_(out)
    if weights == "int8":
        _quantize_weights(out, kernel, group_size)
    elif weights in BLOCK_WEIGHTS:
        quantize_blocks_(out, weights)
    elif weights in _FLOAT_WEIGHTS:
        float_dtype = _FLOAT_WEIGHTS[weights]
        out.to(float_dtype).requires_grad_(False)
        _pack(out, float_dtype, kernel)
    if kernel == "native":  # a decode step streams these weights: 2 MiB pages (see native.hugepages)
        gemvs = [m for m in out.modules() if isinstance(m, (GemvLinear, Int8GemvLinear, GGUFLinear))]
        tensors = (t for m in gemvs for t in [*m.parameters(), *m.buffers()])
        hugepages.move_to_huge_pages(tensors, min_bytes=0)  # small ones too: one arena holds them all
    if type(out) is TransformerLM:
        floats = weights in _FLOAT_WEIGHTS and kv is None
        steps = kernel == "native" and (floats or weights == "int8" or weights in BLOCK_WEIGHTS)
        as_quantized_lm(out, "int8" if kv == "int8" else "dense", float_dtype, native_steps=steps)
    return out


def as_quantized_lm(
    model: TransformerLM, cache_kind: str, cache_dtype: torch.dtype, *, native_steps: bool = False
) -> TransformerLM:
    """``model`` (in place) as a quantized TransformerLM: caches of ``cache_kind`` ("dense" or "int8") in
    ``cache_dtype`` (its embedding may hold no float weight to read them from), one-token decode steps
    through :mod:`.native_step` when ``native_steps``. Returns ``model``."""
    model.__class__ = _QuantizedLM
    assert isinstance(model, _QuantizedLM)
    model.cache_kind, model.cache_dtype, model.native_steps = cache_kind, cache_dtype, native_steps
    model._why_not_native = _UNASKED  # the structure is checked at the first step
    return model


def _resolve_kernel(model: nn.Module, weights: str | None, kernel: str, group_size: int | None) -> str:
    """``kernel`` checked against ``weights``, "auto" resolved (a decoder's one-row steps: native)."""
    decodes = isinstance(model, TransformerLM) and native.unavailable() is None
    if weights in BLOCK_WEIGHTS and (kernel not in ("auto", "native") or group_size is not None):
        raise ValueError(
            f"quantize weights={weights!r} (GGUF's blocks of 32) runs the native kernel: pass kernel "
            f"'auto' or 'native' and no group_size, got kernel={kernel!r}, group_size={group_size!r}"
        )
    if weights in BLOCK_WEIGHTS:
        return "native"
    if group_size is not None:
        check_group_size(group_size)
        if weights != "int8" or kernel not in ("auto", "native"):
            raise ValueError(
                f"quantize group_size={group_size} needs weights='int8' with kernel 'native' or 'auto', got "
                f"weights={weights!r}, kernel={kernel!r}; drop group_size for one scale per output channel"
            )
    if weights in _FLOAT_WEIGHTS:
        if kernel not in FLOAT_KERNELS:
            raise ValueError(
                f"quantize kernel for weights={weights!r} must be one of {list(FLOAT_KERNELS)}, got "
                f"{kernel!r} (the int8 kernels {list(KERNELS[1:])} apply to weights='int8')"
            )
        if weights == "fp16" and kernel == "onednn":
            raise ValueError(
                "quantize weights='fp16' has no oneDNN-prepacked kernel; use kernel='native' (or 'auto'), "
                "or weights='bf16' with kernel='onednn'"
            )
        if kernel == "auto":  # decoders take one-row steps: native; encoders run many rows: oneDNN
            return "native" if decodes or weights == "fp16" else "onednn"
        return kernel
    if kernel not in KERNELS:
        raise ValueError(f"quantize kernel must be one of {list(KERNELS)}, got {kernel!r}")
    if weights == "int8" and kernel == "auto" and (decodes or group_size is not None):
        return "native"
    return kernel


def model_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each storage counted once (tied weights share one), and
    of the oneDNN-packed weights of its :class:`PackedLinear` layers."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    packed = sum(m.packed_bytes for m in model.modules() if isinstance(m, PackedLinear))
    return sum(seen.values()) + packed
