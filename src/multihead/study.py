"""The study: the whole report on the embedded default workload (``multihead study``).

A study is the list :data:`SECTIONS` of functions ``section(ctx: StudyContext) -> Section``. Each returns
its data as a JSON-ready dict plus the tables and notes that render it, as markdown (``report.md``) or as
rich tables on a terminal. Later issues add a section by appending a function to the list.

Sections today:
    exactness  every backend against the float64 ``reference`` (gold), forward and gradient
    walk       the layer of seed 000 eq. 9.31-9.43 step by step: shapes, FLOPs, bytes, intensity
    kv_cache   KV-cache size of MHA vs GQA vs MQA
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table as RichTable

from . import cost
from .approx.report import approximations
from .biases import Bias, alibi
from .functional import _choose, attention, backends
from .heads.study_section import heads
from .masks import Mask, causal, document, padding, sliding_window
from .parallel.study_section import distributed
from .performance_section import performance
from .pretrained.study_section import minilm
from .problem import make_problem
from .report import Figure, draw, render_html, render_markdown_figures
from .variants.study_section import designs

__all__ = ["SECTIONS", "Section", "StudyContext", "Table", "human", "run_study", "walk_table"]


@dataclass(frozen=True)
class StudyContext:
    """What every section receives: the run's options and a hook to report progress within it."""

    quick: bool = True
    #: ``step(what, done)``: "now doing <what>, fraction ``done`` of this section finished" (progress bar)
    step: Callable[[str, float], None] = lambda what, done: None
    #: the report directory, where :meth:`figure` writes PNGs; None draws nothing
    out_dir: Path | None = None

    def figure(self, name: str, caption: str, plot: Callable[[Any], None], **kw: Any) -> list[Figure]:
        """``[Figure]`` of ``plot(ax)`` saved as ``out_dir/name.png``; ``[]`` without a report directory."""
        fig = draw(self.out_dir, name, caption, plot, **kw)
        return [] if fig is None else [fig]


# -- rendering ---------------------------------------------------------------------------------------
@dataclass
class Table:
    """A table of already-formatted cells; ``align`` has one letter per column, ``l`` or ``r``."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    align: str = ""

    def _align(self, i: int) -> str:
        return self.align[i] if i < len(self.align) else "l"

    def markdown(self) -> str:
        rule = ["---:" if self._align(i) == "r" else "---" for i in range(len(self.columns))]
        lines = [f"**{self.title}**", "", "| " + " | ".join(self.columns) + " |", "|" + "|".join(rule) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)

    def rich(self) -> RichTable:
        t = RichTable(title=self.title, title_justify="left")
        for i, c in enumerate(self.columns):
            t.add_column(c, justify="right" if self._align(i) == "r" else "left")
        for r in self.rows:
            t.add_row(*r)
        return t


@dataclass
class Section:
    """One section's result: ``data`` goes to ``--json``; ``tables`` and ``notes`` to the report."""

    key: str
    title: str
    data: dict
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)

    def markdown(self) -> str:
        figs = render_markdown_figures(self.figures)
        parts = [f"## {self.title}", *(t.markdown() for t in self.tables), *figs, *self.notes]
        return "\n\n".join(parts) + "\n"

    def print(self, console: Console) -> None:
        console.rule(self.title)
        for t in self.tables:
            console.print(t.rich())
        for n in self.notes:
            console.print(n, highlight=False)


def human(x: float) -> str:
    """``1234567 -> '1.23 M'`` (SI prefixes)."""
    for unit, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= unit:
            return f"{x / unit:.2f} {prefix}"
    return f"{x:.0f}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def walk_table(ops: list[cost.Op], title: str) -> Table:
    """The rows of :func:`multihead.cost.layer_walk` plus a total, as a :class:`Table`."""
    rows = [
        [o.eq, o.name, o.in_shape, o.out_shape, human(o.flops), human(o.bytes), f"{o.intensity:.2f}"]
        for o in [*ops, cost.total(ops)]
    ]
    cols = ["eq", "step", "input", "output", "FLOPs", "bytes", "FLOP/B"]
    return Table(title, cols, rows, align="llllrrr")


