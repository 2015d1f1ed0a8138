"""Forward and decode speed of one attention layer: MHA vs output-gated vs differential attention.

    python benchmarks/designs_speed.py                 # d_model 256, 8 heads, N 512, batch 4, fp32 CPU
    python benchmarks/designs_speed.py --json          # the same as one JSON object

All designs are built at the same d_model and head count (same q/k/v/o projections; the output gate
adds W_g, d x Hq*D elementwise or d x Hq headwise; differential attention pairs the 8 heads into 4
differential heads with 2D-wide values), causal, rotary, ``backend="auto"``.

    forward   one causal self-attention pass over (batch, N, d_model) without autograd: batch*N / seconds
    decode    prefill N tokens into a KVCache, then ``--steps`` one-token steps: batch*steps / seconds

Each figure is the median of ``--repeats`` runs, the designs interleaved within every repeat so that a
busy machine slows them alike.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch

import multihead as mh
from multihead import variants as V
from multihead.bench import timing


def designs(d: int, h: int) -> dict[str, Callable[[], torch.nn.Module]]:
    rot = mh.RotaryEmbedding(d // h)
    return {
        "mha": lambda: mh.MultiHeadAttention(d, h, rotary=rot, bias=False),
        "output_gated (elementwise)": lambda: V.OutputGatedAttention(
            d, h, gate="elementwise", rotary=rot, bias=False
        ),
        "output_gated (headwise)": lambda: V.OutputGatedAttention(
            d, h, gate="headwise", rotary=rot, bias=False
        ),
        "differential": lambda: V.DifferentialAttention(d, h, rotary=rot, bias=False),
    }


def forward_seconds(m: torch.nn.Module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    m(x, mask=mh.causal())
    return time.perf_counter() - start


def decode_seconds(m: torch.nn.Module, x: torch.Tensor, steps: int, n_kv: int, head_dim: int) -> float:
    B, N, _ = x.shape
    cache = mh.KVCache(B, n_kv, head_dim, N + steps)
    m(x, mask=mh.causal(), cache=cache)  # prefill (not timed)
    tokens = x[:, -1:]  # (B, 1, d): any input; the cost does not depend on it
    start = time.perf_counter()
    for _ in range(steps):
        m(tokens, mask=mh.causal(), cache=cache)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--n", type=int, default=512, help="tokens per sequence (and prefill length)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=64, help="decode steps after the prefill")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    d, h = args.d_model, args.heads
    modules = {name: make().eval() for name, make in designs(d, h).items()}
    x = torch.randn(args.batch, args.n, d)
    dec: dict[str, list[float]] = {n: [] for n in modules}
    with torch.no_grad():
        calls = {name: functools.partial(forward_seconds, m, x) for name, m in modules.items()}
        fwd = timing.measure_all(calls, min_samples=args.repeats)  # interleaved, median and spread
        for m in modules.values():  # warm-up
            decode_seconds(m, x, 2, h, d // h)
        for _ in range(args.repeats):  # each sample decodes args.steps tokens: long enough
            for name, m in modules.items():
                dec[name].append(decode_seconds(m, x, args.steps, h, d // h))
    rows = {
        name: {
            "params": sum(p.numel() for p in modules[name].parameters()),
            "forward_tokens_per_s": fwd[name].rate(args.batch * args.n),
            "forward_ms_spread": None
            if fwd[name].low is None
            else [1e3 * fwd[name].low, 1e3 * fwd[name].high],
            "decode_tokens_per_s": args.batch * args.steps / statistics.median(dec[name]),
        }
        for name in modules
    }
    setup = {k: getattr(args, k) for k in ("d_model", "heads", "n", "batch", "steps", "repeats")}
    result = {"setup": {**setup, "dtype": "float32", "threads": torch.get_num_threads()}, "designs": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    base = rows["mha"]
    print(
        f"d_model {d}, {h} heads, N {args.n}, batch {args.batch}, decode {args.steps} steps after an "
        f"{args.n}-token prefill, float32 CPU, {torch.get_num_threads()} threads, median of {args.repeats}\n"
    )
    print("| design | attention params | forward tokens/s | vs MHA | decode tokens/s | vs MHA |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        f, dd = r["forward_tokens_per_s"], r["decode_tokens_per_s"]
        print(
            f"| {name} | {r['params']:,} | {f:,.0f} | {f / base['forward_tokens_per_s']:.2f} | "
            f"{dd:,.0f} | {dd / base['decode_tokens_per_s']:.2f} |"
        )
    return result


if __name__ == "__main__":
    main()
