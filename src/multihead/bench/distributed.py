"""What ring attention costs per rank as the world grows: peak memory, time, bytes sent.

For each world size W a fresh group of W local gloo processes (:func:`launch`) runs one ring attention
call over the same global problem (B=1, H heads, N positions, D, fp32). Each rank builds only its own
shard of q, k, v (never the whole sequence), so every figure is what that rank needs:

- peak memory: growth of the process's peak resident set (VmHWM) over its state right before the shard
  is built (torch, the process group and a warm-up call already in place): inputs, the K/V shards in
  flight, partial and merged outputs, kernel workspace. The high-water mark is reset through
  ``/proc/self/clear_refs`` (Linux; elsewhere it is not measured: None), and the ranks run with a fixed
  glibc mmap threshold so that freed buffers leave the resident set (see ``_MALLOC``).
- time: wall time of the call (:func:`time_collective`: the median of repeated calls, each sample
  the slowest rank's; W processes share the machine's cores, so on a small box this shows the
  scheme's overhead, not a speed-up).
- bytes sent: point-to-point traffic of the rank during the call, counted by :func:`traffic`.

``python -m multihead.parallel bench`` prints the table; ``multihead bench --distributed N`` is the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core import masks
from ..parallel.comm import traffic
from ..parallel.launch import launch
from ..parallel.layout import shard_ranges
from . import timing

__all__ = ["render_distributed_bench", "run_distributed_bench", "world_sizes_up_to"]

MASKS = ("none", "causal", "sliding_window")
# A fixed mmap threshold: every large buffer is its own mapping, returned to the OS when freed, so the
# resident set follows the live tensors (glibc's adaptive threshold would keep freed ones in the heap).
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 16)}


def _vm_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class _Peak:
    """Growth of peak memory from now on: the process's VmHWM on CPU, the allocator's peak on CUDA."""

    def __init__(self, dev: torch.device):
        self.dev = dev
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            self.base: int | None = torch.cuda.memory_allocated(dev)
            return
        try:  # writing 5 resets VmHWM to the current RSS (Linux >= 4.0)
            Path("/proc/self/clear_refs").write_text("5")
            kib = _vm_kib("VmHWM")
            self.base = None if kib is None else kib * 1024
        except OSError:
            self.base = None

    def grown(self) -> int | None:
        """Bytes the peak grew since construction; None where it cannot be measured."""
        if self.base is None:
            return None
        if self.dev.type == "cuda":
            return torch.cuda.max_memory_allocated(self.dev) - self.base
        kib = _vm_kib("VmHWM")
        return None if kib is None else kib * 1024 - self.base


def _make_mask(kind: str, window: int) -> masks.Mask | None:
    if kind == "causal":
        return masks.causal()
    if kind == "sliding_window":
        return masks.sliding_window(window)
    return None


def shard_local(t: torch.Tensor, rank: int, world: int, layout: str) -> torch.Tensor:
    """Rank ``rank``'s shard along dim 2 without a process group (the bench's warm-up)."""
    ranges = shard_ranges(t.shape[2], world, layout)[rank]
    return torch.cat([t[:, :, a:b] for a, b in ranges], dim=2)  # (B, H, n, D)


def bench_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of one measurement; returns its figures."""
    import torch.distributed as dist

    from ..parallel.ring import ring_attention

    B, H, Hkv, D, N = 1, cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["seq_len"]
    dev = torch.device(cfg.get("device", "cpu"))
    mask = _make_mask(cfg["mask"], cfg["window"])
    kw = {"mask": mask, "layout": cfg["layout"], "backend": cfg["backend"], "timeout": cfg["timeout"]}
    # warm-up on a few tiles (and through the backward when measured): gloo connections, the autograd
    # engine, the kernels' code pages - all count in the resident set but do not grow with N
    small = [torch.randn(B, h, min(N, 512 * world), D, device=dev) for h in (H, Hkv, Hkv)]
    local = [shard_local(t, rank, world, cfg["layout"]).requires_grad_(cfg["backward"]) for t in small]
    with torch.set_grad_enabled(cfg["backward"]):
        warm = ring_attention(*local, **kw)
        assert isinstance(warm, torch.Tensor)
        if cfg["backward"]:
            warm.backward(torch.ones_like(warm))  # exactly the measured call: sum() takes another path
    del small, local, warm
    dist.barrier()
    n = sum(b - a for a, b in shard_ranges(N, world, cfg["layout"])[rank])
    peak = _Peak(dev)
    g = torch.Generator(device=dev).manual_seed(1000 + rank)
    q, k, v = (
        torch.randn(B, h, n, D, generator=g, device=dev, requires_grad=cfg["backward"]) for h in (H, Hkv, Hkv)
    )  # only this rank's shard is ever built
    input_bytes = sum(t.numel() * t.element_size() for t in (q, k, v))

    def call() -> torch.Tensor:
        with torch.set_grad_enabled(cfg["backward"]):
            out = ring_attention(q, k, v, **kw)
            assert isinstance(out, torch.Tensor)
            if cfg["backward"]:
                out.backward(torch.ones_like(out))
        return out

    with traffic() as sent:
        out = call()  # the call whose memory and traffic are measured
    peak_bytes = peak.grown()
    t = time_collective(call, dev, sync=_max_over_ranks(dev))
    return {
        "rank": rank,
        "tokens": n,
        "input_bytes": input_bytes,
        "peak_bytes": peak_bytes,
        "seconds": t.median,
        "seconds_spread": [t.low, t.high],
        "why": t.why,
        "sent_bytes": sent.sent_bytes,
        "messages": sent.messages,
        "finite": bool(torch.isfinite(out).all()),
    }


