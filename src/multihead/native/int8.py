"""The native int8 matrix-vector product (``gemv_q8.c``): int8 weights with fp32 scales per group of
inputs or per output row, times an activation vector rounded to int8 in blocks of 32; and the same for
several activation rows at once (:func:`gemm_q8`: a prefill, a batch), each row as the vector product
makes it.

``y[o] = sum_b ws[o, g(b)] * xs[b] * sum_{i in b} W8[o, i] xq[i] (+ bias[o])``: the activation x is
rounded once per product (:func:`quantize_activations`: symmetric, ``xs[b] = absmax / 127`` per block b
of 32 values, ``xq = round(x / xs)``), the block sums are exact int32 (AVX512-VNNI / AVX-VNNI dot
products where the CPU has them, AVX2 or plain C elsewhere) and are scaled and added in fp32. The
weights are one byte each: a decode step reads a quarter of its fp32 bytes.

Shape legend: O rows (output features), I columns (input features), I64 = I rounded up to 64, N rows of
activations.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from . import library, unavailable
from .layout import CHUNK, from_blocked, to_blocked

__all__ = [
    "BLOCK", "BLOCKED", "CHUNK", "COLUMNS", "ISA", "LAYOUTS", "PACKED", "from_blocked", "gemm_q8",
    "gemv_q8", "isa", "quantize_activations", "reads_blocked", "run_gemm_q8", "run_q8", "to_blocked",
]  # fmt: skip

BLOCK = 32  # activation values per int8 scale (native.h's MH_Q8_BLOCK)
COLUMNS, BLOCKED, PACKED = 0, 1, 2  # the weight rows' layouts (native.h's MH_Q8_*; multihead.native.layout)
LAYOUTS = ("column-order", "blocked", "packed")  # their names, by those values
ISA = ("portable C", "AVX2", "AVX-VNNI", "AVX512-VNNI")  # by q8_kernels.h's MH_Q8_ISA


def isa() -> str | None:
    """The instructions the int8 product uses here (:data:`ISA`), or None without the kernels."""
    lib = library()
    return None if lib is None else ISA[int(lib.mh_q8_isa())]


def reads_blocked() -> bool:
    """Whether the built kernels read the blocked weight layout (:func:`to_blocked`; AVX512-VNNI)."""
    lib = library()
    return lib is not None and bool(lib.mh_q8_blocked())


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x fp32 (I,) -> int8 (I64,) and fp32 block scales (I64 / 32,), zeros past I (the kernel's rounding:
    ``scale = absmax / 127`` per block of 32, ``round(x / scale)`` half to even, as ``torch.round``).

    Raises:
        ValueError: the kernels are unavailable, or x is not a CPU fp32 vector.
    """
    lib = _checked_library()
    if x.dim() != 1 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"quantize_activations needs a CPU fp32 vector (I,), got {x.dtype} {tuple(x.shape)}")
    return _quantize(lib, x.contiguous())


