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
import statistics
import time

import torch

import multihead as mh
import multihead.core.functional as functional
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


def _time(q, k, v, mask, clear: bool) -> float:
    functional.clear_dead_keys = clear_dead_keys if clear else (lambda p: p)
    t0 = time.perf_counter()
    mh.attention(q, k, v, mask=mask)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = {}
    with torch.inference_mode():
        for name, (q, k, v, mask) in _cases().items():
            for clear in (True, False):  # warm-up
                _time(q, k, v, mask, clear)
            on, off = [], []
            for _ in range(args.repeats):  # interleaved, so drift of a shared machine hits both alike
                on.append(_time(q, k, v, mask, True))
                off.append(_time(q, k, v, mask, False))
            rows[name] = {
                "on_ms": 1e3 * statistics.median(on),
                "off_ms": 1e3 * statistics.median(off),
                "ratio": statistics.median(on) / statistics.median(off),
            }
    functional.clear_dead_keys = clear_dead_keys
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'case':40s} {'on ms':>9s} {'off ms':>9s} {'on/off':>7s}")
    for name, r in rows.items():
        print(f"{name:40s} {r['on_ms']:9.3f} {r['off_ms']:9.3f} {r['ratio']:7.3f}")


if __name__ == "__main__":
    main()
