"""Peak extra memory of exact causal attention: `tiled` (O(N)) against `matrix` (O(N^2) scores).

Each measurement runs in a fresh subprocess and reports the growth of the process's peak resident set
(VmHWM) over the inputs alone, so nothing else in the process pollutes it.

    python benchmarks/tiled_memory.py                      # N = 4K..32K for tiled, 4K..8K for matrix
    python benchmarks/tiled_memory.py --n 32768 --backends tiled
    python benchmarks/tiled_memory.py --n 32768 --backends auto --heads 8 --masks causal window:512 --grad

The time is that call's (``multihead.bench.timing.first_call``: more calls where one is too short for
the clock). ``--grad`` measures forward + backward (the inputs' gradients count as inputs: they are the
same size).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _peak_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _mask(spec: str):
    import multihead as mh

    if spec == "causal":
        return mh.causal()
    if spec.startswith("window:"):
        return mh.sliding_window(int(spec.split(":")[1]))
    raise ValueError(f"--masks takes causal or window:W, got {spec!r}")


def _child(
    n: int, backend: str, heads: int, head_dim: int, mask: str, grad: bool, clock=time.perf_counter
) -> None:
    import torch

    import multihead as mh
    from multihead.bench import timing

    torch.manual_seed(0)
    w = [torch.randn(1, heads, 256, head_dim, requires_grad=grad) for _ in range(3)]
    with torch.set_grad_enabled(grad):  # warm-up: lazy initialisation is not the call's memory
        o = mh.attention(*w, mask=_mask(mask), backend=backend)
        if grad:
            o.sum().backward()
    del w, o
    q, k, v = (torch.randn(1, heads, n, head_dim, requires_grad=grad) for _ in range(3))
    dout = torch.randn(1, heads, n, head_dim) if grad else None
    if grad:  # the gradients' buffers are inputs-sized: allocate them before the baseline
        for t in (q, k, v):
            t.grad = torch.zeros_like(t)

    def call():
        with torch.set_grad_enabled(grad):
            out = mh.attention(q, k, v, mask=_mask(mask), backend=backend)
            if grad:
                out.backward(dout)
        return out

    base = _peak_kib()
    out, t = timing.first_call(call, clock=clock)  # more calls only where one is too short to time
    extra = (_peak_kib() - base) * 1024
    scores = heads * n * n * 4
    print(
        json.dumps(
            {
                "n": n,
                "backend": backend,
                "mask": mask,
                "extra_bytes": extra,
                "score_matrix_bytes": scores,
                "seconds": t.median,  # None: too short to measure (why)
                "why": t.why,
                "finite": bool(torch.isfinite(out.detach()).all()),
            }
        )
    )


def time_cell(row: dict) -> str:
    """The row's seconds, or "too short to measure"."""
    return "too short to measure" if row["seconds"] is None else f"{row['seconds']:.3g} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="*", default=None)
    ap.add_argument("--backends", nargs="*", default=["tiled", "matrix"])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--masks", nargs="*", default=["causal"], help="causal and/or window:W")
    ap.add_argument("--grad", action="store_true", help="forward + backward")
    ap.add_argument("--child", nargs=3, metavar=("N", "BACKEND", "MASK"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(int(a.child[0]), a.child[1], a.heads, a.head_dim, a.child[2], a.grad)
        return
    rows = []
    for backend, mask in ((b, m) for m in a.masks for b in a.backends):
        ns = a.n or ([4096, 8192, 16384, 32768] if backend != "matrix" else [4096, 8192])
        for n in ns:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                str(n),
                backend,
                mask,
                *(["--grad"] if a.grad else []),
                "--heads",
                str(a.heads),
                "--head-dim",
                str(a.head_dim),
            ]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    what = "forward + backward" if a.grad else "forward (no grad)"
    print(f"B=1, H={a.heads}, D={a.head_dim}, fp32, {what}")
    print("| backend | mask | N | extra peak memory | N x N fp32 scores (all heads) | ratio | time |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        extra, scores = r["extra_bytes"], r["score_matrix_bytes"]
        print(
            f"| {r['backend']} | {r['mask']} | {r['n']} | {extra / 2**20:.1f} MiB | "
            f"{scores / 2**20:.0f} MiB | {extra / scores:.4f} | {time_cell(r)} |"
        )


if __name__ == "__main__":
    main()
