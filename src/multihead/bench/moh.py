"""What MixtureOfHeads saves at inference by skipping the heads a token did not choose.

``python -m multihead.bench.moh [--seq-len N] [--top-k K] ...`` times one eval forward of
:class:`~multihead.variants.MixtureOfHeads` with ``skip="eval"`` (routed heads on the chosen tokens only)
against ``skip="never"`` (every head on every token, then zero gates: the paper's reference code) on the
same weights and input (median of interleaved repeats), counts both calls' FLOPs with
``torch.utils.flop_counter`` (which does not see the CPU flash-attention kernel: on CPU the count covers
the projections only; use ``backend="matrix"`` in :func:`measure_moh` to count attention too), and
reports how far the two outputs differ.

Shape legend: B batch, N tokens, d = d_model.
"""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..core.masks import causal
from ..variants.moh import MixtureOfHeads, pack_rows
from . import timing

__all__ = ["measure_moh"]


def measure_moh(
    *,
    d_model: int = 512,
    n_heads: int = 8,
    n_shared: int = 2,
    top_k: int = 1,
    seq_len: int = 1024,
    batch: int = 2,
    repeats: int = 5,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    seed: int = 0,
) -> dict[str, Any]:
    """Median eval-forward time (ms) and FLOPs of MoH with and without head skipping, causal mask.

    Raises:
        ValueError: what MixtureOfHeads raises for the sizes.
    """
    torch.manual_seed(seed)
    m = MixtureOfHeads(d_model, n_heads, n_shared=n_shared, top_k=top_k, backend=backend)
    m = m.to(device=device, dtype=dtype).eval()
    x = torch.randn(batch, seq_len, d_model, device=device, dtype=dtype)  # (B, N, d)
    out: dict[str, Any] = {
        "d_model": d_model,
        "n_heads": n_heads,
        "n_shared": n_shared,
        "top_k": top_k,
        "seq_len": seq_len,
        "batch": batch,
        "device": device,
        "dtype": str(dtype).replace("torch.", ""),
    }
    results: dict[str, torch.Tensor] = {}
    flops: dict[str, int] = {}
    with torch.no_grad():
        out["packed_rows"] = pack_rows(m.route(x).chosen)[0].shape[-1]  # m: rows per routed head
        for skip in ("eval", "never"):
            m.skip = skip
            results[skip] = m(x, mask=causal())  # warm-up, and the output to compare
            with FlopCounterMode(display=False) as fc:
                m(x, mask=causal())
            flops[skip] = fc.get_total_flops()
        calls = {skip: functools.partial(_call, m, x, device, skip) for skip in ("eval", "never")}
        times = timing.measure_all(calls, min_samples=repeats)  # interleaved: load hits both alike
    for skip in ("eval", "never"):
        t = times[skip]
        out[f"{skip}_ms"] = None if t.median is None else round(1e3 * t.median, 2)
        out[f"{skip}_gflop"] = round(flops[skip] / 1e9, 3)
    out["max_abs_diff"] = float((results["eval"] - results["never"]).abs().max())
    ratio = timing.compare(times["never"], times["eval"])
    out["speedup"] = None if ratio.ratio is None else round(ratio.ratio, 2)
    out["speedup_within_noise"] = ratio.same
    return out


def _call(m: MixtureOfHeads, x: torch.Tensor, device: str, skip: str) -> None:
    """One causal forward with ``skip`` (synchronised on CUDA, so the time is the kernels')."""
    m.skip = skip
    m(x, mask=causal())
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-shared", type=int, default=2)
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--backend", default="auto", help="attention backend ('matrix' lets the FLOP counter see it)"
    )
    a = p.parse_args(argv)
    r = measure_moh(
        d_model=a.d_model,
        n_heads=a.n_heads,
        n_shared=a.n_shared,
        top_k=a.top_k,
        seq_len=a.seq_len,
        batch=a.batch,
        repeats=a.repeats,
        device=a.device,
        backend=a.backend,
    )
    print(json.dumps(r))


if __name__ == "__main__":
    main()
