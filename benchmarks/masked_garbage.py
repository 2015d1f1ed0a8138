"""What clearing the keys a mask hides from every query costs (``multihead.core.dead_keys``): forward time
of ``mh.attention(backend="auto")`` with the clearing on and off, in the same run, interleaved.

Unmasked and causal calls should cost the same (the mask's structure says no key is dead: one function
call); a padding mask pays one ``torch.where`` over K and V: small next to a prefill, a large share of a
decode step, where the attention itself only reads K and V once (generate's own left-padding mask is
not cleared: the model writes its pad slots itself).

    python benchmarks/masked_garbage.py            # prints time(on) / time(off) per case
    python benchmarks/masked_garbage.py --repeats 50 --json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

import multihead as mh
import multihead.core.functional as functional
from multihead.bench import timing
from multihead.core.dead_keys import clear_dead_keys
from multihead.models.padding import TrailingKeyPadding

B, HQ, HKV, D = 1, 8, 2, 64


def _cases() -> dict[str, tuple]:
    torch.manual_seed(0)

    def qkv(nq, nk, b=B):
        return torch.randn(b, HQ, nq, D), torch.randn(b, HKV, nk, D), torch.randn(b, HKV, nk, D)

    lengths = [700, 1024, 300, 1024]
    real = torch.arange(1024)[None] >= 1024 - torch.tensor(lengths)[:, None]  # (4, 1024), left padding
    left_padded = TrailingKeyPadding(real)  # what generate builds for a left-padded batch
    return {
        "decode 1x1024, no mask": (*qkv(1, 1024), None),
        "prefill 512, causal": (*qkv(512, 512), mh.causal()),
        "prefill 1024, no mask": (*qkv(1024, 1024), None),
        "prefill 1024 x B=4, causal & padding": (*qkv(1024, 1024, 4), mh.causal() & mh.padding(lengths)),
        "decode 1x1024 x B=4, generate's left padding": (*qkv(1, 1024, 4), mh.causal() & left_padded),
        "decode 1x1024 x B=4, key_padding": (*qkv(1, 1024, 4), mh.key_padding(real)),
    }


def _call(q, k, v, mask, clear: bool) -> Callable[[], object]:
    """One ``mh.attention`` call with the clearing of dead keys on or off."""

    def call():
        functional.clear_dead_keys = clear_dead_keys if clear else (lambda p: p)
        return mh.attention(q, k, v, mask=mask)

    return call


def timings(cases: dict[str, tuple], repeats: int, *, clock=time.perf_counter) -> dict[str, dict]:
    """Per case: the clearing on and off timed interleaved (a drift of a shared machine hits both
    alike), each median long enough for ``clock`` or "too short to measure"; on/off as a ratio, or
    "same within noise" where the spreads overlap."""
    rows = {}
    try:
        for name, (q, k, v, mask) in cases.items():
            calls = {"on": _call(q, k, v, mask, True), "off": _call(q, k, v, mask, False)}
            t = timing.measure_all(calls, min_samples=repeats, clock=clock)
            vs = timing.compare(t["on"], t["off"])
            rows[name] = {
                "on_ms": None if t["on"].median is None else 1e3 * t["on"].median,
                "off_ms": None if t["off"].median is None else 1e3 * t["off"].median,
                "ratio": vs.ratio,
                "within_noise": vs.same,
                "text": str(vs),
                "why": t["on"].why or t["off"].why,
            }
    finally:
        functional.clear_dead_keys = clear_dead_keys
    return rows


def _ms(x: float | None) -> str:
    return f"{'-':>9s}" if x is None else f"{x:9.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with torch.inference_mode():
        rows = timings(_cases(), args.repeats)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'case':40s} {'on ms':>9s} {'off ms':>9s} on/off")
    for name, r in rows.items():
        print(f"{name:40s} {_ms(r['on_ms'])} {_ms(r['off_ms'])} {r['text']}")


if __name__ == "__main__":
    main()
