"""The batch-1 products of a decode step per int8 kernel, against fp32 and bf16 ``F.linear`` and the
oneDNN-prepacked bf16 weight of ``mh.quant.Bf16Linear``.

    python benchmarks/int8_gemv.py --threads 1

The layer shapes of the 155M LLaMA preset (d 1024, kv width 256, d_ff 2816, vocab 32000): one token's
activation (1, I) times a weight (O, I). Kernels as in ``mh.quant.Int8Linear``: ``fbgemm`` (dynamic
int8 activations, ``torch.ops.quantized.linear_dynamic``), ``int8pack`` (weight-only,
``torch._weight_int8pack_mm``) with fp32 and with bf16 activations, and ``dequant`` is left out (it
rebuilds the float weight every call). Microseconds, the fastest of ``--reps`` calls after a warm-up;
the smaller weights stay in cache between calls, so read the ranking, not a bandwidth.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from multihead.bench import timing
from multihead.models import quant

SHAPES = ((1024, 1024), (1024, 256), (1024, 2816), (2816, 1024), (1024, 32000))  # (I, O)


def best_us(fn: Callable[[], object], reps: int) -> float:
    """The fastest sample of at least ``reps`` (:func:`multihead.bench.timing.measure`: calls batched
    until a sample is long enough for the clock), in microseconds per call; nan if too short to measure."""
    t = timing.measure(fn, min_samples=reps, warmup=3)
    return float("nan") if t.best is None else t.best * 1e6


def shape_row(i: int, o: int, reps: int) -> list[float]:
    """Microseconds of each kernel for a (1, i) activation and an (o, i) weight."""
    lin = torch.nn.Linear(i, o, bias=False)
    x = torch.randn(1, i)
    xb, wb = x.bfloat16(), lin.weight.bfloat16()
    q = quant.Int8Linear(lin, kernel="fbgemm")
    packed = quant.Bf16Linear(lin)  # plain F.linear (its why_not_packed says why) without oneDNN bf16
    w8, s32, s16 = q.weight_int8, q.scale, q.scale.bfloat16()
    calls: list[Callable[[], object]] = [
        lambda: F.linear(x, lin.weight),
        lambda: F.linear(xb, wb),
        lambda: packed(xb),
        lambda: q(x),
        lambda: q(xb),
        lambda: torch._weight_int8pack_mm(x, w8, s32),
        lambda: torch._weight_int8pack_mm(xb, w8, s16),
    ]
    return [best_us(fn, reps) for fn in calls]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, CPU capability {cpu}, {args.threads} thread(s), microseconds")
    print(f"bf16 prepacked: {quant.bf16_prepack_unavailable() or 'oneDNN prepacked'}")
    heads = (
        "fp32 F.linear",
        "bf16 F.linear",
        "bf16 prepacked",
        "fbgemm fp32 in",
        "fbgemm bf16 in",
        "int8pack fp32",
        "int8pack bf16",
    )
    print("| I x O | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(heads))
    torch.manual_seed(0)
    with torch.inference_mode():
        for i, o in SHAPES:
            row = shape_row(i, o, args.reps)
            print(f"| {i} x {o} | " + " | ".join(f"{us:.0f}" for us in row) + " |")


if __name__ == "__main__":
    main()
