"""``python -m multihead.parallel``: check and measure the distributed paths, locally or under torchrun.

    python -m multihead.parallel                            # = check --nproc 2
    python -m multihead.parallel check --nproc 2           # ring + tensor parallel == one process?
    python -m multihead.parallel bench --world-sizes 1 2 4 --seq-len 16384
    torchrun --nproc-per-node 4 -m multihead.parallel check
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m multihead.parallel bench --seq-len 65536

Without torchrun the command starts its own local gloo processes (:func:`launch`). Under torchrun (the
RANK / WORLD_SIZE / MASTER_ADDR variables are set) every process is one rank: it joins the group from the
environment, NCCL with one GPU per process when CUDA is there, gloo otherwise, and rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..bench.distributed import (
    MASKS,
    bench_worker,
    render_distributed_bench,
    run_distributed_bench,
    summarise,
)
from .check import check_worker
from .launch import launch


def _is_torchrun() -> bool:
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _run_here(fn, cfg: dict[str, Any]) -> list[Any] | None:
    """Under torchrun: join the group from the environment, run ``fn`` on this rank, gather to rank 0."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        cfg = {**cfg, "device": f"cuda:{torch.cuda.current_device()}"}
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg["timeout"]))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = fn(rank, world, cfg)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        return every if rank == 0 else None
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m multihead.parallel", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command")
    chk = sub.add_parser("check", help="ring attention and tensor parallelism against one process")
    chk.add_argument("--nproc", type=int, default=2, help="local processes (ignored under torchrun)")
    bench = sub.add_parser("bench", help="per-rank memory, time and traffic of ring attention")
    bench.add_argument(
        "--world-sizes", type=int, nargs="+", default=[1, 2, 4], help="(ignored under torchrun)"
    )
    bench.add_argument("--seq-len", type=int, default=8192)
    bench.add_argument("--heads", type=int, default=2)
    bench.add_argument("--head-dim", type=int, default=64)
    bench.add_argument("--mask", choices=MASKS, default="causal")
    bench.add_argument("--layout", choices=("contiguous", "zigzag"), default=None)
    bench.add_argument("--backward", action="store_true")
    for p in (chk, bench):
        p.add_argument("--timeout", type=float, default=600.0, help="seconds per message / collective")
        p.add_argument("--json", action="store_true", help="print JSON")
    a = ap.parse_args(argv)
    if a.command is None:  # no arguments: the quick check on two local processes
        a = ap.parse_args(["check", *(argv or [])])
    if a.command == "check":
        cfg = {"timeout": a.timeout, "device": "cpu"}
        ranks = _run_here(check_worker, cfg) if _is_torchrun() else launch(check_worker, a.nproc, cfg)
        if ranks is None:
            return 0
        worst = {name: max(r[name] for r in ranks) for name in ranks[0]}
        ok = all(e < 1e-5 for e in worst.values())
        if a.json:
            print(json.dumps({"world_size": len(ranks), "max_errors": worst, "ok": ok}))
        else:
            for name, e in worst.items():
                print(f"{name:<28} max error {e:.2e}  {'ok' if e < 1e-5 else 'FAIL'}")
        return 0 if ok else 1
    if _is_torchrun():
        layout = a.layout or ("zigzag" if a.mask == "causal" else "contiguous")
        cfg = {
            "seq_len": a.seq_len,
            "heads": a.heads,
            "kv_heads": a.heads,
            "head_dim": a.head_dim,
            "mask": a.mask,
            "window": 256,
            "layout": layout,
            "backward": a.backward,
            "backend": "auto",
            "timeout": a.timeout,
            "dtype": "float32",
            "threads": torch.get_num_threads(),
            "device": "cpu",
        }
        ranks = _run_here(bench_worker, cfg)
        if ranks is None:
            return 0
        result = {"config": cfg, "rows": [summarise(len(ranks), ranks)]}
    else:
        result = run_distributed_bench(
            a.world_sizes,
            a.seq_len,
            heads=a.heads,
            head_dim=a.head_dim,
            mask=a.mask,
            layout=a.layout,
            backward=a.backward,
            timeout=a.timeout,
            progress=lambda s: print(s, file=sys.stderr),
        )
    print(json.dumps(result, indent=1) if a.json else render_distributed_bench(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
