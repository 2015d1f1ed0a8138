"""Peak extra memory of exact causal attention: `tiled` (O(N)) against `matrix` (O(N^2) scores).

Each measurement runs in a fresh subprocess and reports the growth of the process's peak resident set
(VmHWM) over the inputs alone, so nothing else in the process pollutes it.

    python benchmarks/tiled_memory.py                      # N = 4K..32K for tiled, 4K..8K for matrix
    python benchmarks/tiled_memory.py --n 32768 --backends tiled
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


def _child(n: int, backend: str, heads: int, head_dim: int) -> None:
    import torch

    import multihead as mh

    torch.manual_seed(0)
    q = torch.randn(1, heads, n, head_dim)
    k = torch.randn(1, heads, n, head_dim)
    v = torch.randn(1, heads, n, head_dim)
    base = _peak_kib()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = mh.attention(q, k, v, mask=mh.causal(), backend=backend)
    dt = time.perf_counter() - t0
    extra = (_peak_kib() - base) * 1024
    scores = heads * n * n * 4
    print(
        json.dumps(
            {
                "n": n,
                "backend": backend,
                "extra_bytes": extra,
                "score_matrix_bytes": scores,
                "seconds": dt,
                "finite": bool(torch.isfinite(out).all()),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="*", default=None)
    ap.add_argument("--backends", nargs="*", default=["tiled", "matrix"])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--child", nargs=2, metavar=("N", "BACKEND"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(int(a.child[0]), a.child[1], a.heads, a.head_dim)
        return
    rows = []
    for backend in a.backends:
        ns = a.n or ([4096, 8192, 16384, 32768] if backend == "tiled" else [4096, 8192])
        for n in ns:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                str(n),
                backend,
                "--heads",
                str(a.heads),
                "--head-dim",
                str(a.head_dim),
            ]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(f"causal attention, B=1, H={a.heads}, D={a.head_dim}, fp32, forward (no grad)")
    print("| backend | N | extra peak memory | one N x N fp32 score matrix (all heads) | ratio | time |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        extra, scores = r["extra_bytes"], r["score_matrix_bytes"]
        print(
            f"| {r['backend']} | {r['n']} | {extra / 2**20:.1f} MiB | {scores / 2**20:.0f} MiB | "
            f"{extra / scores:.4f} | {r['seconds']:.2f} s |"
        )


if __name__ == "__main__":
    main()