# -- section (a): exactness ----------------------------------------------------------------------------
def _cases(B: int, N: int, Hq: int) -> dict[str, tuple[Mask | None, Bias | None]]:
    """The mask/bias cases of the exactness section (mask, bias)."""
    docs = torch.arange(N) * 3 // N  # three packed documents
    return {
        "none": (None, None),
        "causal": (causal(), None),
        "sliding_window(64)": (sliding_window(64), None),
        "document+causal": (document(docs) & causal(), None),
        "padding": (padding([N - 37 * b for b in range(B)]), None),
        "alibi+causal": (causal(), alibi(Hq)),
    }


def _forward_backward(backend: str, q, k, v, dout, mask, bias) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and (dq, dk, dv) of one backend on leaf copies of q, k, v."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = attention(*leaves, mask=mask, bias=bias, backend=backend)
    assert isinstance(out, torch.Tensor)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), list(grads)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _ratio(err: float, base: float) -> float | None:
    return err / base if base > 0 else (0.0 if err == 0 else None)


def _check_case(q, k, v, dout, mask, bias) -> dict[str, tuple[float, float]]:
    """(output error, max gradient error) of every backend at q's dtype against the float64 reference."""
    q64, k64, v64, dout64 = (t.double() for t in (q, k, v, dout))
    gold_out, gold_grads = _forward_backward("reference", q64, k64, v64, dout64, mask, bias)
    errs = {}
    for b in backends():
        out, grads = _forward_backward(b, q, k, v, dout, mask, bias)
        errs[b] = (_err(out, gold_out), max(_err(g, h) for g, h in zip(grads, gold_grads)))
    return errs


def _rows(dtype: torch.dtype, case: str, auto: str, errs: dict[str, tuple[float, float]]) -> list[dict]:
    """One JSON row per backend; ratios are to the same-dtype ``matrix`` path's error."""
    base_out, base_grad = errs["matrix"]
    return [
        {
            "dtype": _dtype_name(dtype),
            "case": case,
            "backend": b,
            "auto": auto,
            "out_err": out_err,
            "grad_err": grad_err,
            "matrix_out_err": base_out,
            "matrix_grad_err": base_grad,
            "out_ratio": _ratio(out_err, base_out),
            "grad_ratio": _ratio(grad_err, base_grad),
        }
        for b, (out_err, grad_err) in errs.items()
    ]


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}"


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run small problems on one intra-op thread: a second one only adds synchronisation, and on a busy
    machine OpenMP's spin-waiting makes the float64 reference several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _exactness_rows(ctx: StudyContext, B: int, Hq: int, Hkv: int, N: int, D: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    dtypes = [torch.float32] if ctx.quick else [torch.float32, torch.bfloat16]
    cases = _cases(B, N, Hq)
    for i, dtype in enumerate(dtypes):
        q = torch.randn(B, Hq, N, D, generator=g).to(dtype)  # (B, Hq, N, D)
        k, v = (torch.randn(B, Hkv, N, D, generator=g).to(dtype) for _ in range(2))  # (B, Hkv, N, D)
        dout = torch.randn(B, Hq, N, D, generator=g).to(dtype)  # (B, Hq, N, D)
        for j, (name, (mask, bias)) in enumerate(cases.items()):
            ctx.step(f"{name}, {_dtype_name(dtype)}", (i * len(cases) + j) / (len(dtypes) * len(cases)))
            auto = _choose(make_problem(q, k, v, mask=mask, bias=bias))[0]
            with _one_thread():
                rows += _rows(dtype, name, auto, _check_case(q, k, v, dout, mask, bias))
    return rows


def _exactness_table(rows: list[dict]) -> Table:
    cells = [
        [
            r["dtype"],
            r["case"],
            r["auto"],
            r["backend"],
            f"{r['out_err']:.1e}",
            _fmt_ratio(r["out_ratio"]),
            f"{r['grad_err']:.1e}",
            _fmt_ratio(r["grad_ratio"]),
        ]
        for r in rows
    ]
    return Table(
        "max |error| against float64 reference; ratio = error / error of the same-dtype matrix path",
        ["dtype", "case", "auto", "backend", "out err", "out ratio", "grad err", "grad ratio"],
        cells,
        align="llllrrrr",
    )


