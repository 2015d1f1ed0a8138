"""Start N local processes joined in a gloo process group, run a function on each, collect the results.

This is what the tests and ``multihead bench --distributed N`` use; on a cluster ``torchrun`` plays its
part (see the README's "Distributed" section). Each child:

1. limits itself to ``threads`` intra-op threads (N processes share the machine's cores),
2. joins the group through a file store in a private temp dir (no port to pick, none to collide on)
   with ``init_process_group(timeout=op_timeout)``, so a rank that never arrives stops the others,
3. runs ``fn(rank, world_size, *args)`` and sends back its result, or its exception and traceback.

Faults: when any rank raises or exits without a result, the others get ``grace`` seconds to finish or fail
on their own (their own communication timeouts fire), then are stopped, and :class:`LaunchError` reports
every rank's fate. A job that outlives ``timeout`` is stopped the same way. No result list is returned
unless every rank returned one.
"""

from __future__ import annotations

import io
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .comm import check_timeout

__all__ = ["LaunchError", "launch"]


class LaunchError(RuntimeError):
    """One or more ranks of a :func:`launch` failed, died or hung; ``failures`` maps rank -> what happened."""

    def __init__(self, message: str, failures: dict[int, str], tracebacks: dict[int, str]):
        super().__init__(message)
        self.failures, self.tracebacks = failures, tracebacks


def _child(rank, world_size, fn, args, store, results, threads, op_timeout, backend) -> None:
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=op_timeout),
        )
        value = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException as e:  # report everything, including KeyboardInterrupt / SystemExit
        results.put((rank, False, (f"{type(e).__name__}: {e}", traceback.format_exc())))
        results.close()
        results.join_thread()
        os._exit(1)  # skip the group's teardown: a dead peer could make it block
    dist.destroy_process_group()


@contextmanager
def _child_env(env: dict[str, str]) -> Iterator[None]:
    """Children read OMP/MKL thread counts (and malloc tunables) at start-up: set them around the spawn."""
    old = {n: os.environ.get(n) for n in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for n, val in old.items():
            if val is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = val


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 600.0,
    op_timeout: float = 60.0,
    grace: float = 20.0,
    threads: int = 1,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh local processes; return the results.

    Args:
        fn: a module-level (picklable) function; its return value must be ``torch.save``-able.
        world_size: number of processes (ranks 0 .. world_size - 1).
        args: extra arguments, passed to every rank.
        timeout: seconds the whole job may take before it is stopped.
        op_timeout: the process group's timeout (``init_process_group(timeout=)``): joining, collectives.
        grace: seconds the other ranks get to finish or fail by themselves after one rank failed.
        threads: intra-op threads per process (``torch.set_num_threads`` and OMP/MKL_NUM_THREADS).
        backend: "gloo" (CPU) or "nccl" (one GPU per rank, where there are GPUs).
        env: extra environment variables for the children (set around the spawn, then restored).

    Returns:
        ``[result of rank 0, result of rank 1, ...]``, only when every rank returned.

    Raises:
        ValueError: a world_size below 1, threads below 1, non-positive timeouts.
        LaunchError: a rank raised, died, or the job ran past ``timeout`` (every rank's fate is listed).
    """
    for name, val in (("world_size", world_size), ("threads", threads)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"launch {name} must be an int >= 1, got {val!r}")
    timeout, op_timeout, grace = check_timeout(timeout), check_timeout(op_timeout), check_timeout(grace)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="multihead-launch-")
    store = os.path.join(tmp, "store")
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, fn, args, store, results, threads, op_timeout, backend),
            daemon=True,
        )
        for r in range(world_size)
    ]
    try:
        with _child_env({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **(env or {})}):
            for p in procs:
                p.start()
        done, failures, tracebacks = _collect(procs, results, timeout, grace)
    finally:
        _stop(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        lines = [f"rank {r}: {failures[r]}" for r in sorted(failures)]
        raise LaunchError(
            f"launch(world_size={world_size}) failed; no results are returned:\n  " + "\n  ".join(lines),
            failures,
            tracebacks,
        )
    return [torch.load(io.BytesIO(done[r]), weights_only=False) for r in range(world_size)]


def _collect(procs, results, timeout: float, grace: float):
    """Gather each rank's message; decide who failed, died or hung."""
    world = len(procs)
    done: dict[int, bytes] = {}
    failures: dict[int, str] = {}
    tracebacks: dict[int, str] = {}
    gone_since: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    reason = f"still running after the launch timeout of {timeout:g} s; stopped"
    while len(done) + len(failures) < world:
        now = time.monotonic()
        if now > deadline:
            failures.update({r: reason for r in range(world) if r not in done and r not in failures})
            break
        try:
            rank, ok, payload = results.get(timeout=0.1)
            if ok:
                done[rank] = payload
            else:
                failures[rank], tracebacks[rank] = payload
        except queue.Empty:
            pass
        for r, p in enumerate(procs):
            if r in done or r in failures or p.is_alive():
                continue
            # its message may still be in the pipe: give it a moment before calling the rank dead
            if now - gone_since.setdefault(r, now) > 1.0:
                failures[r] = f"process exited with code {p.exitcode} without returning a result"
        if failures and now + grace < deadline:  # first failure: the others get `grace` seconds
            deadline = now + grace
            reason = f"still running {grace:g} s after rank {min(failures)} failed; stopped"
    return done, failures, tracebacks


def _stop(procs) -> None:
    """Terminate, then kill, the processes this launch started that are still alive."""
    procs = [p for p in procs if p.pid is not None]  # started ones only
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
