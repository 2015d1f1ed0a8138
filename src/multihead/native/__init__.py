"""Native kernels for batch-1 decoding, compiled at first use: matrix-vector products (GEMV) and a
whole LLaMA-style layer step (``decode_layer.c``, used by :mod:`multihead.models.native_step`).

A decode step multiplies every weight matrix of the model by one vector: a single pass over the
weights, so its speed is the memory's read bandwidth, and torch's general CPU kernels read below it for
this shape on some CPUs (docs/cpu-decode.md; the current figures are in BENCHMARKS.md, "Decoding on the
CPU"). :func:`gemv` runs a small C kernel (``gemv.c``) that streams one row at a time with four
independent accumulators; in bf16 it uses the AVX512-BF16 dot-product instruction where the CPU has it.

The package is split by concern: :mod:`.loader` (sources, flags, cache key, build, first load, the
self-check in a separate process), :mod:`.signatures` (the ctypes structs and C signatures),
:mod:`.checks` with :mod:`.q8_check`, :mod:`.q4_check` and :mod:`.step_check` (what every build must
reproduce), and this module, the GEMV API.

The kernel is compiled once per machine by the system C compiler (``$CC``, else ``cc`` / ``gcc`` /
``clang``; ``-O3 -march=native``, what ``torch.compile``'s CPU backend also needs) into a directory
private to the user: ``$MULTIHEAD_CACHE`` (default ``~/.cache/multihead``), else
``<tmp>/multihead-<uid>``, else a fresh temporary directory, each used only when it passes the owner
and mode checks of :mod:`.cache`. The library's sha256 is recorded at build time and checked before
every load; the first load of each build, with its check against ``torch.mv``, runs in a separate
Python process, so a corrupt library ends there (and is rebuilt), never in the user's process
(SECURITY.md, "Native kernels"). Without a compiler, on a failed build or check, or with
``MULTIHEAD_NATIVE=0``, :func:`unavailable` says why and the callers (``mh.quant.GemvLinear``) run
``F.linear``; :func:`notes` says what was skipped or repaired on the way. Large products split their
rows over torch's OpenMP threads (``torch.set_num_threads``) where the compiler has OpenMP, else one
thread (:func:`threads` says how many run).

Shape legend: O rows (output features), I columns (input features).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import cast

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from . import build, cache, checks, loader, signatures
from .loader import FLAGS, OPENMP, SOURCES, cache_dir, library_path
from .signatures import DTYPES, KIND, GreedyArgs, LayerArgs, open_library

__all__ = [
    "DTYPES",
    "FLAGS",
    "KIND",
    "OPENMP",
    "SOURCES",
    "GreedyArgs",
    "LayerArgs",
    "build",
    "cache",
    "cache_dir",
    "checks",
    "dtypes",
    "gemv",
    "has_dpbf16",
    "library",
    "library_path",
    "loader",
    "location",
    "notes",
    "open_library",
    "run",
    "run_rows",
    "signatures",
    "threads",
    "unavailable",
    "watched",
]


def watched() -> bool:
    """Whether a torch dispatch mode is active (a FLOP counter, fake tensors, a debugging mode): it sees
    torch's operators only, so callers run those instead of the native kernels while it is on."""
    return is_in_torch_dispatch_mode()


def unavailable() -> str | None:
    """Why the native kernel cannot run here, or None when it can (builds it on the first call)."""
    return loader.load()[1]


_KERNELS = {
    torch.float32: lambda lib: lib.mh_gemv_f32,
    torch.bfloat16: lambda lib: lib.mh_gemv_bf16,
    torch.float16: lambda lib: lib.mh_gemv_f16,
}


def dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes the kernels run here: fp32 and bf16, and fp16 where the CPU converts it (x86 F16C) or
    the compiler has ``_Float16``; none when the kernels are unavailable."""
    lib = loader.load()[0]
    return () if lib is None else cast(tuple[torch.dtype, ...], lib.mh_dtypes)


def threads() -> int:
    """Threads a large product runs on now (torch's OpenMP thread count; 1 without OpenMP or the
    kernels)."""
    lib = loader.load()[0]
    return int(lib.mh_native_threads()) if lib is not None else 1


def has_dpbf16() -> bool:
    """True when the bf16 kernel uses the AVX512-BF16 dot-product instruction (else it widens to fp32)."""
    lib = loader.load()[0]
    return bool(lib is not None and lib.mh_gemv_has_dpbf16())


def gemv(weight: Tensor, x: Tensor, bias: Tensor | None = None) -> Tensor:
    """``weight @ x + bias``: weight (O, I), x (I,), bias (O,) or None, all of one dtype of
    :func:`dtypes` (fp32, bf16, fp16) on the CPU -> (O,) in it.

    Accumulates in fp32, the bias included (bf16 / fp16: exact products, fp32 sums, one rounding of
    each output, as ``F.linear``). ``weight`` may have any row stride; its columns must be contiguous.

    Raises:
        ValueError: the kernel is unavailable (the reason), other dtypes or devices, shapes that do not
            match, a weight whose columns are not contiguous, an input that requires grad with grad
            enabled (the kernel has no backward).
    """
    lib, reason = loader.load()[:2]
    if lib is None:
        raise ValueError(f"the native GEMV is unavailable: {reason}; use F.linear")
    tensors = [weight, x] if bias is None else [weight, x, bias]
    if weight.dtype not in dtypes() or any(t.dtype != weight.dtype for t in tensors):
        raise ValueError(
            f"gemv needs weight, x (and bias) all of one dtype of {list(dtypes())}, got "
            f"{[t.dtype for t in tensors]}; cast them"
        )
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"gemv runs on the CPU, got tensors on {[str(t.device) for t in tensors]}")
    if weight.dim() != 2 or x.dim() != 1 or x.shape[0] != weight.shape[1]:
        raise ValueError(
            f"gemv needs weight (O, I) and x (I,), got {tuple(weight.shape)} and {tuple(x.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"gemv needs bias (O,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if weight.shape[1] > 1 and weight.stride(1) != 1:
        raise ValueError(
            f"gemv needs the weight's columns contiguous, got strides {weight.stride()}; "
            "pass weight.contiguous()"
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError("gemv has no backward; call it under torch.no_grad() or use F.linear")
    return run(lib, weight, x.contiguous(), None if bias is None else bias.contiguous())


def run(lib: ctypes.CDLL, weight: Tensor, x: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`gemv` without the checks, for callers that made them once: weight (O, I) with contiguous
    columns, x (I,) and bias (O,) contiguous, one dtype of :func:`dtypes`, on the CPU."""
    rows = weight.shape[0]
    y = torch.empty(rows, dtype=weight.dtype)  # (O,)
    fn = _KERNELS[weight.dtype](lib)
    b = None if bias is None else bias.data_ptr()
    fn(weight.data_ptr(), x.data_ptr(), b, y.data_ptr(), rows, weight.shape[1], weight.stride(0))
    return y


def run_rows(lib: ctypes.CDLL, weight: Tensor, x: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`run` for N rows at once (a batch's decode step): x (N, I) contiguous -> (N, O), row n with the
    bits :func:`run` gives ``x[n]``, the weights read from memory once (``mh_gemv_rows``)."""
    rows, n = weight.shape[0], x.shape[0]
    y = torch.empty(n, rows, dtype=weight.dtype)  # (N, O)
    b = None if bias is None else bias.data_ptr()
    args = (weight.data_ptr(), x.data_ptr(), b, y.data_ptr(), n, rows, weight.shape[1], weight.stride(0))
    if lib.mh_gemv_rows(KIND[weight.dtype], *args) != 0:
        raise ValueError(f"this build has no native kernel for {weight.dtype}")  # dtypes() excludes it
    return y


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (:func:`unavailable` says why)."""
    return loader.load()[0]


def location() -> Path | None:
    """The file the kernels were loaded from (in the private build directory), or None."""
    return loader.load().path


def notes() -> tuple[str, ...]:
    """What the build skipped or repaired on the way, in order: a cache directory that could not be
    made or failed its owner and mode checks, a cached library that failed its digest or crashed its
    first load (then rebuilt)."""
    return loader.load().notes