def exactness(ctx: StudyContext) -> Section:
    """(a) Every backend against the float64 reference, forward and gradient, masks and ALiBi.

    Workload: B=2, Hq=8, Hkv=2 (GQA), N=256, D=64, fp32; ``quick=False`` adds the same in bf16.
    """
    B, Hq, Hkv, N, D = 2, 8, 2, 256, 64
    rows = _exactness_rows(ctx, B, Hq, Hkv, N, D)
    workload = {"B": B, "Hq": Hq, "Hkv": Hkv, "N": N, "D": D, "cases": list(_cases(B, N, Hq))}
    note = (
        "DESIGN.md's numerics rule (tests/numerics.py) bounds each backend's error by 2x (outputs) / "
        "3x (gradients) the matrix path's error, with a floor of 1e-5."
    )
    return Section(
        "exactness",
        "Exactness: every backend against the float64 reference",
        {"workload": workload, "rows": rows},
        [_exactness_table(rows)],
        [note],
    )


# -- section (b): the walk through eq. 9.31-9.43 -------------------------------------------------------
WALK_CONFIG: dict[str, Any] = {"d_model": 512, "n_heads": 8, "d_ff": 2048, "seq_len": 1024}  # original sizes


def _intensity(ops: list[cost.Op], name: str) -> float:
    return next(o.intensity for o in ops if o.name == name)


def _batching_table(dtype: torch.dtype) -> Table:
    """Decode intensity as the batch grows: weights are shared across requests, K/V caches are not."""
    names = ["Q = X W^Q", "S = Q K^T", "A = P V", "U = T3 W1 (FFN up)"]
    batches = [1, 8, 64]
    walks = {b: cost.layer_walk(**WALK_CONFIG, batch=b, dtype=dtype, phase="decode") for b in batches}
    rows = [[n, *(f"{_intensity(walks[b], n):.2f}" for b in batches)] for n in names]
    dt = _dtype_name(dtype)
    return Table(
        f"decode intensity (FLOP/B) by batch, {dt}",
        ["step", *(f"B={b}" for b in batches)],
        rows,
        align="lrrr",
    )


def walk(ctx: StudyContext) -> Section:
    """(b) The layer of eq. 9.31-9.43 at the original Transformer's sizes: prefill and batch-1 decode."""
    prefill = cost.layer_walk(**WALK_CONFIG, phase="prefill")
    decode = cost.layer_walk(**WALK_CONFIG, phase="decode")
    cfg = ", ".join(f"{k}={v}" for k, v in WALK_CONFIG.items())
    dec16 = cost.layer_walk(**WALK_CONFIG, phase="decode", dtype=torch.bfloat16)
    notes = [
        f"Batch-1 decode multiplies each weight matrix by one vector: the Q projection does "
        f"{_intensity(decode, 'Q = X W^Q'):.2f} FLOP/B at fp32 and {_intensity(dec16, 'Q = X W^Q'):.2f} "
        f"at bf16 (prefill: {_intensity(prefill, 'Q = X W^Q'):.0f}), far below any CPU or GPU's "
        "FLOP/byte ratio: decoding is memory-bound (seed 001 §2.3). Batching shares the weight reads "
        "and raises the projections' intensity; the attention matmuls read a private K/V cache per "
        "sequence and stay at 2 x Hq/Hkv FLOPs per cached element at any batch size.",
    ]
    tables = [
        walk_table(prefill, f"prefill, fp32, batch 1, N=1024 ({cfg})"),
        walk_table(decode, "decode one token after 1023 cached, fp32, batch 1"),
        _batching_table(torch.bfloat16),
    ]
    data = {
        "config": WALK_CONFIG,
        "prefill": [o.as_dict() for o in prefill],
        "decode": [o.as_dict() for o in decode],
    }
    roof_table, roof_data, roof_fig = _roofline(ctx)
    tables.append(roof_table)
    data["roofline"] = roof_data
    figures = ctx.figure(
        "walk-intensity",
        "Arithmetic intensity of each step, prefill (N=1024) vs batch-1 decode, fp32 (log scale): "
        "decode's projections sit near 0.5 FLOP/B, memory-bound on any machine.",
        partial(_plot_intensity, prefill, decode),
        size=(7.5, 4.2),
    )
    pts = roof_data["points"]
    mem1 = sum(p["bound"] == "memory" for p in pts["decode B=1"])
    comp64 = [p["name"] for p in pts["decode B=64"] if p["bound"] == "compute"]
    notes.append(
        f"Roofline: this machine measured {roof_data['peak_gflops']:.0f} GFLOP/s (fp32 matmul) and "
        f"{roof_data['bandwidth_gbps']:.1f} GB/s, a ridge at {roof_data['ridge']:.1f} FLOP/B: an op below it "
        f"is memory-bound. Decode at batch 1: {mem1} of {len(pts['decode B=1'])} ops memory-bound. At "
        f"batch 64, compute-bound: {', '.join(comp64) or 'none (the ridge is above 64 x 0.5 FLOP/B)'}; the "
        "attention matmuls S = Q K^T and A = P V stay near 0.5 FLOP/B at any batch (each sequence reads its "
        "own K/V cache)."
    )
    return Section("walk", "The layer, eq. 9.31-9.43, step by step", data, tables, notes, figures + roof_fig)