def _quantize(lib: ctypes.CDLL, x: Tensor) -> tuple[Tensor, Tensor]:
    pad = (x.shape[0] + 63) // 64 * 64
    xq = torch.empty(pad, dtype=torch.int8)  # (I64,)
    xs = torch.empty(pad // BLOCK)  # (I64 / 32,)
    lib.mh_quantize_q8(x.data_ptr(), 0, x.shape[0], xq.data_ptr(), xs.data_ptr())
    return xq, xs


def _checked_library() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise ValueError(f"the native int8 GEMV is unavailable: {unavailable()}; dequantize and use F.linear")
    return lib


def gemv_q8(
    weight: Tensor,
    scale: Tensor,
    x: Tensor,
    bias: Tensor | None = None,
    group_size: int | None = None,
    blocked: bool = False,
) -> Tensor:
    """``(weight * scale) @ x + bias`` with x rounded to int8 per block of 32 (see the module doc).

    Args:
        weight: int8 (O, I), contiguous.
        scale: fp32 (O,) per output row (``group_size=None``) or (O, ceil(I / group_size)) per group.
        x: fp32 (I,).
        bias: fp32 (O,) or None.
        group_size: inputs per weight scale: 32 or a multiple of 64; None for one scale per row.
        blocked: the weight's rows are in the blocked layout (:func:`to_blocked`; needs
            :func:`reads_blocked`); the scales stay in column order.

    Returns:
        fp32 (O,).

    Raises:
        ValueError: the kernels are unavailable; dtypes, devices or shapes that do not match; a group size
            other than 32 or a multiple of 64; an input that requires grad with grad enabled;
            ``blocked`` where the kernel does not read that layout.
        MemoryError: a row over 10900 wide and no memory for the product's scratch (3 x its width in bytes).
    """
    lib = _checked_library()
    _check("gemv_q8", lib, weight, scale, x, bias, group_size, blocked, "(I,)")
    return run_q8(lib, weight.contiguous(), scale.contiguous(), x.contiguous(), bias, group_size, blocked)


def _check(
    name: str,
    lib: ctypes.CDLL,
    weight: Tensor,
    scale: Tensor,
    x: Tensor,
    bias: Tensor | None,
    group_size: int | None,
    blocked: bool,
    x_shape: str,
) -> None:
    """The checks of :func:`gemv_q8` (x (I,)) and :func:`gemm_q8` (x (N, I)), named after the caller."""
    tensors = [weight, scale, x] if bias is None else [weight, scale, x, bias]
    if weight.dtype != torch.int8 or any(t.dtype != torch.float32 for t in tensors[1:]):
        raise ValueError(
            f"{name} needs an int8 weight and fp32 scale, x and bias, got {[t.dtype for t in tensors]}"
        )
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"{name} runs on the CPU, got tensors on {[str(t.device) for t in tensors]}")
    if group_size is not None and not (group_size == 32 or (group_size > 0 and group_size % 64 == 0)):
        raise ValueError(f"{name} group_size must be 32, a multiple of 64 or None, got {group_size}")
    rows, cols = weight.shape if weight.dim() == 2 else (-1, -1)
    groups = (rows,) if group_size is None else (rows, -(-cols // group_size))
    x_ok = x.shape == (cols,) if x_shape == "(I,)" else (x.dim() == 2 and x.shape[1] == cols)
    if rows < 0 or not x_ok or tuple(scale.shape) != groups:
        raise ValueError(
            f"{name} needs weight (O, I), scale {'(O,)' if group_size is None else '(O, ceil(I / group))'} "
            f"and x {x_shape}, got {tuple(weight.shape)}, "
            f"{tuple(scale.shape)} and {tuple(x.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (rows,):
        raise ValueError(f"{name} needs bias (O,) = ({rows},), got {tuple(bias.shape)}")
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError(f"{name} has no backward; call it under torch.no_grad()")
    if blocked and not lib.mh_q8_blocked():
        raise ValueError(
            f"blocked=True needs the AVX512-VNNI kernel, this one is {isa()}: pass weights in column order"
        )


def gemm_q8(
    weight: Tensor,
    scale: Tensor,
    x: Tensor,
    bias: Tensor | None = None,
    group_size: int | None = None,
    blocked: bool = False,
) -> Tensor:
    """:func:`gemv_q8` for N activation rows at once: ``x (N, I) -> (N, O)``, row n equal bit for bit to
    ``gemv_q8(weight, scale, x[n], ...)`` (each row rounded to int8 per block of 32, the same sums in the
    same order), the weights read once for up to 64 rows (a prefill or a batch of decode steps reads
    them once instead of once a row; four rows share each weight load where the kernel is AVX512-VNNI's).

    Args: as :func:`gemv_q8`, with x fp32 (N, I).

    Returns:
        fp32 (N, O).

    Raises:
        ValueError: as :func:`gemv_q8` (x must be (N, I)).
        MemoryError: no memory for the rounded rows (about 4.2 x I bytes a row, up to 64 rows).
    """
    lib = _checked_library()
    _check("gemm_q8", lib, weight, scale, x, bias, group_size, blocked, "(N, I)")
    w, s, xc = weight.contiguous(), scale.contiguous(), x.contiguous()
    return run_gemm_q8(lib, w, s, xc, bias, group_size, blocked)


def run_q8(
    lib: ctypes.CDLL,
    weight: Tensor,
    scale: Tensor,
    x: Tensor,
    bias: Tensor | None,
    group_size: int | None,
    blocked: int = False,
) -> Tensor:
    """:func:`gemv_q8` without the checks, for callers that made them once: weight int8 (O, I) and scale
    fp32 contiguous, x fp32 (I,) and bias fp32 (O,) contiguous -> fp32 (O,). ``blocked``: the rows' layout,
    :data:`COLUMNS` (False), :data:`BLOCKED` (True) or :data:`PACKED` (weight then the packed rows (O, R)
    of :func:`multihead.native.layout.to_packed`, holding their scales, groups of 32; scale unused)."""
    rows, cols, ldw = weight.shape[0], x.shape[-1], weight.stride(0)
    xq, xs = _quantize(lib, x)
    y = torch.empty(rows)  # (O,)
    group = cols if group_size is None else group_size
    b = None if bias is None else bias.data_ptr()
    status = lib.mh_gemv_q8(
        weight.data_ptr(),
        scale.data_ptr(),
        xq.data_ptr(),
        xs.data_ptr(),
        b,
        y.data_ptr(),
        rows,
        cols,
        ldw,
        group,
        int(blocked),
    )
    if status == -2:
        raise ValueError(
            f"the {LAYOUTS[int(blocked)]} layout needs the AVX512-VNNI kernel, this one is {isa()}"
        )
    if status != 0:
        need = 3 * (-(-cols // 64) * 64) + 64
        raise MemoryError(f"the int8 GEMV could not allocate {need} bytes of scratch")
    return y


def run_gemm_q8(
    lib: ctypes.CDLL,
    weight: Tensor,
    scale: Tensor,
    x: Tensor,
    bias: Tensor | None,
    group_size: int | None,
    blocked: int = False,
) -> Tensor:
    """:func:`gemm_q8` without the checks, for callers that made them once: weight int8 (O, I) and scale
    fp32 contiguous, x fp32 (N, I) and bias fp32 (O,) contiguous -> fp32 (N, O); ``blocked`` as
    :func:`run_q8`."""
    rows, cols, ldw = weight.shape[0], x.shape[-1], weight.stride(0)
    n = x.shape[0]
    y = torch.empty(n, rows)  # (N, O)
    group = cols if group_size is None else group_size
    b = None if bias is None else bias.data_ptr()
    pointers = (weight.data_ptr(), scale.data_ptr(), x.data_ptr(), b, y.data_ptr())
    status = lib.mh_gemm_q8(*pointers, n, rows, cols, ldw, group, int(blocked))
    if status == -2:
        raise ValueError(
            f"the {LAYOUTS[int(blocked)]} layout needs the AVX512-VNNI kernel, this one is {isa()}"
        )
    if status != 0:
        raise MemoryError(f"the int8 product could not allocate scratch for {min(n, 64)} rows of {cols}")
    return y
