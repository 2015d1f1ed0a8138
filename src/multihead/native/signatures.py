"""The C side of the native library as ctypes sees it: the argument structs that mirror ``native.h``
(:class:`LayerArgs`, :class:`GreedyArgs`), the storage dtypes' codes, and every exported function's
signature (:func:`open_library`). Without declared signatures ctypes would pass 64-bit pointers as 32-bit
ints; a struct that disagrees with the build's is caught by the self-check, which compares sizes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import q4_check

__all__ = ["DTYPES", "KIND", "GreedyArgs", "LayerArgs", "declare_q8", "open_library"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # fp16 where F16C or _Float16 is there
KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # native.h's MH_F32, MH_BF16, MH_F16

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class LayerArgs(ctypes.Structure):
    """One layer's fixed arguments of a native decode step, as ``native.h``'s ``mh_layer_args``: the
    norms' gains, the five weights (qkv, o, w1, w3, w2) and, for int8 ones, their fp32 group scales (None:
    a weight of the storage dtype), the layer's cache (``k_scale``, ``v_scale`` None: a cache of the
    storage dtype), its strides and shape, and the storage dtype's :data:`KIND`. Addresses only: the
    caller keeps the tensors alive."""

    _fields_ = [
        ("g_attn", _PTR),
        ("g_ffn", _PTR),
        ("w", _PTR * 5),
        ("s", _PTR * 5),
        ("k_cache", _PTR),
        ("v_cache", _PTR),
        ("k_scale", _PTR),
        ("v_scale", _PTR),
        ("group", _I64),  # int8 weights per scale along the input (>= the width: one per row)
        ("k_head_stride", _I64),
        ("v_head_stride", _I64),
        ("s_head_stride", _I64),
        ("d", _I64),
        ("Hq", _I64),
        ("Hkv", _I64),
        ("D", _I64),
        ("F", _I64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),  # of the attention scores
        ("blocked", ctypes.c_int32),  # int8 rows in the blocked layout (multihead.native.layout)
        ("interleaved", ctypes.c_int32),  # rotary pairs (2i, 2i + 1) instead of (i, i + D/2)
        ("kind", ctypes.c_int32),
        ("gg_types", ctypes.c_int32),  # GGUF weights: 4 bits a weight, its ggml type (0: blocked's)
    ]


class GreedyArgs(ctypes.Structure):
    """The head and the embedding of a native greedy run (``decode_greedy.c``'s ``mh_greedy_args``): the
    input embedding's table (its fp32 scales for int8 rows, else None), the output head's weight (its fp32
    group scales for an int8 head, else None) and bias or None, each layer's rotary rows at the run's first
    position, strides in elements, the vocabulary and the int8 layouts. Addresses only: the caller keeps
    the tensors alive."""

    _fields_ = [
        ("table", _PTR),
        ("table_scale", _PTR),
        ("head", _PTR),
        ("head_scale", _PTR),
        ("head_bias", _PTR),
        ("cos", _PTR),  # (n,) addresses
        ("sin", _PTR),
        ("table_row", _I64),
        ("table_scale_row", _I64),
        ("table_group", _I64),
        ("head_group", _I64),
        ("vocab", _I64),
        ("rot_stride", _I64),
        ("table_blocked", ctypes.c_int32),
        ("head_blocked", ctypes.c_int32),
    ]


def open_library(path: Path) -> ctypes.CDLL:
    """Load a built kernel library and declare its functions' C signatures (without them ctypes would
    pass 64-bit pointers as 32-bit ints)."""
    lib = ctypes.CDLL(str(path))
    for fn in (lib.mh_gemv_f32, lib.mh_gemv_bf16, lib.mh_gemv_f16):
        fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64]  # w, x, bias or NULL, y, O, I, row stride
        fn.restype = None
    # kind, w, x, bias or NULL, y, n, O, I, row stride
    lib.mh_gemv_rows.argtypes = [ctypes.c_int, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]
    lib.mh_gemv_rows.restype = ctypes.c_int  # 0, -2: a kind without a kernel in this build
    lib.mh_gemv_has_dpbf16.restype = ctypes.c_int
    lib.mh_gemv_has_f16.restype = ctypes.c_int
    lib.mh_dtypes = DTYPES if lib.mh_gemv_has_f16() else DTYPES[:2]  # type: ignore[attr-defined]  # asked once
    lib.mh_native_threads.restype = ctypes.c_int
    # x, the (n,) LayerArgs, n, position, the (n,) cos and sin row addresses, the final norm's gain and
    # eps, its output, int64 *done
    lib.mh_decode_layers.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, ctypes.c_float, _PTR, _PTR]
    lib.mh_decode_layers.restype = ctypes.c_int  # 0, -1: no scratch memory, -2: weights the build refuses
    # the same, then the number of rows B (x, out: (B, d)) and whether they are one sequence's tokens
    lib.mh_decode_batch.argtypes = [*lib.mh_decode_layers.argtypes, _I64, ctypes.c_int32]
    lib.mh_decode_batch.restype = ctypes.c_int
    lib.mh_layer_args_bytes.restype = _I64
    # the (n,) LayerArgs, n, position, GreedyArgs, the final norm's gain and eps, h, steps, last, eos, the
    # (steps,) int64 ids, int64 *picked, *stepped, *done
    lib.mh_decode_greedy.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, ctypes.c_float, _PTR, _I64, ctypes.c_int32]
    lib.mh_decode_greedy.argtypes += [_I64, _PTR, _PTR, _PTR, _PTR]
    lib.mh_decode_greedy.restype = ctypes.c_int  # 0, -1: no memory, -2: weights the build refuses
    lib.mh_greedy_args_bytes.restype = _I64
    lib.mh_rms_norm.argtypes = [
        _PTR,
        _PTR,
        _PTR,
        _I64,
        ctypes.c_float,
        ctypes.c_int,
    ]  # x, g, out, d, eps, kind
    lib.mh_rms_norm.restype = None
    declare_q8(lib)
    q4_check.declare(lib)
    return lib


def declare_q8(lib: ctypes.CDLL) -> None:
    """The int8 functions of ``gemv_q8.c``."""
    lib.mh_q8_isa.restype = ctypes.c_int
    lib.mh_quantize_q8.argtypes = [_PTR, ctypes.c_int, _I64, _PTR, _PTR]  # x, kind, n, xq, xs
    lib.mh_quantize_q8.restype = None
    # w, ws, xq, xs, b, y, O, I, ldw, G, blocked
    lib.mh_gemv_q8.argtypes = [*[_PTR] * 6, *[_I64] * 4, ctypes.c_int]
    lib.mh_gemv_q8.restype = ctypes.c_int  # 0, -1: no scratch memory, -2: blocked in a build without it
    lib.mh_q8_blocked.restype = ctypes.c_int
    # w, ws, x, b, y, n, rows, cols, ldw, G, blocked
    lib.mh_gemm_q8.argtypes = [*[_PTR] * 5, *[_I64] * 5, ctypes.c_int]
    lib.mh_gemm_q8.restype = ctypes.c_int  # 0, -1: no scratch memory, -2: blocked in a build without it
    # q, s, d, G, blocked, out
    lib.mh_dequantize_row_q8.argtypes = [_PTR, _PTR, _I64, _I64, ctypes.c_int, _PTR]
    lib.mh_dequantize_row_q8.restype = None
    lib.mh_q8_row_bytes.argtypes, lib.mh_q8_row_bytes.restype = [_I64, ctypes.c_int], _I64  # cols, layout