def _roofline(ctx: StudyContext) -> tuple[Table, dict, list[Figure]]:
    """The original Transformer's layer ops on this machine's measured roof: prefill, decode B=1, B=64."""
    roof = cost.measure_roof(torch.float32)
    n = WALK_CONFIG["seq_len"]
    calls = {
        "prefill B=1": cost.estimate("transformer-base", 1, n, phase="prefill", dtype=torch.float32),
        "decode B=1": cost.estimate("transformer-base", 1, n, phase="decode", dtype=torch.float32),
        "decode B=64": cost.estimate("transformer-base", 64, n, phase="decode", dtype=torch.float32),
    }
    points = {
        k: [p for p in c.roofline(roof.peak_flops, roof.bandwidth) if p.part == "layer" and p.flops > 0]
        for k, c in calls.items()
    }
    names = [p.name for p in points["decode B=1"]]
    rows = []
    for name in names:
        cells = [name]
        for key in calls:
            p = next(p for p in points[key] if p.name == name)
            cells.append(f"{p.intensity:.2f} ({p.bound[0]})")
        rows.append(cells)
    table = Table(
        f"roofline, fp32, N={n}: FLOP/B per op and the bound (m = memory, c = compute); ridge "
        f"{roof.ridge:.1f} FLOP/B",
        ["step", *calls],
        rows,
        align="lrrr",
    )
    data = {
        "peak_gflops": roof.peak_flops / 1e9,
        "bandwidth_gbps": roof.bandwidth / 1e9,
        "ridge": roof.ridge,
        "points": {k: [p.as_dict() for p in v] for k, v in points.items()},
    }
    figures: list[Figure] = []
    if ctx.out_dir is not None:
        ctx.out_dir.mkdir(parents=True, exist_ok=True)
        cost.plot_roofline(
            calls, roof, ctx.out_dir / "roofline.png", title="original Transformer layer, fp32"
        )
        figures.append(Figure("roofline.png", f"Roofline of this machine ({roof.label}) with every op."))
    return table, data, figures


def _plot_intensity(prefill: list[cost.Op], decode: list[cost.Op], ax: Any) -> None:
    names = [o.name for o in prefill]
    y = range(len(names))
    ax.barh([i + 0.2 for i in y], [max(o.intensity, 1e-3) for o in prefill], height=0.4, label="prefill")
    ax.barh([i - 0.2 for i in y], [max(o.intensity, 1e-3) for o in decode], height=0.4, label="decode")
    ax.set_yticks(list(y), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("FLOP per byte moved")
    ax.legend(loc="lower right")


# -- section (c): KV cache ---------------------------------------------------------------------------
KV_MODELS = {
    # name: (n_layers, n_heads, head_dim, seq_len, dtype)
    "original Transformer (6 layers, d 512, N 1024)": (6, 8, 64, 1024, torch.float32),
    "LLaMA-7B shape (32 layers, d 4096, 4096 tokens)": (32, 32, 128, 4096, torch.float16),
}


def kv_cache(ctx: StudyContext) -> Section:
    """(c) KV-cache bytes of MHA vs GQA vs MQA for one sequence (batch 1)."""
    rows, data = [], []
    for model, (layers, n_heads, hd, n, dtype) in KV_MODELS.items():
        for var in cost.compare_kv_heads(layers, 1, n, n_heads, hd, dtype):
            dt = _dtype_name(dtype)
            rows.append([model, var.name, str(var.n_kv_heads), dt, f"{var.mib:,.1f}", f"{var.vs_mha:.3f}"])
            data.append({"model": model, "dtype": dt, **asdict(var), "mib": var.mib})
    table = Table(
        "KV cache per sequence (K and V, all layers)",
        ["model", "variant", "kv heads", "dtype", "MiB", "vs MHA"],
        rows,
        align="llrlrr",
    )
    note = "The cache holds only the kv heads: GQA with Hkv kv heads stores Hkv/Hq of MHA's bytes."
    figures = ctx.figure(
        "kv-cache",
        "KV-cache MiB per sequence by kv-head count (log scale).",
        partial(_plot_kv, data),
    )
    return Section("kv_cache", "KV cache: MHA vs GQA vs MQA", {"rows": data}, [table], [note], figures)


def _plot_kv(data: list[dict], ax: Any) -> None:
    for model in dict.fromkeys(d["model"] for d in data):
        pts = [(d["n_kv_heads"], d["mib"]) for d in data if d["model"] == model]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=model)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("kv heads")
    ax.set_ylabel("MiB per sequence")
    ax.legend(fontsize=7)


