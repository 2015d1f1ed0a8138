"""Head surgery and what it costs in human-judged quality: all-MiniLM-L6-v2 against a 6x smaller KV cache.

    nice -n 10 python benchmarks/surgery_quality.py --minutes 4            # markdown table on stdout
    python benchmarks/surgery_quality.py --minutes 2 --json out.json       # and the rows as JSON

Rows: the original; ``to_gqa(model, 2, method="aligned")`` (2 kv heads); ``to_mla(model, 128,
calibration=...)`` (a latent of 128 numbers per token and layer: the same KV bytes as GQA-2); optionally
(``--variants gqa,mla,prune``) a third of the heads removed by importance; each before and after
``mh.heads.recover`` for ``--minutes`` on standard-library docstrings (``mh.pretrained.stdlib_docstrings``).
Scores are ``mh.eval.human_judged`` (Lee Pearson, WordSim-353 Spearman, polarity 5-fold probe accuracy)
and their ratio to the original's. Wall-clock minutes on a shared 2-core box buy few steps (batches of 16
docstrings of at most 128 tokens): the progress bar on stderr shows the steps taken.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import time
from collections.abc import Callable

import torch

import multihead as mh
from multihead import heads
from multihead.bench import timing
from multihead.pretrained.files import atomic_write

SETS = ("lee", "wordsim353", "polarity")


def _scores(model, bootstrap: int) -> dict[str, float]:
    out = mh.eval.human_judged(model, bootstrap=bootstrap)
    return {k: out[k]["score"] for k in SETS} | {f"{k}_ci": (out[k]["low"], out[k]["high"]) for k in SETS}


def recover_seconds(
    run: Callable[[], object], clock: Callable[[], float] = time.perf_counter
) -> float | None:
    """Seconds of one recovery run (timed once, never repeated: it trains), None when too short for
    ``clock`` to tell."""
    return timing.once(run, clock=clock)[1].median


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=4.0, help="recover wall time per model (default 4)")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--train", default="changed", help="changed | attention | all")
    p.add_argument("--texts", type=int, default=2000, help="training docstrings")
    p.add_argument("--rank", type=int, default=128, help="MLA kv_rank (default 128)")
    p.add_argument("--calibration", type=int, default=64, help="docstrings that calibrate MLA (default 64)")
    p.add_argument("--kv-heads", type=int, default=2, help="GQA kv heads (default 2)")
    p.add_argument("--variants", default="gqa,mla", help="comma-separated: gqa, mla, prune (default gqa,mla)")
    p.add_argument(
        "--pieces", action="store_true",
        help="recover on mh.heads.mixed_lengths(docstrings): also their sentences and 1-3 word spans "
        "(short inputs like the evaluation's words and review sentences), not only whole docstrings",
    )  # fmt: skip
    p.add_argument("--bootstrap", type=int, default=100)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    torch.manual_seed(0)
    model = mh.pretrained.minilm()
    docs = mh.pretrained.stdlib_docstrings(args.texts, max_chars=600)
    calibration = docs[: args.calibration]
    chosen = args.variants.split(",")
    variants = {}
    if "gqa" in chosen:
        variants[f"GQA-{args.kv_heads} aligned"] = heads.to_gqa(
            copy.deepcopy(model), args.kv_heads, "aligned"
        )
    if "mla" in chosen:
        variants[f"MLA r={args.rank} calibrated"] = heads.to_mla(model, args.rank, calibration=calibration)
    if "prune" in chosen:
        scores = heads.importance(model, docs[64:128])  # (L, H)
        L, H = scores.shape
        k = L * H // 3
        flat = scores.flatten().argsort()[:k].tolist()
        drop: dict[int, list[int]] = {}
        for i in flat:
            drop.setdefault(i // H, []).append(i % H)
        variants["pruned 1/3 by importance"] = heads.prune(copy.deepcopy(model), drop)
    train_texts = heads.mixed_lengths(docs) if args.pieces else docs
    rows = []
    base = _scores(model, args.bootstrap)
    rows.append({"model": "original", "kv_bytes": heads.kv_cache_bytes_per_token(model), **base})
    print(rows[-1], flush=True)
    for name, student in variants.items():
        before = _scores(student, args.bootstrap)
        rows.append({"model": name, "kv_bytes": heads.kv_cache_bytes_per_token(student), **before})
        print(rows[-1], flush=True)
        run = functools.partial(heads.recover, student, model, train_texts, minutes=args.minutes, lr=args.lr,
                                train=args.train, progress=True)  # fmt: skip
        secs = recover_seconds(run)
        after = _scores(student, args.bootstrap)
        rows.append({"model": f"{name} + recover {args.minutes:g} min", "kv_bytes": rows[-1]["kv_bytes"],
                     "recover_s": secs, **after})  # fmt: skip
        print(rows[-1], flush=True)
    print("| model | KV bytes/token | Lee r | WordSim rho | polarity acc | min % of original |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        pct = min(100 * r[k] / base[k] for k in SETS)
        print(f"| {r['model']} | {r['kv_bytes']} | {r['lee']:.3f} | {r['wordsim353']:.3f} | "
              f"{r['polarity']:.3f} | {pct:.2f}% |")  # fmt: skip
    if args.json:
        with atomic_write(args.json) as tmp:
            tmp.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
