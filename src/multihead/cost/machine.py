"""This machine's measured rates: matmul GFLOP/s per dtype and read bandwidth (the roofline's roof).

Used by :func:`multihead.cost.measure_roof` and by ``multihead bench``, which reports every result as a
fraction of these.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["machine", "machine_rates", "median_time"]


def median_time(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def machine_rates(dtypes: set[str]) -> dict[str, float]:
    """GFLOP/s of a 2048^3 matmul per dtype, and GB/s of a sum over 512 MiB, measured now."""
    rates = {}
    for name in dtypes:
        dt = getattr(torch, name.replace("torch.", ""))
        a, b = torch.randn(2048, 2048).to(dt), torch.randn(2048, 2048).to(dt)
        rates[name] = 2 * 2048**3 / median_time(functools.partial(torch.matmul, a, b)) / 1e9
    x = torch.ones(128 << 20)  # 512 MiB fp32
    rates["bandwidth"] = x.numel() * 4 / median_time(x.sum) / 1e9
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