SECTIONS: list[Callable[[StudyContext], Section]] = [
    exactness,
    walk,
    kv_cache,
    performance,
    minilm,
    approximations,
    heads,
    designs,
    distributed,
]


# -- the study ---------------------------------------------------------------------------------------
def select_sections(only: str | list[str] | None) -> list[Callable[[StudyContext], Section]]:
    """The sections named in ``only`` (comma-separated names or a list), in :data:`SECTIONS` order;
    all of them for None.

    Raises:
        ValueError: a name that is not a section's.
    """
    if only is None:
        return list(SECTIONS)
    names = [n.strip() for n in (only.split(",") if isinstance(only, str) else only) if n.strip()]
    known = [f.__name__ for f in SECTIONS]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown study section(s) {unknown or names!r}; choose from {','.join(known)}")
    return [f for f in SECTIONS if f.__name__ in names]


def run_sections(
    quick: bool = True,
    progress: bool = True,
    out_dir: Path | None = None,
    only: str | list[str] | None = None,
) -> list[Section]:
    """Run the sections of :data:`SECTIONS` (or those in ``only``) in order, with a progress bar on
    stderr; figures go to ``out_dir`` (none are drawn without it).

    Raises:
        ValueError: an unknown name in ``only``.
    """
    chosen = select_sections(only)
    results = []
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())  # no ETA: sections differ
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=not progress) as bar:
        task = bar.add_task("study", total=len(chosen))
        for i, section in enumerate(chosen):
            name = section.__name__
            bar.update(task, description=f"study: {name}", completed=i)
            step = partial(_describe, bar, task, name, i)
            results.append(section(StudyContext(quick, step, out_dir)))
        bar.update(task, completed=len(chosen))
    return results


def _describe(bar: Progress, task: TaskID, section: str, index: int, what: str, done: float) -> None:
    bar.update(task, description=f"study: {section}: {what}", completed=index + done)


def render_markdown(sections: list[Section], quick: bool) -> str:
    """The whole report as markdown."""
    from . import __version__

    head = (
        f"# multihead study ({'quick' if quick else 'full'})\n\nmultihead {__version__}, "
        f"torch {torch.__version__}\n"
    )
    return "\n".join([head, *(s.markdown() for s in sections)])


def run_study(
    quick: bool = True,
    out_dir: str | Path | None = None,
    progress: bool = True,
    console: Console | None = None,
    only: str | list[str] | None = None,
) -> dict:
    """Run the study and return its data: ``{"quick", "versions", "sections": {key: data}}``.

    Args:
        quick: the default workload only (seconds); False adds the bf16 exactness run.
        out_dir: when given, write ``out_dir/report.md``, ``out_dir/report.html`` and the figures' PNGs
            (the directory is created if missing).
        progress: show a progress bar on stderr.
        console: when given, print each section's tables to it.
        only: run only these sections (names as in :data:`SECTIONS`, comma-separated or a list).

    Raises:
        OSError: if ``out_dir`` cannot be created or written.
        ValueError: an unknown section name in ``only``.
    """
    from . import __version__

    select_sections(only)  # fail on a bad name before any work
    out = None if out_dir is None else Path(out_dir)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)  # fail before the work, not after
    sections = run_sections(quick, progress, out, only)
    report: dict = {
        "quick": quick,
        "versions": {"multihead": __version__, "torch": torch.__version__},
        "sections": {s.key: s.data for s in sections},
    }
    if out is not None:
        (out / "report.md").write_text(render_markdown(sections, quick))
        title = f"multihead study ({'quick' if quick else 'full'})"
        sub = f"multihead {__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads"
        (out / "report.html").write_text(render_html(sections, title, sub))
        report["report"] = str(out / "report.md")
        report["html"] = str(out / "report.html")
        report["figures"] = [str(out / f.file) for s in sections for f in s.figures]
    if console is not None:
        for s in sections:
            s.print(console)
    return report
