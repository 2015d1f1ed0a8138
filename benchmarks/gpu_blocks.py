"""Time the ``triton`` backend's block settings on one GPU: which tile sizes, warps and pipeline stages to
make the defaults (``multihead.backends.triton.launch._blocks``).

    python benchmarks/gpu_blocks.py                    # B=1, H=16, N=16384, D=128, bf16; about a minute
    python benchmarks/gpu_blocks.py --n 4096 --repeats 5
    TRITON_INTERPRET=1 python benchmarks/gpu_blocks.py --device cpu --small   # a smoke test

Each forward setting is timed forward-only, each backward setting forward+backward with the default
forward, on causal, window 1024 and 8 causal documents; the first row of each group is the current
default, and every time is printed as a ratio to it (above 1 = faster than the default). A setting that
fails to compile or launch (out of shared memory, say) is reported, not fatal. Register spills per
setting can be read without a GPU by compiling the kernels for ``sm_90`` with ``triton.compile``.

Shape legend: B batch, H heads, N tokens, D head dim; blocks are (query rows, keys) per tile.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gpu_timing import warm_ms

import multihead as mh
from multihead.backends.triton import launch
from multihead.backends.triton.plan import clear_cache

# (forward blocks, warps, stages); the first is the default for head dims <= 128. The second is the
# earlier default (128 x 64, 8 warps), kept so that a run shows the change's ratio again.
FORWARD = [((64, 64), 4, 3), ((128, 64), 8, 3), ((64, 64), 4, 4), ((64, 128), 4, 3), ((128, 128), 8, 3)]
# (dK/dV blocks, dQ blocks, warps, stages); the first is the default for head dims <= 128, the second
# the earlier one.
BACKWARD = [
    ((64, 64), (64, 64), 4, 2),
    ((64, 64), (64, 64), 8, 2),
    ((64, 64), (64, 64), 4, 3),
    ((64, 32), (64, 64), 4, 2),  # dK/dV over 32 keys: 40 bytes of spills a thread on sm_90, not 168
    ((64, 64), (128, 32), 4, 2),
]


def settings(fwd: tuple, bwd: tuple) -> dict:
    (fb, fw, fs), (kb, qb, bw, bs) = fwd, bwd
    return dict(
        fwd_blocks=fb, fwd_warps=fw, fwd_stages=fs, dkdv_blocks=kb, dq_blocks=qb, bwd_warps=bw, bwd_stages=bs
    )


def use(s: dict) -> None:
    """Make every new launch use ``s`` (the plan cache is cleared: plans are per block size anyway)."""
    launch._blocks = lambda *args: dict(s)  # type: ignore[assignment]
    clear_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="toy sizes, interpreter-sized blocks")
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    B, H, N, D, W = (1, 2, 128, 16, 32) if args.small else (1, 16, args.n, 128, 1024)
    forward, backward = FORWARD, BACKWARD
    if args.small:  # the interpreter: two cheap settings each, small tiles
        forward = [((32, 16), 4, 1), ((16, 32), 4, 1)]
        backward = [((16, 32), (16, 16), 4, 1), ((32, 16), (32, 16), 4, 1)]
    g = torch.Generator(dev).manual_seed(0)
    dtype = torch.bfloat16
    q, k, v, do = (torch.randn(B, H, N, D, device=dev, dtype=dtype, generator=g) for _ in range(4))
    ids = torch.arange(N, device=dev) * 8 // N  # (N,) eight equal documents
    masks = {
        "causal": mh.causal(),
        f"window {W}": mh.sliding_window(W),
        "8 documents": mh.document(ids) & mh.causal(),
    }
    rows = []

    def time_it(mask, grad: bool) -> float | str:
        qq, kk, vv = (t.detach().requires_grad_(grad) for t in (q, k, v))

        def fn():
            if not grad:
                with torch.no_grad():
                    return mh.attention(qq, kk, vv, mask=mask, backend="triton")
            return torch.autograd.grad(
                mh.attention(qq, kk, vv, mask=mask, backend="triton"), (qq, kk, vv), do
            )

        try:
            fn()  # compile and plan outside the timing
            ms = warm_ms(fn, dev, args.repeats)
            return "too short" if ms is None else ms
        except Exception as e:  # compile or launch failures are results here
            return f"{type(e).__name__}: {str(e)[:120]}"

    for part, grid in (("forward", forward), ("backward", backward)):
        for name, mask in masks.items():
            base = None
            for i, setting in enumerate(grid):
                fwd = setting if part == "forward" else forward[0]
                use(settings(fwd=fwd, bwd=setting if part == "backward" else backward[0]))
                t = time_it(mask, grad=part == "backward")
                if i == 0 and isinstance(t, float):
                    base = t
                ratio = base / t if isinstance(t, float) and base else None
                row = {"part": part, "mask": name, "setting": str(setting), "ms": t, "vs default": ratio}
                rows.append(row)
                shown = f"{t:.3f} ms" if isinstance(t, float) else t
                print(
                    f"{part:8s} {name:12s} {setting!s:34s} {shown}" + (f"  {ratio:.2f}x" if ratio else ""),
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps({"device": str(dev), "N": N, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
