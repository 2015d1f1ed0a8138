"""How many threads a piece of work runs on: small work on one thread.

Splitting an operation over threads costs a hand-off and a wait for the slowest thread at its end. For
a small operation (the decode step of a small model: a few hundred kFLOPs per matrix) the hand-offs
cost more than the work, and on a machine busier than its cores a thread that lost its core makes the
others wait for a whole scheduler time slice (3-24 ms) - the cause of a 0.4M-parameter model decoding
6 tokens/s with two threads on a busy 2-core machine and 560 tokens/s with one. So the thread count
follows the work: one thread per :data:`FLOPS_PER_THREAD` FLOPs or :data:`BYTES_PER_THREAD` bytes read
of one call, at least 1, at most the cores this process may run on (and never more than torch is set
to use: a user's ``torch.set_num_threads`` is a ceiling).

    n = clamp(max(flops / FLOPS_PER_THREAD, bytes / BYTES_PER_THREAD), 1, cores)

:func:`limited` applies the count to the calling thread alone. ``torch.set_num_threads`` is
process-wide (it also sets the count every thread started later begins with), so a library that called
it would leave a thread started meanwhile on one thread, and undo a ``torch.set_num_threads`` that the
host made in the meantime. Instead, where torch's threads are OpenMP's (the Linux and Windows wheels),
the count is the calling thread's own OpenMP setting (``omp_set_num_threads``) and MKL's local one
(``mkl_set_num_threads_local``), which torch's operators and the native kernels read on that thread;
elsewhere the block runs on torch's count unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Callable, Iterator

import torch

__all__ = [
    "BYTES_PER_THREAD",
    "FLOPS_PER_THREAD",
    "busy_hint",
    "cores",
    "limited",
    "threads_for",
    "training",
]

#: one thread per this many FLOPs of a call (about 1 ms of one AVX-512 core's matmul)
FLOPS_PER_THREAD = 5e7
#: one thread per this many bytes a call reads (about 0.5 ms of one core's memory bandwidth)
BYTES_PER_THREAD = 8e6


def cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def threads_for(flops: float, nbytes: float = 0.0, *, ceiling: int | None = None) -> int:
    """Threads for one call of ``flops`` FLOPs reading ``nbytes`` bytes (see the module's rule).

    Args:
        flops: floating-point operations of one call (a decode step: 2 x parameters x tokens).
        nbytes: bytes the call reads (a decode step: the weights' bytes).
        ceiling: at most this many; ``min(torch.get_num_threads(), cores())`` when None.

    Raises:
        ValueError: a negative ``flops`` or ``nbytes``, or a ``ceiling`` below 1.
    """
    if flops < 0 or nbytes < 0:
        raise ValueError(f"flops and nbytes must be >= 0, got {flops} and {nbytes}")
    if ceiling is not None and ceiling < 1:
        raise ValueError(f"ceiling must be >= 1 thread, got {ceiling}")
    top = min(torch.get_num_threads(), cores()) if ceiling is None else ceiling
    want = max(flops / FLOPS_PER_THREAD, nbytes / BYTES_PER_THREAD)
    return max(1, min(top, int(want)))


@functools.cache
def _setters() -> tuple[Callable[[int], object], ...]:
    """The calling thread's thread-count setters of the runtimes torch's operators use: OpenMP's
    ``omp_set_num_threads`` (a per-thread setting) and MKL's ``mkl_set_num_threads_local`` (whose C
    entry point is ``MKL_Set_Num_Threads_Local``: the lower-case names take a pointer); none where
    torch does not run on OpenMP (then :func:`limited` changes nothing)."""
    if "OpenMP" not in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]:
        return ()
    found: list[Callable[[int], object]] = []
    libs = [os.path.join(os.path.dirname(torch.__file__), "lib", name) for name in _TORCH_LIBS]
    for name, symbol in (("OpenMP", "omp_set_num_threads"), ("MKL", "MKL_Set_Num_Threads_Local")):
        for path in (None, *libs):  # the process's global symbols first, then torch's own libraries
            try:
                fn = getattr(ctypes.CDLL(path), symbol, None)
            except OSError:  # a library this torch does not ship
                continue
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_int], None
                found.append(fn)
                break
        else:
            if name == "OpenMP":  # the OpenMP runtime is the one that must be there
                return ()
    return tuple(found)


_TORCH_LIBS = ("libgomp.so.1", "libtorch_cpu.so", "libiomp5.so", "libomp.dylib", "libtorch_cpu.dylib")


def _set_here(n: int) -> None:
    for setter in _setters():
        setter(n)


def _process_count() -> int:
    """The count a thread started now begins with: the last ``torch.set_num_threads`` of any thread."""
    seen: list[int] = []
    probe = threading.Thread(target=lambda: seen.append(torch.get_num_threads()), daemon=True)
    probe.start()
    probe.join()
    return seen[0]


@contextlib.contextmanager
def limited(n: int) -> Iterator[int]:
    """Run the block on at most ``n`` torch threads (never more than now) in the calling thread only;
    restore that thread's count after, unless a ``torch.set_num_threads`` was made meanwhile (it stays).

    Other threads, those already running and those started during the block, keep the process's count.
    Where torch does not run on OpenMP the count cannot be set per thread: the block runs on torch's
    count, and the yielded number says so.
    """
    before = torch.get_num_threads()  # also sets up this thread's count, as torch's first operator would
    use = max(1, min(n, before))
    if use == before or not _setters():
        yield before
        return
    _set_here(use)
    try:
        yield use
    finally:
        if torch.get_num_threads() == use:  # else this thread set its own count meanwhile: it stays
            latest = _process_count()
            _set_here(before if latest == before else latest)  # a host's set_num_threads meanwhile stays


def training(model: torch.nn.Module, tokens: int) -> contextlib.AbstractContextManager[int]:
    """:func:`limited` to the threads a training step of ``model`` on ``tokens`` tokens (batch x length)
    pays for: about 6 FLOPs per parameter per token (forward and backward), so a small run steps on one
    thread."""
    params = sum(p.numel() for p in model.parameters())
    return limited(threads_for(6.0 * params * tokens))


def busy_hint(threads: int | None = None) -> str | None:
    """One line when the machine is busier than its cores (1-minute load average above the cores this
    process may use), else None: timings then vary, and threads that wait for each other lose most."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # no load average on this OS
        return None
    n = cores()
    if load <= n:
        return None
    using = f"running on {threads} thread(s); " if threads is not None else ""
    return (
        f"note: the machine is busier than its cores (load {load:.1f} on {n} cores): {using}timings vary, "
        "and --threads 1 avoids waiting for threads that lost their core"
    )
