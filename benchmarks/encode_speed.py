"""MiniLM encoding speed: multihead's ``encode`` against sentence-transformers' own ``encode``.

    python benchmarks/encode_speed.py                       # 256 docstrings + 256 short texts, 3 rounds
    python benchmarks/encode_speed.py --threads 1 --rounds 5 --json

Both sides get the same texts, batch size 32 and normalised embeddings; both sort by length before
batching (sentence-transformers by characters, multihead by tokens) and return the input order. The
corpora: the first ``--docs`` standard-library docstrings (``mh.pretrained.stdlib_docstrings``, up to 256
tokens each) and a set of short texts, the first sentence of each of those docstrings.

Contestants run interleaved, round after round, so a load change on a shared machine hits all of them;
the ratios come from the medians of the same run (``multihead.bench.timing``: samples long enough for
the clock, a ratio whose spreads overlap reads "same within noise"). Reports texts/s (wall clock), the
ratio to sentence-transformers in wall-clock and in CPU time (the process's, all threads: on a machine shared
with other jobs the CPU-time ratio at ``--threads 1`` is the steadier measure of the work done),
the padded/real token counts of each side's batches, and the min cosine of each multihead path to
sentence-transformers' embeddings. Needs sentence-transformers and the bundled weights.
"""

from __future__ import annotations

import argparse
import json

import torch

import multihead as mh
from multihead.bench import timing
from multihead.bench.encode import bench, ratio_text, short_texts


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=256, help="standard-library docstrings (default 256)")
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved samples at least (more while under 0.2 s); medians"
    )
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    docs = mh.pretrained.stdlib_docstrings(args.docs)
    ours = mh.pretrained.minilm()
    prepacked = mh.quant.quantize(ours, weights="fp32", kv=None, kernel="onednn")  # oneDNN layout
    st = SentenceTransformer(str(mh.pretrained.minilm_dir()), device="cpu")
    report = {
        "threads": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "docstrings": bench(docs, args.rounds, args.batch_size, st, ours, prepacked),
        "short texts": bench(short_texts(docs), args.rounds, args.batch_size, st, ours, prepacked),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return report
    print(
        f"MiniLM encode, batch {args.batch_size}, {report['threads']} torch threads, medians of {args.rounds}"
    )
    for corpus in ("docstrings", "short texts"):
        r = report[corpus]
        tok = r["tokens"]
        print(
            f"\n{corpus}: {r['texts']} texts, {tok['real']} real tokens; padded batches compute "
            f"{tok['sentence-transformers padded']} (sentence-transformers) / {tok['multihead padded']} "
            "(multihead padded) tokens"
        )
        print(f"{'contestant':32s} {'texts/s':>9s} {'vs ST':>7s} {'CPU time vs ST':>15s} {'min cosine':>11s}")
        for name, rate in r["texts_per_s"].items():
            cos = r["min_cosine_vs_st"].get(name)
            cos_s = f"{cos:.7f}" if cos is not None else ""
            rate_s = timing.TOO_SHORT if rate is None else f"{rate:.1f}"
            wall_s, cpu_s = (
                ratio_text(r[key][name], r[f"{key}_within_noise"][name])
                for key in ("ratio_vs_st", "cpu_ratio_vs_st")
            )
            print(f"{name:32s} {rate_s:>9s} {wall_s:>7s} {cpu_s:>15s} {cos_s:>11s}")
    return report


if __name__ == "__main__":
    main()
