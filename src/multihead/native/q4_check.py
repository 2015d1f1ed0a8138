"""The GGUF-block kernels' part of the native library's self-check (:func:`.checks.check_library`):
``gemv_q4.c``'s and ``gemv_qk.c``'s products on Q4_0, Q4_1, Q8_0, Q4_K and Q6_K blocks against their
float64 reference on the same rounded activations (:func:`.gguf_blocks.reference_product`), at widths
that end on a whole and on a half pair of blocks (one, two and six super-blocks), one row and several
(each row with the bits of its one-row call), and the rows read back to fp32 against
:func:`.gguf_blocks.dequantize`."""

from __future__ import annotations

import ctypes

import torch

from . import gguf_blocks

__all__ = ["TOLERANCE", "check_gguf", "declare"]

#: the largest error of a product against its float64 reference, over ``|W| |x| + |bias|``
TOLERANCE = 1e-6

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def declare(lib: ctypes.CDLL) -> None:
    """The C signatures of ``gemv_q4.c``'s and ``gguf_dequant.c``'s functions."""
    lib.mh_gguf_isa.restype = ctypes.c_int
    lib.mh_gguf_block_bytes.argtypes, lib.mh_gguf_block_bytes.restype = [ctypes.c_int], _I64
    lib.mh_gguf_block_weights.argtypes, lib.mh_gguf_block_weights.restype = [ctypes.c_int], _I64
    lib.mh_gguf_row_bytes.argtypes, lib.mh_gguf_row_bytes.restype = [ctypes.c_int, _I64], _I64  # type, cols
    # type, w, ldw, x, b, y, n, rows, cols
    lib.mh_gemm_gguf.argtypes = [ctypes.c_int, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64]
    lib.mh_gemm_gguf.restype = ctypes.c_int  # 0, -1: no scratch memory, -2: a type or width without a kernel
    lib.mh_dequantize_row_gguf.argtypes = [ctypes.c_int, _PTR, _I64, _PTR]  # type, row, cols, out
    lib.mh_dequantize_row_gguf.restype = ctypes.c_int


def rounded(lib: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp32 (N, I) -> the kernels' rounding of each row: int8 (N, I64) and fp32 scales (N, I64 / 32)."""
    n, cols = x.shape
    pad = (cols + 63) // 64 * 64
    xq, xs = torch.empty(n, pad, dtype=torch.int8), torch.empty(n, pad // 32)  # (N, I64), (N, I64 / 32)
    for i in range(n):
        lib.mh_quantize_q8(x[i].data_ptr(), 0, cols, xq[i].data_ptr(), xs[i].data_ptr())
    return xq, xs


def check_gguf(lib: ctypes.CDLL, g: torch.Generator) -> str | None:
    """The GGUF-block products against float64 and themselves, and the rows read back; a reason or None.
    ``lib``'s functions declared (:func:`declare`)."""
    for kind, (number, _, _, per) in gguf_blocks.KINDS.items():
        # 1, 3, 8, 33 blocks of 32: odd and even; 1, 2, 6 super-blocks of 256
        shapes = ((3, 32), (5, 96), (17, 256), (2, 1056)) if per == 32 else ((3, 256), (5, 512), (2, 1536))
        for rows, cols in shapes:
            w = torch.randn(rows, cols, generator=g) * 0.1  # (O, I)
            blocks = gguf_blocks.quantize(w, kind)  # (O, R)
            x = torch.randn(5, cols, generator=g)  # (5, I)
            b = torch.randn(rows, generator=g)  # (O,)
            y = torch.empty(5, rows)  # (5, O)
            ptrs = (blocks.data_ptr(), blocks.stride(0), x.data_ptr(), b.data_ptr(), y.data_ptr())
            if lib.mh_gemm_gguf(number, *ptrs, 5, rows, cols) != 0:
                return f"the built {kind} product failed ({rows}x{cols})"
            ref, size = gguf_blocks.reference_product(blocks, kind, *rounded(lib, x))  # (5, O), (5, O)
            err = float(((y.double() - b.double() - ref).abs() / (size + b.double().abs())).max())
            if not err <= TOLERANCE:
                return f"the built {kind} product disagrees with float64 ({rows}x{cols}: error {err:.2e})"
            one = torch.empty(rows)  # (O,)
            lib.mh_gemm_gguf(number, *ptrs[:2], x[3].data_ptr(), ptrs[3], one.data_ptr(), 1, rows, cols)
            if not torch.equal(one, y[3]):
                return f"the built {kind} product's rows at once disagree with its one row ({rows}x{cols})"
            back = torch.empty(cols)  # (I,)
            lib.mh_dequantize_row_gguf(number, blocks[rows - 1].data_ptr(), cols, back.data_ptr())
            if not torch.equal(back, gguf_blocks.dequantize(blocks[rows - 1 :], kind)[0]):
                return f"the built {kind} rows read back disagree with torch's ({cols} columns)"
    return None