def _max_over_ranks(dev: torch.device) -> Callable[[float], float]:
    import torch.distributed as dist

    def agree(seconds: float) -> float:
        x = torch.tensor([seconds], dtype=torch.float64, device=dev)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return float(x.item())

    return agree


def time_collective(
    call: Callable[[], object],
    dev: torch.device,
    *,
    sync: Callable[[float], float] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> timing.Timing:
    """Seconds of ``call`` on every rank of a group (:func:`multihead.bench.timing.measure`, synchronised
    with the device), each sample the slowest rank's through ``sync`` (an all-reduce of the maximum),
    so that every rank takes the same number of calls and the collective call never waits for a rank
    that stopped. ``call`` has run once already (the warm-up)."""

    def synced() -> None:
        call()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    return timing.measure(synced, warmup=0, min_samples=3, max_seconds=5.0, clock=clock, sync=sync)


def world_sizes_up_to(n: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``n``, and ``n``: the world sizes for ``multihead bench --distributed n``.

    Raises:
        ValueError: ``n < 1``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of processes must be an int >= 1, got {n!r}")
    sizes = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return tuple(sizes if sizes[-1] == n else [*sizes, n])


def run_distributed_bench(
    world_sizes: Sequence[int] = (1, 2, 4),
    seq_len: int = 8192,
    *,
    heads: int = 2,
    kv_heads: int | None = None,
    head_dim: int = 64,
    mask: str = "causal",
    window: int = 256,
    layout: str | None = None,
    backward: bool = False,
    backend: str = "auto",
    timeout: float = 600.0,
    threads: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure ring attention per rank for each world size (each in fresh local gloo processes).

    Args:
        world_sizes: the W to measure, e.g. (1, 2, 4).
        seq_len: global sequence length N (a multiple of 2W for every W when the layout is zigzag).
        heads, kv_heads, head_dim: Hq, Hkv (default Hq), D; B = 1, fp32.
        mask: "none" | "causal" | "sliding_window" (of ``window`` positions).
        layout: "contiguous" | "zigzag"; default zigzag for causal masks, contiguous otherwise.
        backward: also run the backward (gradient of sum(out)).
        backend: per-step backend of :func:`ring_attention`.
        timeout: seconds one world size may take (also each message's timeout).
        threads: intra-op threads per rank.
        progress: called with a line before each world size (e.g. ``print``).

    Returns:
        ``{"config": {...}, "rows": [{"world_size", "tokens_per_rank", "peak_bytes", "input_bytes",
        "seconds", "sent_bytes", "messages", "ranks": [per-rank dicts]}, ...]}``; per-row figures are the
        maximum over ranks (the rank that sizes the machine).

    Raises:
        ValueError: an unknown mask or layout, a world size below 1, a seq_len the layout cannot split.
        LaunchError: a rank failed.
    """
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {list(MASKS)}, got {mask!r}")
    layout = layout or ("zigzag" if mask == "causal" else "contiguous")
    for w in world_sizes:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"world_sizes must hold ints >= 1, got {list(world_sizes)}")
        shard_ranges(seq_len, w, layout)  # raises early when the layout cannot split seq_len
    cfg = {
        "seq_len": seq_len,
        "heads": heads,
        "kv_heads": kv_heads or heads,
        "head_dim": head_dim,
        "mask": mask,
        "window": window,
        "layout": layout,
        "backward": backward,
        "backend": backend,
        "timeout": timeout,
        "dtype": "float32",
        "threads": threads,
        "device": "cpu",
    }
    rows = []
    for w in world_sizes:
        if progress is not None:
            progress(f"ring attention, N={seq_len}, world size {w} ...")
        ranks = launch(
            bench_worker, w, cfg, timeout=timeout + 120, op_timeout=timeout, threads=threads, env=_MALLOC
        )
        rows.append(summarise(w, ranks))
    return {"config": cfg, "rows": rows}


def summarise(world: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    peaks = [r["peak_bytes"] for r in ranks]
    secs = [r["seconds"] for r in ranks]
    return {
        "world_size": world,
        "tokens_per_rank": max(r["tokens"] for r in ranks),
        "peak_bytes": None if None in peaks else max(peaks),
        "input_bytes": max(r["input_bytes"] for r in ranks),
        "seconds": None if None in secs else max(secs),  # the samples are the slowest rank's already
        "why": next((r["why"] for r in ranks if r["why"]), ""),
        "sent_bytes": max(r["sent_bytes"] for r in ranks),
        "messages": max(r["messages"] for r in ranks),
        "finite": all(r["finite"] for r in ranks),
        "ranks": ranks,
    }


def _mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f} MiB"


def _seconds(row: dict[str, Any]) -> str:
    return timing.TOO_SHORT if row["seconds"] is None else f"{row['seconds']:.3g} s"


def render_distributed_bench(result: dict[str, Any]) -> str:
    """A Markdown table of :func:`run_distributed_bench`'s result (one row per world size)."""
    c = result["config"]
    head = (
        f"Ring attention, N={c['seq_len']}, B=1, Hq={c['heads']}, Hkv={c['kv_heads']}, D={c['head_dim']}, "
        f"{c['dtype']}, mask={c['mask']}, layout={c['layout']}, "
        f"{'forward + backward' if c['backward'] else 'forward'}, {c['threads']} thread(s) per rank. "
        "Per-rank figures are the maximum over ranks."
    )
    w0 = result["rows"][0]["world_size"] if result["rows"] else 1
    lines = [
        head,
        "",
        f"| world size | tokens per rank | peak memory per rank | vs W={w0} | inputs per rank | time | "
        "sent per rank |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    first = result["rows"][0]["peak_bytes"] if result["rows"] else None
    for r in result["rows"]:
        ratio = "n/a" if r["peak_bytes"] is None or not first else f"{r['peak_bytes'] / first:.3f}"
        lines.append(
            f"| {r['world_size']} | {r['tokens_per_rank']} | {_mib(r['peak_bytes'])} | {ratio} | "
            f"{_mib(r['input_bytes'])} | {_seconds(r)} | {_mib(r['sent_bytes'])} "
            f"({r['messages']} msgs) |"
        )
    return "\n".join(lines)
