"""int8 weights for torch's own kernels: :class:`Int8Linear` (one int8 weight per output channel, run by
fbgemm, ``torch._weight_int8pack_mm`` or ``F.linear`` on the dequantized weight) and
:class:`Int8Embedding` (int8 rows with a scale each, or a tied head's int8 table).

``W ~ scale[o] * W8[o, :]``: linear, symmetric rounding with ``scale = absmax(row) / 127``, the format of
the int8 KV cache (docs/equations.md, section 7). Kernels of :class:`Int8Linear`:

- ``"fbgemm"``: torch's dynamic quantized linear (``torch.ops.quantized.linear_dynamic``, the fbgemm / x86
  engine): the activations are rounded to int8 per tensor on each call, then int8 x int8 -> int32
  products; fast for fp32 activations on x86, at the price of rounding the activations too (about twice
  the logit error of weight-only int8). bf16 / fp16 activations are widened to fp32 for the call.
- ``"int8pack"``: ``torch._weight_int8pack_mm``, weight-only int8: the activations keep their dtype.
- ``"dequant"``: ``F.linear`` on the weight dequantized per call: any device and dtype, no speed gain.
- ``"auto"``: fbgemm for fp32 / bf16 / fp16 CPU input where torch has the engine, else int8pack for
  bf16 / fp16, else dequant.

The native int8 kernel (groups along the input, int8 activations per block of 32) is
:class:`~multihead.models.int8_gemv_linear.Int8GemvLinear`'s. Measured speeds: BENCHMARKS.md, "Decoding on
the CPU". Shape legend: I input features, O output features, V vocabulary, d embedding width, ... leading
dims.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import native
from ..native.layout import from_blocked
from ..nn.kv_cache import dequantize_int8, quantize_int8
from .int8_gemv_linear import BlockedRows, Int8GemvLinear, dequantize_groups

__all__ = ["INT8_LINEAR_KERNELS", "REDUCE_RANGE", "Int8Embedding", "Int8Linear", "per_channel"]

#: the kernels of :class:`Int8Linear` (see the module doc)
INT8_LINEAR_KERNELS = ("auto", "fbgemm", "int8pack", "dequant")


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


def per_channel(w: Tensor) -> tuple[Tensor, Tensor]:
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
        if kernel not in INT8_LINEAR_KERNELS:
            raise ValueError(
                f"Int8Linear kernel must be one of {list(INT8_LINEAR_KERNELS)}, got {kernel!r} (the native "
                "int8 kernel is Int8GemvLinear's)"
            )
        self.in_features, self.out_features, self.kernel = linear.in_features, linear.out_features, kernel
        w8, scale = per_channel(linear.weight.detach())
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
            w8, scale = per_channel(source.weight.detach())
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
