"""The plumbing under ring and tensor-parallel attention: process groups, timed waits, traffic counting.

Every wait on a send, a receive or a collective goes through :func:`wait` with a timeout, so a peer rank
that died or stalled turns into a :class:`CommError` naming what was awaited, from whom and for how
long - never a hang, and never a partial result handed back as if it were complete.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["DEFAULT_TIMEOUT", "CommError", "Traffic", "check_timeout", "resolve_group", "traffic", "wait"]

#: Seconds a rank waits for one message or collective before it gives up. A wait only blocks for as long
#: as a peer lags behind, so a few times one ring step's compute is enough; 300 s covers N = 64K on a CPU.
DEFAULT_TIMEOUT = 300.0


class CommError(RuntimeError):
    """A send, receive or collective did not finish in time, or failed: a peer rank died or stalled.

    The process group is unusable afterwards; destroy it (``torch.distributed.destroy_process_group``) and
    restart the job. No partial result is returned.
    """


def check_timeout(timeout: float) -> float:
    """Return ``timeout`` (seconds) as a float after checking it is a finite number > 0.

    Raises:
        ValueError: a timeout that is not a positive finite number.
    """
    ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not ok or not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(
            f"timeout must be a finite number of seconds > 0, got {timeout!r}; "
            f"the default is {DEFAULT_TIMEOUT:g} s"
        )
    return float(timeout)


def resolve_group(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, int, int]:
    """The process group (the default one for None), this process's rank in it, and its size.

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group(...) first, "
            "start the script with `torchrun --nproc-per-node N ...`, or use multihead.parallel.launch(fn, N)"
        )
    pg = dist.group.WORLD if group is None else group
    assert pg is not None
    return pg, dist.get_rank(pg), dist.get_world_size(pg)


# -- traffic counting ------------------------------------------------------------------------------
@dataclass
class Traffic:
    """Bytes and messages this rank sent point-to-point while the :func:`traffic` context was open."""

    sent_bytes: int = 0
    messages: int = 0


_OPEN: list[Traffic] = []


@contextmanager
def traffic() -> Iterator[Traffic]:
    """Count what this rank sends inside the block: ``with traffic() as t: ...; t.sent_bytes``."""
    t = Traffic()
    _OPEN.append(t)
    try:
        yield t
    finally:
        _OPEN.remove(t)


# -- point to point --------------------------------------------------------------------------------
def isend(t: Tensor, to: int, group: dist.ProcessGroup, tag: int) -> dist.Work:
    """Start sending ``t`` to group rank ``to``; count its bytes."""
    for c in _OPEN:
        c.sent_bytes += t.numel() * t.element_size()
        c.messages += 1
    work = dist.isend(t.contiguous(), group=group, group_dst=to, tag=tag)
    assert work is not None
    return work


def irecv(t: Tensor, frm: int, group: dist.ProcessGroup, tag: int) -> dist.Work:
    """Start receiving into ``t`` from group rank ``frm``."""
    work = dist.irecv(t, group=group, group_src=frm, tag=tag)
    assert work is not None
    return work


def wait(work: dist.Work, *, timeout: float, what: str) -> None:
    """Wait for ``work`` at most ``timeout`` seconds.

    Raises:
        CommError: the operation failed or did not finish in time; ``what`` says which one.
    """
    t0 = time.monotonic()
    try:
        done = work.wait(timedelta(seconds=timeout))
    except RuntimeError as e:  # gloo raises on timeouts and on a peer that closed its connection
        raise CommError(_message(what, time.monotonic() - t0, timeout, str(e))) from e
    if done is False:
        raise CommError(_message(what, time.monotonic() - t0, timeout, "wait returned False"))


def _message(what: str, waited: float, timeout: float, cause: str) -> str:
    cause = cause.strip().splitlines()[-1] if cause.strip() else "no detail"
    return (
        f"{what}: gave up after {waited:.1f} s (timeout {timeout:g} s): {cause}. A peer rank died or "
        "stalled; no partial result is returned. Destroy the process group and restart the job."
    )


def all_gather_ints(
    values: list[int], group: dist.ProcessGroup, *, timeout: float, what: str
) -> list[list[int]]:
    """Every rank's ``values`` (same length on all ranks), gathered with a timeout: [rank][i]."""
    world = dist.get_world_size(group)
    mine = torch.tensor(values, dtype=torch.int64, device=_comm_device(group))
    out = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(out, mine, group=group, async_op=True)
    assert work is not None
    wait(work, timeout=timeout, what=what)
    return [o.tolist() for o in out]


def _comm_device(group: dist.ProcessGroup) -> torch.device:
    """Where small control tensors live: CUDA for NCCL (which cannot send CPU tensors), else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
