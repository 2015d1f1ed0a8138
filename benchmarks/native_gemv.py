"""Batch-1 matrix-vector products that no cache holds: read bandwidth of each kernel against a plain sum.

    python benchmarks/native_gemv.py                 # one thread, 40 weights of 2816 x 1024, 5 rounds
    python benchmarks/native_gemv.py --threads 2 --json

A decode step multiplies every weight matrix by one vector, so its floor is the time to read the weights.
This script builds ``--count`` weights of ``--shape`` (together far larger than the caches), multiplies
them one after the other by one vector with each kernel, and reports GB/s of weights read, the best of at
least ``--rounds`` passes, next to a ``sum`` over a 256 MiB fp32 tensor (a pure streaming read, its
samples interleaved with the kernel's: ``multihead.bench.timing``; a kernel above the sum is refused, not
printed as over 100%), in fp32, bf16 and fp16. Kernels: ``F.linear`` (torch's own), oneDNN's prepacked
weight (``mh.quant.PackedLinear``, fp32 and bf16), and ``multihead.native.gemv``. Every kernel's result is
checked against ``F.linear`` first. The int8 rows: ``multihead.native.int8.gemv_q8`` with one scale per
output channel and per group of 64 and 32 inputs (the bytes read count the fp32 scales; the activation's
rounding to int8 is inside the timed call), checked against ``F.linear`` on the dequantized weight.
Weights and the probe lie in 2 MiB pages (``multihead.native.hugepages``), as
``quantize(kernel="native")`` keeps a model's weights.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from multihead import native
from multihead.bench import timing
from multihead.models import quant
from multihead.models.int8_gemv_linear import dequantize_groups, quantize_groups
from multihead.native import hugepages
from multihead.native import int8 as native_int8


def rates(fn, nbytes: int, probe: torch.Tensor, rounds: int, clock=time.perf_counter) -> dict:
    """GB/s of ``fn`` reading ``nbytes`` and of ``probe.sum()`` (the streaming read it is held to),
    samples interleaved (:func:`multihead.bench.timing.measure_all`, at least ``rounds``), the fastest
    sample of each: ``{"GBps", "sum_GBps", "of_sum"}``; a rate None where too short to measure and
    ``of_sum`` the refusal where the kernel beats the sum (then the byte count or the probe is wrong)."""
    t = timing.measure_all({"kernel": fn, "sum": probe.sum}, min_samples=rounds, clock=clock)
    rate, limit = (
        None if x.best is None else n / x.best / 1e9
        for x, n in ((t["kernel"], nbytes), (t["sum"], probe.numel() * 4))
    )
    return {"GBps": rate, "sum_GBps": limit, "of_sum": timing.limit_text(rate, limit)}


def _rows_of(dtype: torch.dtype, count: int, rows: int, cols: int, rounds: int, probe) -> list[dict]:
    """One row per kernel for ``dtype``: its GB/s and the sum's, measured in turn."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(rows, cols, generator=g).to(dtype) for _ in range(count)]  # count x (O, I)
    hugepages.move_to_huge_pages(ws)  # as quantize(kernel="native") holds them
    x = torch.randn(cols, generator=g).to(dtype)  # (I,)
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    packed = []
    if dtype in quant.PACKED_DTYPES and quant.prepack_unavailable(dtype) is None:
        for w in ws:
            lin = torch.nn.Linear(cols, rows, bias=False).to(dtype)
            lin.weight.data = w
            packed.append(quant.PackedLinear(lin, dtype))
    kernels = {"F.linear": lambda i: F.linear(x, ws[i])}
    if packed:
        kernels["oneDNN packed"] = lambda i: packed[i](x.view(1, cols)).view(rows)
    if dtype in native.dtypes():
        kernels["native"] = lambda i: native.gemv(ws[i], x)
    out = []
    with torch.inference_mode():
        want = F.linear(x, ws[0]).float()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for name, k in kernels.items():
            assert float((k(0).float() - want).abs().max()) <= tol * float(want.abs().max()), name
        for name, k in kernels.items():
            r = rates(lambda k=k: [k(i) for i in range(count)], nbytes, probe, rounds)
            out.append({"dtype": str(dtype).removeprefix("torch."), "kernel": name, **r})
    return out


def _int8_rows(count: int, rows: int, cols: int, rounds: int, probe) -> list[dict]:
    """One row per group size of the native int8 kernel: its GB/s (int8 weights and fp32 scales) and
    the sum's."""
    if native.unavailable() is not None:
        return []
    g = torch.Generator().manual_seed(0)
    x = torch.randn(cols, generator=g)  # (I,)
    out = []
    for group in (None, 64, 32):
        ws = [quantize_groups(torch.randn(rows, cols, generator=g), group) for _ in range(count)]
        hugepages.move_to_huge_pages(t for pair in ws for t in pair)
        nbytes = sum(w.numel() + s.numel() * 4 for w, s in ws)
        want = F.linear(x, dequantize_groups(*ws[0], group, torch.float32))  # (O,)
        got = native_int8.gemv_q8(*ws[0], x, None, group)  # (O,): x rounded to int8 per 32-block
        assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max()), group
        with torch.inference_mode():
            r = rates(
                lambda ws=ws, group=group: [native_int8.gemv_q8(w, s, x, None, group) for w, s in ws],
                nbytes,
                probe,
                rounds,
            )
        kernel = "native per-row" if group is None else f"native g{group}"
        out.append({"dtype": "int8", "kernel": kernel, **r})
    return out


def run(threads: int, count: int, rows: int, cols: int, rounds: int) -> dict:
    """GB/s of each kernel and of the sum; see the module docstring."""
    torch.set_num_threads(threads)
    probe = torch.ones(1 << 26)  # 256 MiB of fp32
    hugepages.move_to_huge_pages([probe])  # the limit: memory read with the fewest TLB misses
    found = [
        r
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
        for r in _rows_of(dtype, count, rows, cols, rounds, probe)
    ]
    found += _int8_rows(count, rows, cols, rounds, probe)
    return {"threads": threads, "count": count, "shape": [rows, cols], "rounds": rounds, "rows": found}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--count", type=int, default=40, help="weights (default 40)")
    p.add_argument("--shape", default="2816x1024", help="rows x columns of each weight")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    rows, cols = (int(v) for v in a.shape.split("x"))
    doc = run(a.threads, a.count, rows, cols, a.rounds)
    if a.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"{a.count} weights of {rows} x {cols}, {a.threads} thread(s), best of >= {a.rounds}")
    print(f"{'dtype':6s} {'kernel':14s} {'GB/s':>6s} {'sum GB/s':>9s} {'of sum':>7s}")
    for r in doc["rows"]:
        rate, limit = (timing.TOO_SHORT if v is None else f"{v:.1f}" for v in (r["GBps"], r["sum_GBps"]))
        print(f"{r['dtype']:6s} {r['kernel']:14s} {rate:>6s} {limit:>9s} {r['of_sum']:>7s}")


if __name__ == "__main__":
    main()
