"""Native kernels for batch-1 decoding, compiled at first use: matrix-vector products (GEMV) and a
whole LLaMA-style layer step (``decode_layer.c``, used by :mod:`multihead.models.native_step`).

A decode step multiplies every weight matrix of the model by one vector: a single pass over the
weights, so its speed is the memory's read bandwidth. torch's own CPU kernels for that case read well
below it on some CPUs (measured on a 2-core AVX-512 machine, one thread, 40 out-of-cache 2816 x 1024
weights: ``F.linear`` 22 GB/s in fp32 and 16 GB/s in bf16, oneDNN's packed products 28 and 34 GB/s,
against about 40 GB/s for a plain ``sum``; BENCHMARKS.md, "Native decoding"). :func:`gemv` runs a small C
kernel (``gemv.c`` next to this file) that streams one row at a time with four independent accumulators
and reads at the speed of the ``sum``; in bf16 it uses the AVX512-BF16 dot-product instruction where the
CPU has it.

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
import hashlib
import os
import platform
import warnings
from pathlib import Path
from typing import NamedTuple, cast

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from . import build, cache, first_load, q4_check, q8_check, step_check

__all__ = [
    "DTYPES",
    "FLAGS",
    "KIND",
    "GreedyArgs",
    "LayerArgs",
    "cache_dir",
    "dtypes",
    "gemv",
    "has_dpbf16",
    "library",
    "library_path",
    "location",
    "notes",
    "open_library",
    "run",
    "run_rows",
    "threads",
    "unavailable",
    "watched",
]

HERE = Path(__file__).parent
SOURCES = (
    HERE / "gemv.c",
    HERE / "gemv_rows.c",
    HERE / "decode_layer.c",
    HERE / "decode_team.c",
    HERE / "attend.c",
    HERE / "gemv_q8.c",
    HERE / "gemm_q8.c",
    HERE / "decode_greedy.c",
    HERE / "q8_rows.c",
    HERE / "gemv_q4.c",
    HERE / "gguf_dequant.c",
)  # and their headers: native.h and the private ones next to it
HEADER = HERE / "native.h"
HEADERS = tuple(sorted(HERE.glob("*.h")))  # every header next to the sources: all in the cache key
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11", "-Wno-psabi")
#: added when the compiler has it: products split over torch's OpenMP threads (torch's wheel ships the
#: GNU runtime, libgomp.so.1, which the built library then shares instead of loading a second one)
OPENMP = "-fopenmp"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # fp16 where F16C or _Float16 is there
KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # native.h's MH_F32, MH_BF16, MH_F16

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def cache_dir() -> Path:
    """Where built kernels live: ``$MULTIHEAD_CACHE``, else ``$XDG_CACHE_HOME/multihead``, else
    ``~/.cache/multihead``."""
    if os.environ.get("MULTIHEAD_CACHE"):
        return Path(os.environ["MULTIHEAD_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "multihead"


def _cpu_key() -> str:
    """The CPU's identity for the cache key: a kernel built with -march=native runs only where it was
    built (a home directory shared between machines must not hand one CPU's build to another)."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            text += "".join(line for line in f if line.startswith(("flags", "model name", "Features")))
    except OSError:
        text += platform.processor()
    return text


def library_path(cc: str, directory: Path | None = None) -> Path:
    """The shared library built from :data:`SOURCES` by the compiler command ``cc`` for this CPU, in
    ``directory`` (default :func:`cache_dir`); it may not exist yet."""
    code = [p.read_bytes() for p in (*SOURCES, *HEADERS)]
    key = hashlib.sha256(
        b"\0".join([*code, cc.encode(), " ".join((*FLAGS, OPENMP)).encode(), _cpu_key().encode()])
    ).hexdigest()[:16]
    return (cache_dir() if directory is None else directory) / f"native-{key}.so"


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
        ("unused", ctypes.c_int32),
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
    _declare_q8(lib)
    q4_check.declare(lib)
    return lib


def _declare_q8(lib: ctypes.CDLL) -> None:
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


def _self_check(lib: ctypes.CDLL) -> str | None:
    """Run the kernels on odd shapes (every tail of the loops) and compare with torch, then the decode
    layers' step (:func:`_self_check_steps`: on a team of threads where this process has two or more);
    a reason or None."""
    for name, mirror in (("layer", LayerArgs), ("greedy", GreedyArgs)):  # a mismatch: wrong addresses
        built = getattr(lib, f"mh_{name}_args_bytes")()
        if built != ctypes.sizeof(mirror):
            return (
                f"the built library's {name} arguments take {built} bytes, multihead.native."
                f"{mirror.__name__} {ctypes.sizeof(mirror)}: the sources and this module disagree"
            )
    g = torch.Generator().manual_seed(0)
    kernels = [(torch.float32, lib.mh_gemv_f32), (torch.bfloat16, lib.mh_gemv_bf16)]
    if lib.mh_gemv_has_f16():
        kernels.append((torch.float16, lib.mh_gemv_f16))
    for dtype, fn in kernels:
        for rows, cols in ((5, 7), (3, 200), (2, 1024)):
            w = torch.randn(rows, cols + 3, generator=g).to(dtype)[:, :cols]  # (O, I), row stride I + 3
            x = torch.randn(cols, generator=g).to(dtype)  # (I,)
            b = torch.randn(rows, generator=g).to(dtype)  # (O,)
            y = torch.empty(rows, dtype=dtype)  # (O,)
            fn(w.data_ptr(), x.data_ptr(), b.data_ptr(), y.data_ptr(), rows, cols, w.stride(0))
            ref = w.double() @ x.double() + b.double()  # (O,)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            err = float(((y.double() - ref).abs() / (ref.abs() + 1)).max())
            if not err <= tol:
                return f"the built kernel disagrees with torch ({dtype}, {rows}x{cols}: error {err:.2e})"
            xs = torch.cat([x[None], torch.randn(2, cols, generator=g).to(dtype)])  # (3, I)
            ys = torch.empty(3, rows, dtype=dtype)  # (3, O)
            pointers = (w.data_ptr(), xs.data_ptr(), b.data_ptr(), ys.data_ptr())
            lib.mh_gemv_rows(KIND[dtype], *pointers, 3, rows, cols, w.stride(0))
            if not torch.equal(ys[0], y):
                return f"the built kernel's rows at once disagree with its one row ({dtype}, {rows}x{cols})"
    return q8_check.check_q8(lib, g) or q4_check.check_gguf(lib, g) or _self_check_steps(lib)


def _self_check_steps(lib: ctypes.CDLL) -> str | None:
    """The decode layers' step on a team of threads against their one-row loop, and the fp32 step against
    float64 torch (:mod:`.step_check`), in every storage dtype and int8 row layout the build has."""
    layouts = (0, 1, 2) if lib.mh_q8_blocked() else (0,)
    return step_check.check_steps(lib, LayerArgs, KIND, bool(lib.mh_gemv_has_f16()), layouts)


def _probe(library: str, digest: str) -> int:
    """The separate process's side of a build's first load (:func:`.first_load.check_apart`): load
    ``library`` if its bytes still have ``digest``, run :func:`_self_check` with two threads or more;
    0 when it passed, else prints why and returns 1."""
    path = Path(library)
    try:
        if cache.file_digest(path) != digest:
            print("its bytes changed while it was checked")
            return 1
    except OSError as e:
        print(f"it cannot be read: {e}")
        return 1
    # at least two threads (this process is the check's own), so that the decode layers' team step runs
    torch.set_num_threads(max(2, torch.get_num_threads()))
    reason = _self_check(open_library(path))
    if reason is not None:
        print(reason)
        return 1
    return 0


class _Loaded(NamedTuple):
    lib: ctypes.CDLL | None
    reason: str | None  # why lib is None
    path: Path | None  # the file lib was loaded from
    notes: tuple[str, ...]  # what was skipped or repaired on the way


def _open_entry(compiler: list[str], so: Path, notes: list[str]) -> tuple[ctypes.CDLL | None, str | None]:
    """Load the build at ``so``: verified against its digest, rebuilt when it fails (once), its first
    load checked in a separate process. Appends what it repaired to ``notes``."""
    for _ in range(2):
        digest, why = cache.verify(so)
        fresh = digest is None
        if digest is None:
            if why is not None:
                notes.append(f"{why}; rebuilt")
            cache.remove_entry(so)
            args = [*FLAGS, OPENMP, *map(str, SOURCES), "-lm"]
            digest, why = build.compile_library(compiler, args, OPENMP, so)
            if digest is None:
                return None, why
        if cache.read_record(so, "checked") != digest:
            why = first_load.check_apart(HERE / "__init__.py", so, digest)
            if why is not None:
                cache.remove_entry(so)
                if fresh:
                    return None, f"the newly built native library {why}; it was removed"
                notes.append(f"the cached native library {so} {why}; it was removed and rebuilt")
                continue
            cache.record(so, "checked", digest)
        if cache.verify(so)[0] != digest:
            notes.append(f"the cached native library {so} changed while it was checked; rebuilt")
            continue
        try:
            lib = open_library(so)
        except (OSError, AttributeError) as e:
            return None, f"loading the native kernels from {so} failed: {e}"
        reason = _self_check(lib)
        return (None, reason) if reason else (lib, None)
    return None, f"the native library at {so} failed twice: {'; '.join(notes[-2:])}"


@build.Once  # one build per process, however many threads ask at once
def _load() -> _Loaded:
    if os.environ.get("MULTIHEAD_NATIVE", "1") == "0":
        return _Loaded(None, "disabled by MULTIHEAD_NATIVE=0", None, ())
    if not hasattr(os, "getuid"):
        return _Loaded(
            None, "the native kernels need a POSIX system (their cache is checked by owner)", None, ()
        )
    compiler, reason = build.find_compiler()
    if compiler is None:
        return _Loaded(None, reason, None, ())
    where, notes, unsafe = cache.private_dir(cache_dir())
    if unsafe:  # a directory planted by another account, or one anybody may write
        warnings.warn("multihead.native: " + "; ".join(notes), RuntimeWarning, stacklevel=4)
    if where is None:
        return _Loaded(
            None, f"no private directory to build the native kernels in: {'; '.join(notes)}", None, ()
        )
    so = library_path(" ".join(compiler), where)
    seen = len(notes)
    try:
        lib, reason = _open_entry(compiler, so, notes)
    except OSError as e:  # a full disk, a directory removed under us: no kernels, and why
        lib, reason = None, f"building or loading the native kernels in {where} failed: {e}"
    # an entry kept before digests were recorded is rebuilt as a matter of course: no warning
    repaired = [n for n in notes[seen:] if "no recorded digest" not in n]
    if repaired:
        warnings.warn("multihead.native: " + "; ".join(repaired), RuntimeWarning, stacklevel=4)
    return _Loaded(lib, reason, so if lib is not None else None, tuple(notes))


def watched() -> bool:
    """Whether a torch dispatch mode is active (a FLOP counter, fake tensors, a debugging mode): it sees
    torch's operators only, so callers run those instead of the native kernels while it is on."""
    return is_in_torch_dispatch_mode()


def unavailable() -> str | None:
    """Why the native kernel cannot run here, or None when it can (builds it on the first call)."""
    return _load()[1]


_KERNELS = {
    torch.float32: lambda lib: lib.mh_gemv_f32,
    torch.bfloat16: lambda lib: lib.mh_gemv_bf16,
    torch.float16: lambda lib: lib.mh_gemv_f16,
}


def dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes the kernels run here: fp32 and bf16, and fp16 where the CPU converts it (x86 F16C) or
    the compiler has ``_Float16``; none when the kernels are unavailable."""
    lib = _load()[0]
    return () if lib is None else cast(tuple[torch.dtype, ...], lib.mh_dtypes)


def threads() -> int:
    """Threads a large product runs on now (torch's OpenMP thread count; 1 without OpenMP or the
    kernels)."""
    lib = _load()[0]
    return int(lib.mh_native_threads()) if lib is not None else 1


def has_dpbf16() -> bool:
    """True when the bf16 kernel uses the AVX512-BF16 dot-product instruction (else it widens to fp32)."""
    lib = _load()[0]
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
    lib, reason = _load()[:2]
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
    return _load()[0]


def location() -> Path | None:
    """The file the kernels were loaded from (in the private build directory), or None."""
    return _load().path


def notes() -> tuple[str, ...]:
    """What the build skipped or repaired on the way, in order: a cache directory that could not be
    made or failed its owner and mode checks, a cached library that failed its digest or crashed its
    first load (then rebuilt)."""
    return _load().notes
