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
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

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


@contextlib.contextmanager
def limited(n: int) -> Iterator[int]:
    """Run the block on at most ``n`` torch threads (never more than now); restore the count after."""
    before = torch.get_num_threads()
    use = max(1, min(n, before))
    if use != before:
        torch.set_num_threads(use)
    try:
        yield use
    finally:
        if use != before:
            torch.set_num_threads(before)


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
