"""What each precision, approximation and head-surgery choice costs a real language model:
SmolLM2-135M-Instruct (its Q4_1 GGUF dequantized to fp32) on held-out English Wikipedia.

    nice -n 10 python benchmarks/real_lm.py --json rows.json     # every row (about 1.5 h on 2 cores)
    python benchmarks/real_lm.py --rows fp32,int8-g32,mla-48+rec --recover-minutes 8

The rows and how each is scored: ``multihead.bench.real_lm`` (rows ending ``+rec`` run ``mh.heads.recover``
for ``--recover-minutes`` of CPU time each). Method and text: docs/real-lm.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform

import torch

from multihead.bench import real_lm
from multihead.pretrained.files import atomic_write


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rows", default=",".join(real_lm.ROWS), help=f"comma-separated, of {', '.join(real_lm.ROWS)}"
    )
    ap.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (default 1000)")
    ap.add_argument(
        "--recover-minutes",
        type=float,
        default=8.0,
        help="CPU-minutes (the process's, all threads) of recover in a +rec row",
    )
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON (rewritten after every row)")
    args = ap.parse_args()
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in real_lm.ROWS]
    if unknown or not names:
        ap.error(f"unknown rows {unknown} (choose from {', '.join(real_lm.ROWS)})")
    s = dataclasses.replace(
        real_lm.Settings(), bootstrap=args.bootstrap, recover_minutes=args.recover_minutes
    )

    def save(rows: list[dict]) -> None:
        if args.json:  # after every row, so that a long run keeps what it measured
            with atomic_write(args.json) as tmp:
                tmp.write_text(json.dumps(rows, indent=2))

    rows = real_lm.measure(names, s, log=lambda line: print(line, flush=True), on_row=save)
    first = rows[0]
    print(
        f"\nSmolLM2-135M-Instruct, {first['tokens']} tokens of {s.texts} held-out Wikipedia articles "
        f"({first['windows']} windows of {s.context}, stride {s.stride}); torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads\n"
    )
    print(real_lm.table(rows))


if __name__ == "__main__":
    main()
