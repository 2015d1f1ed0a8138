"""This machine's measured rates: matmul GFLOP/s per dtype and read bandwidth (the roofline's roof).

Used by :func:`multihead.cost.measure_roof` and by ``multihead bench``, which reports every result as a
fraction of these.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from collections.abc import Callable

import torch

from . import timing

__all__ = ["machine", "machine_rates", "probe_time"]


def probe_time(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of the fastest call of ``fn`` (:func:`multihead.cost.timing.measure`: samples long
    enough for ``clock`` and the scheduler, after a warm-up call): a probe of a limit, whose best case
    is the limit.

    Raises:
        RuntimeError: the call was too short to measure with ``clock`` (its rate would be invented).
    """
    t = timing.measure(fn, clock=clock, min_samples=3)
    if t.best is None:
        raise RuntimeError(f"the machine's probe could not be timed: {t.why}")
    return t.best


def machine_rates(dtypes: set[str]) -> dict[str, float]:
    """GFLOP/s of a 2048^3 matmul per dtype, and GB/s of a sum over 512 MiB, measured now (the fastest
    sample of each: :func:`probe_time`).

    Raises:
        RuntimeError: a probe was too short to measure.
    """
    rates = {}
    for name in dtypes:
        dt = getattr(torch, name.replace("torch.", ""))
        a, b = torch.randn(2048, 2048).to(dt), torch.randn(2048, 2048).to(dt)
        rates[name] = 2 * 2048**3 / probe_time(functools.partial(torch.matmul, a, b)) / 1e9
    x = torch.ones(128 << 20)  # 512 MiB fp32
    rates["bandwidth"] = x.numel() * 4 / probe_time(x.sum) / 1e9
    return rates


def machine(rates: dict[str, float]) -> dict:
    """The machine's description for a results file: CPU, threads, torch version and ``rates``."""
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "matmul_gflops": {k: round(v, 1) for k, v in rates.items() if k != "bandwidth"},
        "bandwidth_gbps": round(rates["bandwidth"], 2),
    }
