"""What each approximation costs: quality (MiniLM fidelity, MQAR recall) against time and peak memory.

Used by ``multihead approx``, the study section :func:`section` and ``benchmarks/bench_approx.py``.

- fidelity: the bundled all-MiniLM-L6-v2 with every attention approximated, against the exact model, on
  real text (standard-library docstrings): mean and worst cosine of the sentence embeddings;
- recall: held-out MQAR accuracy after training the same small model with the approximation
  (:func:`multihead.train.trainer.train_mqar`);
- cost: seconds and extra peak memory (growth of the process's peak resident set over the inputs) of one
  attention call, B=1, H=8, D=64, fp32, no mask, against exact attention on the ``tiled`` kernel.

Shape legend: N sequence length, H heads, D head dim.
"""

from __future__ import annotations

import functools
import gc
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..approx.apply import apply
from ..approx.base import Approximation
from ..approx.linear import LinearAttention, Performer
from ..approx.low_rank import Linformer, LowRank, Nystrom
from ..approx.sparse import SparseMask, Threshold, TopK, local, local_global
from ..core.functional import attention
from ..pretrained.files import atomic_write
from . import timing

__all__ = [
    "METHODS",
    "Method",
    "cost",
    "costs",
    "draw_pareto",
    "fidelity",
    "make",
    "method_style",
    "pareto_png",
    "peak_rss_tracker",
    "spread",
    "vs_exact",
]

HEADS, HEAD_DIM = 8, 64
#: LowRank forms the dense N x N weights (and an SVD of them): measured only up to this length
DENSE_LIMIT = 4096


@dataclass(frozen=True)
class Method:
    """One row of the comparison: a name and a factory ``build(max_len) -> approximation or None``."""

    name: str
    build: Callable[[int], Approximation | None]
    max_n: int | None = None  # longest N the cost benchmark runs (None: any)


METHODS: list[Method] = [
    Method("exact (tiled)", lambda n: None),
    Method("TopK(32)", lambda n: TopK(32)),
    Method("Threshold(0.01)", lambda n: Threshold(0.01)),
    Method("local(64)", lambda n: SparseMask(local(64))),
    Method("local_global(64, 16)", lambda n: SparseMask(local_global(64, 16))),
    Method("Linformer(64)", lambda n: Linformer(64, n, learned=True)),  # random at init; trains with MQAR
    Method("Nystrom(64)", lambda n: Nystrom(64)),
    Method("LowRank(16)", lambda n: LowRank(16, "random", clamp=True), DENSE_LIMIT),
    Method("LinearAttention(elu)", lambda n: LinearAttention()),
    Method("Performer(128)", lambda n: Performer(128)),
]


