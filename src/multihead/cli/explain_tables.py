"""The tables of ``multihead explain --preset``: a :class:`multihead.cost.Cost` as the shape walk, the
cost table (optionally on a roofline), and its memory - :class:`multihead.study.context.Table` objects, so the
study's report can print them as markdown too.
"""

from __future__ import annotations

from .. import cost
from ..study.context import Table, human

__all__ = ["call_line", "cost_table", "memory_table", "roof_lines", "shape_table"]


def _part(o: cost.Op) -> str:
    return o.part if o.count == 1 else f"{o.part} x{o.count}"


def _bytes(n: float) -> str:
    """Binary units: ``3 * 2**30 -> '3.00 GiB'``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"


def call_line(c: cost.Cost) -> str:
    """``decode: B=1, Nq=1 new row per sequence against Nk=2048 keys (2047 cached), float16``."""
    k = c.call
    rows = "row" if k.Nq == 1 else "rows"
    dtype = str(k.dtype).replace("torch.", "")
    return (
        f"{k.phase}: B={k.batch}, Nq={k.Nq} new {rows} per sequence against Nk={k.Nk} keys "
        f"({k.cached} cached), {dtype}"
    )


def shape_table(c: cost.Cost) -> Table:
    """Every step's input and output shapes, in forward order (a layer's steps once, with their count)."""
    rows = [[_part(o), o.eq, o.name, o.in_shape, o.out_shape] for o in c.rows]
    return Table(f"shape walk: {c.model.name}", ["part", "eq", "step", "input", "output"], rows)


def cost_table(c: cost.Cost, roof: cost.Roof | None = None) -> Table:
    """FLOPs and bytes of every step over all its runs, its intensity, and with a roof its bound and share
    of the roofline time."""
    cols = ["part", "step", "FLOPs", "bytes", "FLOP/B"]
    points = cost.roofline(c.rows, roof) if roof is not None else []
    seconds = sum(p.seconds for p in points) or 1.0
    rows = []
    for i, o in enumerate(c.rows):
        row = [_part(o), o.name, human(o.flops * o.count), _bytes(o.bytes * o.count), f"{o.intensity:.2f}"]
        if points:
            p = points[i]
            row += [p.bound, f"{p.attainable / 1e9:,.1f}", f"{100 * p.seconds / seconds:.1f}"]
        rows.append(row)
    t = c.total()
    rows.append(["", "total", human(t.flops), _bytes(t.bytes), f"{t.intensity:.2f}"])
    if points:
        cols += ["bound", "GFLOP/s", "% time"]
        rows[-1] += ["", "", "100.0"]
    title = f"cost of one forward call (eq. (1)-(13)), {c.call.phase}, matmuls {human(c.matmul_flops)}FLOP"
    return Table(title, cols, rows, align="llrrrlrr")


def memory_table(c: cost.Cost) -> Table:
    """Weights, activations, attention scores and KV cache, with what each figure counts."""
    notes = {
        "weights": f"{c.params / 1e6:,.1f}M parameters",
        "activations": "residual stream + widest intermediate, held at once",
        "attention scores": "one (B, Hq, Nq, Nk) matrix of eq. (2); fused kernels never hold it",
        "KV cache": f"K and V of {c.model.n_layers} layers for the tokens held after the call",
    }
    rows = [[name, _bytes(n), notes[name]] for name, n in c.memory().items()]
    return Table("memory", ["what", "size", "counts"], rows, align="lrl")


def roof_lines(c: cost.Cost, roof: cost.Roof | None) -> list[str]:
    """The roof and whether this call is memory- or compute-bound (docs/equations.md, section 6)."""
    t = c.total()
    lines = [
        f"total {human(t.flops)}FLOP, {_bytes(t.bytes)} moved: {t.intensity:.2f} FLOP/B overall; matmuls "
        f"{100 * c.matmul_flops / max(t.flops, 1):.1f}% of the FLOPs"
    ]
    if roof is None:
        lines.append("add --roof measure (this machine) or --roof GFLOPS:GBPS to place the ops on a roofline")
        return lines
    points = cost.roofline(c.rows, roof)
    memory = sum(p.seconds for p in points if p.bound == "memory")
    total = sum(p.seconds for p in points) or 1.0
    lines.append(
        f"roof: {roof.label} - {roof.peak_flops / 1e9:,.1f} GFLOP/s, {roof.bandwidth / 1e9:,.1f} GB/s, "
        f"ridge {roof.ridge:.1f} FLOP/B; roofline time >= {total * 1e3:,.3f} ms, "
        f"{100 * memory / total:.0f}% of it memory-bound"
    )
    return lines
