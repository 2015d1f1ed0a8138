"""The native products on weights in GGUF's own blocks (``gemv_q4.c``: llama.cpp's Q4_0, Q4_1, Q8_0, as a
.gguf file holds them; :mod:`.gguf_blocks` describes the layouts): ``y = W x + b`` with x rounded to int8
per block of 32 as the int8 path rounds it, one activation row (a decode step) or several (a prompt, a
batch), each row with the bits of its one-row call.

Shape legend: O rows (output features), I columns (input features, a multiple of 32), R bytes of a row's
blocks, N activation rows.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from . import library, unavailable
from .gguf_blocks import KINDS, check_blocks
from .q4_check import rounded

__all__ = ["ISA", "dequantize_row", "gemm_gguf", "isa", "rounded_activations", "run_gguf"]

ISA = ("portable C", "AVX2", "AVX-VNNI", "AVX512-VNNI")  # by gemv_q4.c's MH_GG_ISA


def _checked_library() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise ValueError(f"the native GGUF-block products are unavailable: {unavailable()}; dequantize them")
    return lib


def isa() -> str | None:
    """The instructions the GGUF-block products use here (:data:`ISA`), or None without the kernels."""
    lib = library()
    return None if lib is None else ISA[int(lib.mh_gguf_isa())]


def rounded_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x fp32 (N, I) -> what the products multiply: int8 (N, I64) and fp32 block scales (N, I64 / 32).

    Raises:
        ValueError: the kernels are unavailable, x is not a CPU fp32 (N, I) tensor.
    """
    lib = _checked_library()
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(
            f"rounded_activations needs a CPU fp32 (N, I) tensor, got {x.dtype} {tuple(x.shape)}"
        )
    return rounded(lib, x.contiguous())


def gemm_gguf(blocks: Tensor, kind: str, x: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x W^T + bias`` with W in GGUF blocks of ``kind`` and each row of x rounded to int8 per 32.

    Args:
        blocks: uint8 (O, R), rows of ``kind`` blocks ("q4_0", "q4_1", "q8_0"), contiguous columns.
        kind: the block format.
        x: fp32 (N, I) or (I,).
        bias: fp32 (O,) or None.

    Returns:
        fp32 (N, O), or (O,) for x (I,).

    Raises:
        ValueError: the kernels are unavailable; an unknown kind; dtypes, devices or shapes that do not
            match; an input that requires grad with grad enabled.
        MemoryError: no memory for the rounded rows.
    """
    lib = _checked_library()
    cols = x.shape[-1] if x.dim() in (1, 2) else -1
    if x.dtype != torch.float32 or x.dim() not in (1, 2):
        raise ValueError(f"gemm_gguf needs x fp32 (N, I) or (I,), got {x.dtype} {tuple(x.shape)}")
    check_blocks(blocks, kind, cols)
    tensors = [blocks, x] if bias is None else [blocks, x, bias]
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"gemm_gguf runs on the CPU, got tensors on {[str(t.device) for t in tensors]}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (blocks.shape[0],)):
        raise ValueError(
            f"gemm_gguf needs bias fp32 ({blocks.shape[0]},), got {bias.dtype} {tuple(bias.shape)}"
        )
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError("gemm_gguf has no backward; call it under torch.no_grad()")
    x2 = x.reshape(-1, cols).contiguous()  # (N, I)
    y = run_gguf(lib, blocks.contiguous(), kind, x2, None if bias is None else bias.contiguous())  # (N, O)
    return y[0] if x.dim() == 1 else y


def run_gguf(lib: ctypes.CDLL, blocks: Tensor, kind: str, x: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`gemm_gguf` without the checks, for callers that made them once: blocks uint8 (O, R) with
    contiguous columns, x fp32 (N, I) and bias fp32 (O,) contiguous -> fp32 (N, O)."""
    rows, n, cols = blocks.shape[0], x.shape[0], x.shape[1]
    y = torch.empty(n, rows)  # (N, O)
    b = None if bias is None else bias.data_ptr()
    status = lib.mh_gemm_gguf(
        KINDS[kind][0], blocks.data_ptr(), blocks.stride(0), x.data_ptr(), b, y.data_ptr(), n, rows, cols
    )
    if status == -1:
        raise MemoryError(f"the {kind} product could not allocate scratch for {min(n, 64)} rows of {cols}")
    if status != 0:
        raise ValueError(f"the {kind} product has no kernel for rows of {cols} weights")  # checked before
    return y


def dequantize_row(lib: ctypes.CDLL, blocks: Tensor, kind: str, i: int, cols: int) -> Tensor:
    """Row ``i`` of ``blocks`` (uint8 (O, R) of ``kind``, rows of ``cols``) back to fp32 (I,), the values
    :func:`.gguf_blocks.dequantize` gives, in one native call (an embedding's lookup in a decode step).

    Raises:
        IndexError: ``i`` outside the rows.
    """
    if not 0 <= i < blocks.shape[0]:
        raise IndexError(f"index {i} is out of range for an embedding of {blocks.shape[0]} rows")
    out = torch.empty(cols)  # (I,)
    at = blocks.data_ptr() + i * blocks.stride(0)
    lib.mh_dequantize_row_gguf(KINDS[kind][0], at, cols, out.data_ptr())
    return out