def make(name: str, max_len: int) -> Approximation | None:
    """The approximation of the method called ``name`` (None for exact).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    for m in METHODS:
        if m.name == name or m.name.split("(")[0] == name:
            return m.build(max_len)
    raise ValueError(f"unknown approximation {name!r}; choose one of {[m.name for m in METHODS]}")


# -- peak memory --------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status (Linux only)")


_MMAP_FIXED = False


def _fix_mmap_threshold() -> None:
    """Make glibc serve every allocation of 1 MiB or more with its own mmap, returned to the system on free.

    By default glibc raises its mmap threshold after a large block is freed, so later allocations come out
    of memory the process already holds: they never raise the peak resident set, and a measurement after a
    bigger one read 0 bytes. A fixed threshold (``mallopt(M_MMAP_THRESHOLD)``) keeps the peak honest.
    """
    global _MMAP_FIXED
    if _MMAP_FIXED:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = -3
    except (OSError, AttributeError):
        pass  # not glibc: the peak may under-read after large frees
    _MMAP_FIXED = True


def peak_rss_tracker() -> Callable[[], int] | None:
    """Reset the process's peak resident set (Linux ``clear_refs``) and return ``extra()`` -> bytes the
    peak grew above the current resident set since the reset; None where the platform cannot."""
    _fix_mmap_threshold()
    try:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        base = _status_kib("VmRSS")
    except OSError:
        return None
    return lambda: max(0, _status_kib("VmHWM") - base) * 1024


# -- cost ---------------------------------------------------------------------------------------------
def cost(approx: Approximation | None, n: int, *, seed: int = 0) -> dict[str, Any]:
    """Seconds and extra peak bytes of one attention call (1, 8, n, 64) fp32 under no_grad (the peak of
    the first call, the median time of the calls after it: :func:`multihead.bench.timing.measure`).

    Exact attention runs on the ``tiled`` backend (O(N) memory). The peak is None off Linux.
    """
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=g) for _ in range(3))  # (1, H, N, D)
    backend = "tiled" if approx is None else approx
    with torch.no_grad():
        extra = peak_rss_tracker()
        out = attention(q, k, v, backend=backend)
        peak = None if extra is None else extra()
        t = timing.measure(
            lambda: attention(q, k, v, backend=backend), warmup=0, min_samples=3, max_seconds=2.0
        )
    seconds = t.median if t.median is not None else float("nan")  # nan: too short to measure
    assert isinstance(out, Tensor)
    return {"n": n, "seconds": seconds, "peak_bytes": peak, "finite": bool(torch.isfinite(out).all())}


def costs(approxes: dict[str, Approximation | None], n: int, *, seed: int = 0) -> dict[str, dict[str, Any]]:
    """:func:`cost` of every approximation at length ``n``, their samples interleaved
    (:func:`multihead.bench.timing.measure_all`), so that a change of load on a shared machine slows them
    alike and their ranking is the code's, not the machine's: name -> ``{"n", "seconds" (median; nan
    when too short to measure), "spread" ([low, high] seconds: the quartiles), "why", "peak_bytes",
    "finite"}``. The peak is each one's first call alone.
    """
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=g) for _ in range(3))  # (1, H, N, D)
    calls: dict[str, Callable[[], object]] = {}
    out: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for name, approx in approxes.items():
            backend: str | Approximation = "tiled" if approx is None else approx
            extra = peak_rss_tracker()
            first = attention(q, k, v, backend=backend)
            assert isinstance(first, Tensor)
            out[name] = {"n": n, "peak_bytes": None if extra is None else extra(),
                         "finite": bool(torch.isfinite(first).all())}  # fmt: skip
            del first
            calls[name] = functools.partial(attention, q, k, v, backend=backend)
        times = timing.measure_all(calls, warmup=0, min_samples=5, max_seconds=3.0)
    for name, t in times.items():
        spread = None if t.low is None or t.high is None else [t.low, t.high]
        seconds = t.median if t.median is not None else float("nan")  # nan: too short to measure
        out[name].update(seconds=seconds, spread=spread, why=t.why)
    return out


def vs_exact(c: dict[str, Any], exact: dict[str, Any] | None) -> str:
    """A method's time against exact attention's at the same length, from their medians and spreads
    (:func:`costs`): "1.23x", "same within noise" where the spreads overlap, or "n/a (why)" where
    either has no figure or a spread wider than 10x (one ratio would then say nothing)."""
    if exact is None:
        return ""

    def timed(x: dict[str, Any]) -> timing.Checked:
        low, high = x.get("spread") or (None, None)
        fix = "pass a larger N, or run on an idle machine"
        return timing.check_figure(x["seconds"], low, high, why=x.get("why", ""), fix=fix)

    a, b = timed(c), timed(exact)
    if not (a.ok and b.ok):
        return (a if not a.ok else b).text()
    ta, tb = (timing.Timing(x.value, x.low or x.value, x.high or x.value, 1, 1) for x in (a, b))
    return str(timing.compare(ta, tb))


# -- fidelity -----------------------------------------------------------------------------------------
def fidelity(
    encoder: Any, approx: Approximation, texts: list[str], exact: Tensor, batch_size: int = 32
) -> dict:
    """Mean and worst cosine of the approximated encoder's embeddings against ``exact`` (n, d) unit rows.

    Both run padded batches (key padding masks; the packed form's document mask is not an approximation's
    to honour).
    """
    approx_encoder: Any = apply(encoder, approx)
    emb = approx_encoder.encode(texts, batch_size=batch_size, packed=False)
    cos = (emb * exact).sum(-1)  # (n,): both are L2-normalised
    return {"mean_cos": float(cos.mean()), "worst_cos": float(cos.min())}


# -- the Pareto plot ----------------------------------------------------------------------------------
def mqar_layout_bound(row: dict) -> bool:
    """True for a row whose MQAR score may rest on the pairs' fixed positions, not on recall: a Linformer
    (learned (k, max_len) projections are tied to absolute positions; ``benchmarks/mqar_shift.py``)."""
    return row["name"].startswith("Linformer") and row.get("mqar_acc") is not None


#: one marker per method of :data:`METHODS`, in its order (exact attention is the black one)
MARKERS = "osD^v<>PX*hpH8d"


def method_style(name: str, fallback: int = 0) -> tuple[str, str]:
    """(marker, colour) of a method: its place in :data:`METHODS` (so it looks the same in every plot and
    no two methods share either); a name not listed takes ``len(METHODS) + fallback``."""
    names = [m.name for m in METHODS]
    i = names.index(name) if name in names else len(names) + fallback
    return MARKERS[i % len(MARKERS)], "black" if i == 0 else f"C{(i - 1) % 10}"


def spread(ts: list[float], ys: list[float], near: float = 0.04) -> list[float]:
    """Times moved sideways (log axis) where two points would cover each other, so that none is hidden.

    Two points are too near when they are closer than ``near`` of the plot's span in both log time
    (at least a decade) and quality (at least 0.05). Each crowd of such points is laid out in the order
    of its times, ``1.25 * near`` of the span apart around the crowd's mean log time; a point alone keeps
    its time. Returns the times to draw at (all > 0).
    """
    lx = [math.log10(t) for t in ts]
    dx = near * max(max(lx, default=0.0) - min(lx, default=0.0), 1.0)
    dy = near * max(max(ys, default=0.0) - min(ys, default=0.0), 0.05)
    xs = list(lx)
    for _ in range(len(xs)):  # a crowd laid out may come near another point: lay out again, together
        crowds = [c for c in _crowds(xs, ys, dx, dy) if len(c) > 1]
        if not crowds:
            break
        for crowd in crowds:
            crowd.sort(key=lambda i: (lx[i], i))
            centre = sum(lx[i] for i in crowd) / len(crowd)
            for j, i in enumerate(crowd):
                xs[i] = centre + 1.25 * dx * (j - (len(crowd) - 1) / 2)
    return [t if x == x0 else 10**x for t, x, x0 in zip(ts, xs, lx, strict=True)]  # unmoved: exact


def _crowds(xs: list[float], ys: list[float], dx: float, dy: float) -> list[list[int]]:
    """Indices grouped by chains of points nearer than (dx, dy) to one another."""
    group = list(range(len(xs)))

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    for i in range(len(xs)):
        for j in range(i):
            if abs(xs[i] - xs[j]) < dx and abs(ys[i] - ys[j]) < dy:
                group[root(i)] = root(j)
    out: dict[int, list[int]] = {}
    for i in range(len(xs)):
        out.setdefault(root(i), []).append(i)
    return list(out.values())


def _not_drawn(r: dict, key: str, n: int) -> str | None:
    """Why row ``r`` has no point on the ``key`` panel at length ``n``, or None when it has one."""
    t = r.get("cost", {}).get(n, {}).get("seconds")
    if r.get(key) is None:
        return "no MQAR run" if key == "mqar_acc" else "no fidelity run"
    if t is None:
        return f"not timed at N={n}"
    return timing.TOO_SHORT if math.isnan(t) else None


def draw_pareto(ax: Any, rows: list[dict], key: str, label: str, n: int) -> None:
    """One panel: ``key`` (a quality) against seconds per call at length ``n`` on a log axis; one marker
    and colour per method (:func:`method_style`), points that would cover each other spread sideways
    (:func:`spread`, the largest move stated on the axis), and the methods without a point named in the
    legend with the reason."""
    from matplotlib import ticker

    drawn = [r for r in rows if _not_drawn(r, key, n) is None]
    ts = [r["cost"][n]["seconds"] for r in drawn]
    xs = spread(ts, [r[key] for r in drawn])
    for r, x in zip(drawn, xs, strict=True):
        i = rows.index(r)
        marker, colour = method_style(r["name"], i)
        layout = key == "mqar_acc" and mqar_layout_bound(r)
        name = r["name"] + (" (fixed pair positions)" if layout else "")
        ax.scatter(x, r[key], s=45, color=colour, marker=marker, label=name,
                   facecolors="none" if layout else colour)  # fmt: skip
    left = [f"{r['name']} ({why})" for r in rows if (why := _not_drawn(r, key, n)) is not None]
    if left:
        ax.plot([], [], " ", label="not drawn: " + ", ".join(left))
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())  # labelled minor ticks overlapped
    moved = max((abs(math.log(x / t)) for x, t in zip(xs, ts, strict=True)), default=0.0)
    note = f"\nnear points spread sideways, at most {100 * (math.exp(moved) - 1):.0f}%" if moved else ""
    ax.set_xlabel(f"seconds per attention call, N={n} (B=1, H={HEADS}, D={HEAD_DIM}, fp32){note}")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.set_title(f"{label}\nup and to the left is better", fontsize=10)


def pareto_png(rows: list[dict], path: str | Path, n: int) -> str | None:
    """Plot quality (MiniLM mean cosine; MQAR accuracy) against time at length ``n``, one panel per
    quality that some method has (:func:`draw_pareto`), and write a PNG; returns the path, or None when
    no method has a quality score."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("mean_cos", "MiniLM embedding cosine vs exact (mean)"), ("mqar_acc", "MQAR accuracy")]
    panels = [p for p in panels if any(r.get(p[0]) is not None for r in rows)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels) + 2.5, 4.8), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        draw_pareto(ax, rows, key, label, n)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return str(path)
