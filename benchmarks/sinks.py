"""What attention sinks cost: forward + backward time and peak extra memory, tiled with and without sinks
and matrix with sinks (causal, B=1, H=8, D=64, float32, this CPU).

Each (backend, N) runs in a fresh subprocess: the peak memory is the growth of the process's peak
resident set (VmHWM) over the inputs and their gradient buffers during the first forward + backward
(after a small warm-up call), and the time is the median of ``--repeats`` further forward + backward
calls.

    python benchmarks/sinks.py                 # N = 1024 and 2048
    python benchmarks/sinks.py --n 4096 --repeats 3 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def _child(case: str, n: int, repeats: int) -> None:
    import torch

    import multihead as mh

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
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(*args)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"case": case, "n": n, "seconds": statistics.median(times), "extra_bytes": extra}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 2048], help="sequence lengths")
    ap.add_argument("--repeats", type=int, default=5, help="timed forward + backward calls per case")
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
    print(f"causal, B={B}, H={H}, D={D}, float32, forward + backward; median of {args.repeats}")
    print(f"{'N':>6} {'case':<13} {'ms':>9} {'peak MiB':>9} {'time / tiled':>13} {'mem / tiled':>12}")
    for n in args.n:
        ref = next(r for r in rows if r["n"] == n and r["case"] == "tiled")
        for r in (r for r in rows if r["n"] == n):
            t_ratio = r["seconds"] / ref["seconds"]
            m_ratio = r["extra_bytes"] / ref["extra_bytes"] if ref["extra_bytes"] else float("nan")
            print(
                f"{n:>6} {r['case']:<13} {1e3 * r['seconds']:>9.1f} {r['extra_bytes'] / 2**20:>9.1f} "
                f"{t_ratio:>13.2f} {m_ratio:>12.2f}"
            )


if __name__ == "__main__":
    main()
