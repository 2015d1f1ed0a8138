"""``multihead bench``: a fixed attention speed suite, every method against its peers in the same run.

Each case is one problem (shape, dtype, mask, bias, forward or forward+backward); each method runs it:
ours (``auto`` and the backend auto should pick) and the peers - SDPA with the equivalent dense mask or
bias (built before timing), SDPA called per 256-row query block over the keys it needs, compiled
FlexAttention (``--flex``; it compiles once per shape), and the eager matmul-softmax-matmul path of
Hugging Face's ``eager_attention_forward`` (only where its N x N scores fit in memory).

Repeats are interleaved (method A, B, C, A, B, C, ...) and the median is reported, so a machine shared
with other work slows every method alike; the goals below are ratios for that reason.
Useful FLOPs follow FlashAttention's convention: 4 * B * Hq * D per allowed (query, key) pair forward,
3.5x that forward+backward. The machine's matmul rate (a square matmul in the case's dtype) and memory
bandwidth (a sum over 512 MiB) are measured in the same run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..cost import machine
from ..pretrained.files import atomic_write
from . import methods as bm
from . import timing
from .methods import Case

__all__ = ["GOALS", "Case", "Result", "Verdict", "cases", "check_goals", "run", "verdicts", "vs_text"]


@dataclass
class Result:
    case: str
    family: str
    n: int
    method: str
    ms: float | None
    gflops: float | None = None
    matmul_frac: float | None = None
    peak_mib: float | None = None
    gbps: float | None = None
    bw_frac: float | None = None
    vs: dict[str, float] = field(default_factory=dict)
    note: str = ""
    ms_spread: list[float] | None = None
    vs_noise: dict[str, bool] = field(default_factory=dict)
    matmul_gflops: float | None = None  # the machine's matmul rate in the case's dtype: gflops' limit


def cases(kind: str = "quick") -> list[Case]:
    """The fixed suite: ``"full"`` (up to 32K tokens), ``"quick"`` (1-2 minutes) or ``"tiny"`` (smoke)."""
    if kind not in ("full", "quick", "tiny"):
        raise ValueError(f"suite kind must be 'full', 'quick' or 'tiny', got {kind!r}")
    full, tiny = kind == "full", kind == "tiny"
    ns = [1024, 2048, 4096, 8192, 16384] if full else [128] if tiny else [1024, 2048, 4096]
    big = 16384 if full else 256 if tiny else 4096
    out = [Case("dense", "dense", n, mask="none") for n in ns]
    out += [Case("causal", "causal", n, mask="causal") for n in ns]
    out += [Case("window 512", "window", n, mask="window:512") for n in ([16384, 32768] if full else [big])]
    out += [Case("8 causal documents", "documents", big, mask="docs:8")]
    out += [Case("causal + ALiBi", "alibi", 8192 if full else big // 2, mask="causal", bias="alibi")]
    out += [Case("prefix-LM 1/4", "prefix", 8192 if full else big, mask="prefix:4")]
    dec = [4096, 8192, 16384, 32768] if full else [512] if tiny else [4096, 16384]
    out += [Case("GQA decode", "decode", n, mask="causal", nq=1, hq=32, hkv=8, d=128) for n in dec]
    fb = 4096 if full else 256 if tiny else 1024
    out += [Case("fwd+bwd causal", "train-causal", fb, mask="causal", grad=True)]
    out += [Case("fwd+bwd window 256", "train-window", fb, mask="window:256", grad=True)]
    if full:
        out += [Case("memory: causal", "memory", 32768, mask="causal", methods=("auto", "tiled"))]
        out += [Case("memory: window 512", "memory", 32768, mask="window:512", methods=("auto", "tiled"))]
    if tiny:
        out = [c for i, c in enumerate(out) if c.family not in ("dense",) or i == 0]
    return out


# (case family, N, ours, peer, at most this ratio) - or peer "matmul"/"bandwidth": at least this fraction.
GOALS = [
    ("dense", 4096, "auto", "sdpa", 1.05),
    ("causal", 4096, "auto", "sdpa", 1.05),
    ("window", 16384, "auto", "sdpa", 0.2),
    ("window", 16384, "auto", "sdpa/block", 0.8),
    ("window", 16384, "auto", "matmul", 0.6),
    ("documents", 16384, "auto", "sdpa", 0.25),
    ("decode", 16384, "auto", "sdpa", 0.5),
    ("decode", 16384, "auto", "bandwidth", 0.5),
    ("train-causal", 4096, "auto", "sdpa", 1.2),
    ("train-window", 4096, "auto", "sdpa", 0.3),
]


def selected(case: Case, only: str | None) -> bool:
    """Whether ``--only`` picks ``case``: a comma-separated part equal to its family ("causal" is the
    plain causal family only), or a part that names no family and is in its name ("ALiBi")."""
    if only is None:
        return True
    families = {c.family for c in cases("full")}
    parts = [s.strip() for s in only.split(",") if s.strip()]
    return any(s == case.family or (s not in families and s in case.name) for s in parts)


def run_case(case: Case, repeats: int, rates: dict[str, float], flex: bool) -> list[Result]:
    """Time every method of ``case`` (:func:`multihead.bench.timing.measure_all`: interleaved samples,
    median and quartiles) and derive the ratios; a ratio whose spreads overlap is marked as noise."""
    torch.manual_seed(0)
    inputs = bm.make_inputs(case)
    flops = bm.useful_flops(case, inputs)
    methods, skipped, chosen = bm.methods(case, inputs, flex=flex)
    peaks = {name: bm.peak_extra_bytes(fn) / 2**20 for name, fn in methods.items()}  # also a warm-up
    # one more untimed call each: the threads and caches settle, whoever runs first is not penalised
    times = timing.measure_all(methods, min_samples=repeats, max_seconds=2.0)
    rows = []
    for name in methods:
        t = times[name]
        r = Result(case.name, case.family, case.n, name, None if t.median is None else t.median * 1e3)
        r.ms_spread = None if t.low is None or t.high is None else [t.low * 1e3, t.high * 1e3]
        r.peak_mib = peaks[name]
        r.gflops = t.rate(flops / 1e9)
        r.matmul_gflops = rates[str(case.dtype)]
        r.matmul_frac, why = _fraction(r.gflops, r.matmul_gflops, "matmul rate")
        if case.family == "decode":
            r.gbps = t.rate(bm.kv_bytes(inputs) / 1e9)
        r.note = "; ".join(x for x in (f"auto -> {chosen}" if name == "auto" else "", why, t.why) if x)
        rows.append(r)
    for r in rows:
        for o in rows:
            c = timing.compare(times[r.method], times[o.method])
            if o.method != r.method and c.ratio is not None:
                r.vs[o.method] = c.ratio
                r.vs_noise[o.method] = c.same
    rows += [Result(case.name, case.family, case.n, name, None, note=why) for name, why in skipped.items()]
    return rows


def _fraction(rate: float | None, limit: float, what: str) -> tuple[float | None, str]:
    """rate / limit, or None and why where the rate passes its limit (the probe or the count is wrong)."""
    try:
        return timing.fraction_of_limit(rate, limit), ""
    except ValueError:
        return None, f"above the {what}: probe or FLOP count wrong"


@dataclass(frozen=True)
class Verdict:
    """How a result's time compares with one peer's: ``ratio`` (its time / the peer's), ``same`` when
    the two spreads overlap; ``text`` is what the table cell and every sentence say."""

    peer: str
    ratio: float
    same: bool

    @property
    def text(self) -> str:
        return timing.SAME if self.same else f"{self.ratio:.2f}x"

    def slower(self, by: float) -> bool:
        """Slower than the peer by more than ``by`` times, outside the noise."""
        return not self.same and self.ratio > by


def verdicts(r: dict) -> list[Verdict]:
    """A result's comparison with each of its peers (:class:`Verdict`): the one reading of its ratios
    that the tables and the sentences under them share."""
    noise = r.get("vs_noise", {})
    return [Verdict(k, v, bool(noise.get(k))) for k, v in r.get("vs", {}).items()]


def vs_text(r: dict) -> str:
    """A result's time ratios to its peers: ``"sdpa 0.97x, eager same within noise"``."""
    return ", ".join(f"{v.peer} {v.text}" for v in verdicts(r))


def run(kind: str = "quick", *, repeats: int = 3, flex: bool = False, only: str | None = None,
        progress: Callable[[str], None] | None = None, suite: list[Case] | None = None) -> dict:  # fmt: skip
    """Run the suite; returns ``{"machine": ..., "results": [...], "goals": [...]}`` (JSON-ready).

    ``suite`` replaces :func:`cases` (``kind`` is then only a label), e.g. the study's short selection.

    Raises:
        ValueError: on an unknown suite kind, ``repeats < 1`` or an ``only`` filter that matches nothing.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    todo = [c for c in (cases(kind) if suite is None else suite) if selected(c, only)]
    if not todo:
        raise ValueError(f"no case matches {only!r}; cases are: {sorted({c.name for c in cases(kind)})}")
    rates = machine.machine_rates({str(c.dtype) for c in todo})
    results: list[Result] = []
    for c in todo:
        if progress is not None:
            progress(f"{c.name} N={c.n}")
        results += run_case(c, repeats, rates, flex)
        bm.add_bandwidth_ratio(results, rates["bandwidth"])
    rows = [asdict(r) for r in results]
    doc = {"machine": machine.machine(rates), "kind": kind, "results": rows, "goals": check_goals(rows)}
    return doc


def check_goals(results: list[dict]) -> list[dict]:
    """Each goal of :data:`GOALS` whose case ran: the measured ratio and whether it is met."""
    out = []
    for family, n, ours, peer, bound in GOALS:
        row = next(
            (r for r in results if r["family"] == family and r["n"] == n and r["method"] == ours), None
        )
        if row is None or row["ms"] is None:
            continue
        noise = False
        if peer in ("matmul", "bandwidth"):
            value = row["matmul_frac"] if peer == "matmul" else row.get("bw_frac")
            met = value is not None and value >= bound
        else:  # a ratio inside the noise counts as 1.0: neither a gain nor a loss
            value, noise = row["vs"].get(peer), row.get("vs_noise", {}).get(peer, False)
            met = value is not None and (1.0 if noise else value) <= bound
        goal = f"{ours} {'>=' if peer in ('matmul', 'bandwidth') else '<='} {bound}x {peer}"
        out.append(
            {
                "case": row["case"],
                "n": n,
                "goal": goal,
                "value": value,
                "within_noise": noise,
                "met": bool(met),
            }
        )
    return out


def to_json(doc: dict) -> str:
    return json.dumps(doc, indent=1)


# -- the command line: `multihead bench` ---------------------------------------------------------------
def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _pct(x: float | None) -> str:
    return _fmt(None if x is None else 100 * x, ".0f")


#: what to pass for a time or rate of the suite that is refused
MORE_REPEATS = "pass a larger `multihead bench --repeats`, or run on an idle machine"


def ms_text(r: dict) -> str:
    """A result's milliseconds with their spread, checked (:func:`multihead.bench.timing.check_figure`):
    "n/a (why; what to pass)" for a spread wider than 10x."""
    low, high = r.get("ms_spread") or (None, None)
    return timing.check_figure(r["ms"], low, high, fix=MORE_REPEATS).text()


def gflops_text(r: dict) -> str:
    """A result's useful GFLOP/s, checked against the machine's matmul rate in its dtype (``matmul_gflops``):
    a rate above it means the probe or the FLOP count is wrong, and reads "n/a (why; what to pass)"."""
    if r.get("gflops") is None:
        return "-"
    limit = r.get("matmul_gflops")
    return timing.check_figure(
        r["gflops"], limit=limit, limit_what="the matmul rate", fix=MORE_REPEATS
    ).text()


def table(doc: dict):
    """The results as a rich Table: one row per (case, N, method)."""
    from rich.table import Table

    m = doc["machine"]
    t = Table(
        title=f"multihead bench ({doc['kind']}): {m['cpu']}, {m['threads']} threads, torch {m['torch']}; "
        f"matmul {m['matmul_gflops']} GFLOP/s, bandwidth {m['bandwidth_gbps']} GB/s"
    )
    for col in (
        "case",
        "N",
        "method",
        "ms",
        "GFLOP/s",
        "% matmul",
        "GB/s",
        "peak MiB",
        "vs peers (time ratio)",
    ):
        t.add_column(col, justify="left" if col in ("case", "method", "vs peers (time ratio)") else "right")
    for r in doc["results"]:
        if r["ms"] is None:
            what = timing.TOO_SHORT if timing.TOO_SHORT in r["note"] else "skipped"
            t.add_row(r["case"], str(r["n"]), r["method"], what, "", "", "", "", r["note"])
            continue
        vs = vs_text(r) if r["method"] in ("auto", "tiled", "decode") else ""
        note = f" ({r['note']})" if r["note"] else ""
        t.add_row(
            r["case"], str(r["n"]), r["method"] + note, ms_text(r), gflops_text(r),
            _pct(r["matmul_frac"]), _fmt(r["gbps"], ".2f"), _fmt(r["peak_mib"], ".0f"), vs,
        )  # fmt: skip
    return t


def goals_table(doc: dict):
    """The goals whose case ran, as a rich Table; where none ran, one line saying why (no empty table)."""
    from rich.table import Table

    if not doc["goals"]:
        where = sorted({f"{family} N={n}" for family, n, *_ in GOALS})
        return f"goals of the CPU kernels: none checked, their cases did not run ({', '.join(where)})"
    t = Table(title="goals of the CPU kernels (ratios measured in this run)")
    for col in ("case", "N", "goal", "measured", "met"):
        t.add_column(col)
    for g in doc["goals"]:
        value = timing.SAME if g.get("within_noise") else _fmt(g["value"], ".3f")
        t.add_row(g["case"], str(g["n"]), g["goal"], value, "yes" if g["met"] else "NO")
    return t


def plot(doc: dict, path: str) -> None:
    """Time vs N per method, one panel per case family that has several N, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot_figure(doc, plt)
    with atomic_write(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def plot_figure(doc: dict, plt: Any) -> Any:
    """The matplotlib figure of :func:`plot`."""
    res = [r for r in doc["results"] if r["ms"] is not None]
    fams = [
        f
        for f in dict.fromkeys(r["family"] for r in res)
        if len({r["n"] for r in res if r["family"] == f}) > 1
    ]
    fams = fams or list(dict.fromkeys(r["family"] for r in res))[:1]
    fig, axes = plt.subplots(1, len(fams), figsize=(5 * len(fams), 4), squeeze=False)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {m: palette[i % len(palette)] for i, m in enumerate(dict.fromkeys(r["method"] for r in res))}
    for ax, fam in zip(axes[0], fams):
        rows = [r for r in res if r["family"] == fam]
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["n"], r["ms"]) for r in rows if r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method, color=colour[method])
        ax.set(xscale="log", yscale="log", xlabel="N", ylabel="ms", title=fam)
        ax.legend()
    fig.tight_layout()
    return fig
