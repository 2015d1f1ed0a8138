"""Forward and decode speed of one attention layer: MHA vs output-gated vs differential attention.

    python benchmarks/designs_speed.py                 # d_model 256, 8 heads, N 512, batch 4, fp32 CPU
    python benchmarks/designs_speed.py --json          # the same as one JSON object

All designs are built at the same d_model and head count (same q/k/v/o projections; the output gate
adds W_g, d x Hq*D elementwise or d x Hq headwise; differential attention pairs the 8 heads into 4
differential heads with 2D-wide values), causal, rotary, ``backend="auto"``.

    forward   one causal self-attention pass over (batch, N, d_model) without autograd: batch*N / seconds
    decode    prefill N tokens into a KVCache, then ``--steps`` one-token steps: batch*steps / seconds

Each figure is the median of at least ``--repeats`` samples, each long enough for the clock (or "too
short to measure"), the designs interleaved so that a busy machine slows them alike; a ratio to MHA
inside the spread reads "same within noise".
"""

from __future__ import annotations

import argparse
import json
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


def forward_call(m: torch.nn.Module, x: torch.Tensor) -> Callable[[], object]:
    """One causal self-attention pass over ``x`` (B, N, d)."""
    return lambda: m(x, mask=mh.causal())


def decode_call(
    m: torch.nn.Module, x: torch.Tensor, steps: int, n_kv: int, head_dim: int
) -> Callable[[], None]:
    """``steps`` one-token steps after an N-token prefill of ``x`` (B, N, d): the prefill runs once, here;
    every call rewinds the cache to it (its storage is kept), so the calls can repeat."""
    B, N, _ = x.shape
    cache = mh.KVCache(B, n_kv, head_dim, N + steps)
    m(x, mask=mh.causal(), cache=cache)  # prefill (not timed)
    tokens = x[:, -1:]  # (B, 1, d): any input; the cost does not depend on it

    def steps_after_prefill() -> None:
        cache.reset()
        cache.advance(N)  # back to the prefill's end: the same positions, the same work every call
        for _ in range(steps):
            m(tokens, mask=mh.causal(), cache=cache)

    return steps_after_prefill


def timings(
    modules: dict[str, torch.nn.Module],
    x: torch.Tensor,
    steps: int,
    heads: int,
    repeats: int,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict[str, timing.Timing], dict[str, timing.Timing]]:
    """(forward, decode) :class:`~multihead.bench.timing.Timing` per design: interleaved samples, each
    long enough for ``clock`` (or "too short to measure"), median and spread."""
    hd = x.shape[-1] // heads
    options = {"min_samples": repeats, "clock": clock, "resolution": timing.clock_resolution(clock)}
    with torch.no_grad():
        fwd = timing.measure_all({k: forward_call(m, x) for k, m in modules.items()}, **options)
        dec = timing.measure_all(
            {k: decode_call(m, x, steps, heads, hd) for k, m in modules.items()}, **options
        )
    return fwd, dec


def _vs(t: timing.Timing, base: timing.Timing) -> str:
    """Rate ratio to MHA (MHA's time / this one's), "same within noise" or "too short to measure"."""
    return str(timing.compare(base, t))


def _rate(t: timing.Timing, work: float) -> str:
    r = t.rate(work)
    return timing.TOO_SHORT if r is None else f"{r:,.0f}"


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
    fwd, dec = timings(modules, x, args.steps, h, args.repeats)
    rows = {
        name: {
            "params": sum(p.numel() for p in modules[name].parameters()),
            "forward_tokens_per_s": fwd[name].rate(args.batch * args.n),
            "forward_ms_spread": None
            if fwd[name].low is None
            else [1e3 * fwd[name].low, 1e3 * fwd[name].high],
            "decode_tokens_per_s": dec[name].rate(args.batch * args.steps),
            "why_no_rate": fwd[name].why or dec[name].why,
        }
        for name in modules
    }
    setup = {k: getattr(args, k) for k in ("d_model", "heads", "n", "batch", "steps", "repeats")}
    result = {"setup": {**setup, "dtype": "float32", "threads": torch.get_num_threads()}, "designs": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    print(
        f"d_model {d}, {h} heads, N {args.n}, batch {args.batch}, decode {args.steps} steps after an "
        f"{args.n}-token prefill, float32 CPU, {torch.get_num_threads()} threads, median of at least "
        f"{args.repeats} interleaved samples; a ratio inside the spread reads {timing.SAME!r}\n"
    )
    print("| design | attention params | forward tokens/s | vs MHA | decode tokens/s | vs MHA |")
    print("|---|---:|---:|---:|---:|---:|")
    tokens = (args.batch * args.n, args.batch * args.steps)
    for name, r in rows.items():
        print(
            f"| {name} | {r['params']:,} | {_rate(fwd[name], tokens[0])} | {_vs(fwd[name], fwd['mha'])} | "
            f"{_rate(dec[name], tokens[1])} | {_vs(dec[name], dec['mha'])} |"
        )
    return result


if __name__ == "__main__":
    main()
