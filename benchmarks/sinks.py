"""What attention sinks cost: forward + backward time and peak extra memory, tiled with and without sinks
and matrix with sinks (causal, B=1, H=8, D=64, float32, this CPU).

Each (backend, N) runs in a fresh subprocess: the peak memory is the growth of the process's peak
resident set (VmHWM) over the inputs and their gradient buffers during the first forward + backward
(after a small warm-up call), and the time is the median of at least ``--repeats`` further samples of
forward + backward (``multihead.bench.timing.measure``; a time ratio whose spreads overlap reads "same
within noise").

    python benchmarks/sinks.py                 # N = 1024 and 2048
    python benchmarks/sinks.py --n 4096 --repeats 3 --json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CASES = {  # name -> (backend, with sinks)
    "tiled+sinks": ("tiled", True),
    "tiled": ("tiled", False),
    "matrix+sinks": ("matrix", True),
}
B, H, D = 1, 8, 64


def _peak_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _child(case: str, n: int, repeats: int, clock=time.perf_counter) -> None:
    import torch

    import multihead as mh
    from multihead.bench import timing

    backend, with_sinks = CASES[case]
    torch.manual_seed(0)

    def step(q, k, v, s, dout):
        out = mh.attention(q, k, v, mask=mh.causal(), sinks=s, backend=backend)
        out.backward(dout)

    def leaves(length):
        q, k, v = (torch.randn(B, H, length, D, requires_grad=True) for _ in range(3))  # (B, H, N, D)
        s = torch.randn(H, requires_grad=True) if with_sinks else None
        for t in (q, k, v, s):  # the gradients' buffers are inputs-sized: allocate them before the baseline
            if t is not None:
                t.grad = torch.zeros_like(t)
        return q, k, v, s, torch.randn(B, H, length, D)

    step(*leaves(256))  # warm-up: lazy initialisation is not the call's memory
    args = leaves(n)
    base = _peak_kib()
    step(*args)
    extra = (_peak_kib() - base) * 1024
    t = timing.measure(lambda: step(*args), min_samples=repeats, warmup=0, clock=clock)
    row = {"case": case, "n": n, "seconds": t.median, "spread": [t.low, t.high], "samples": t.samples}
    print(json.dumps({**row, "inner": t.inner, "why": t.why, "extra_bytes": extra}))


def time_ratio(row: dict, ref: dict) -> str:
    """The row's time / the reference row's ("same within noise" where the spreads overlap)."""
    from multihead.bench import timing

    def back(r: dict) -> timing.Timing:
        return timing.Timing(r["seconds"], *r["spread"], r["samples"], r["inner"], r["why"])

    return str(timing.compare(back(row), back(ref)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 2048], help="sequence lengths")
    ap.add_argument(
        "--repeats", type=int, default=5, help="timed samples per case at least (more while under 0.2 s)"
    )
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--child", nargs=2, metavar=("CASE", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]), args.repeats)
        return
    rows = []
    for n in args.n:
        for case in CASES:
            cmd = [sys.executable, __file__, "--child", case, str(n), "--repeats", str(args.repeats)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"causal, B={B}, H={H}, D={D}, float32, forward + backward; median of >= {args.repeats} samples")
    print(f"{'N':>6} {'case':<13} {'ms':>9} {'peak MiB':>9} {'time / tiled':>13} {'mem / tiled':>12}")
    for n in args.n:
        ref = next(r for r in rows if r["n"] == n and r["case"] == "tiled")
        for r in (r for r in rows if r["n"] == n):
            ms = "too short" if r["seconds"] is None else f"{1e3 * r['seconds']:.1f}"
            m_ratio = r["extra_bytes"] / ref["extra_bytes"] if ref["extra_bytes"] else float("nan")
            print(
                f"{n:>6} {r['case']:<13} {ms:>9} {r['extra_bytes'] / 2**20:>9.1f} "
                f"{time_ratio(r, ref):>13} {m_ratio:>12.2f}"
            )


if __name__ == "__main__":
    main()
