"""Head surgery and what it costs in human-judged quality: all-MiniLM-L6-v2 against a 6x smaller KV cache.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/surgery_quality.py --recipe   # the defaults, 3 seeds x 8 min
    python benchmarks/surgery_quality.py --recipe --minutes 0.2 --seeds 0 --texts 64   # a smoke run
    nice -n 10 python benchmarks/surgery_quality.py --minutes 4            # GQA vs MLA: markdown on stdout
    python benchmarks/surgery_quality.py --minutes 2 --json out.json       # and the rows as JSON

``--recipe``: the surgery as a user runs it, with the library's defaults only. Per seed: ``student =
mh.heads.to_mla(minilm(), kv_rank=128)`` (default calibration: 256 docstrings) and
``mh.heads.recover(student, teacher, mh.pretrained.stdlib_docstrings(2000), minutes=M, seed=s)`` (default
recipe: mixed lengths, lr 2e-5 warmed up and cosine-decayed, held-out stop keeping the best state), scored
with bootstrap 95% intervals. The goal it checks: on every seed Lee and WordSim-353 >= 98% and polarity >=
97.5% of the original's score. Wall-clock minutes buy steps only on a quiet machine: the numbers mean
something with 2 otherwise idle cores.

Without ``--recipe``, rows: the original; ``to_gqa(model, 2, method="aligned")`` (2 kv heads);
``to_mla(model, 128, calibration=...)`` (a latent of 128 numbers per token and layer: the same KV bytes as
GQA-2); optionally (``--variants gqa,mla,prune``) a third of the heads removed by importance; each before
and after ``mh.heads.recover`` for ``--minutes`` on standard-library docstrings
(``mh.pretrained.stdlib_docstrings``). Scores are ``mh.eval.human_judged`` (Lee Pearson, WordSim-353
Spearman, polarity 5-fold probe accuracy) and their ratio to the original's. Wall-clock minutes on a shared
2-core box buy few steps (batches of 16 docstrings of at most 128 tokens): the progress bar on stderr shows
the steps taken.
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
GOAL = {"lee": 98.0, "wordsim353": 98.0, "polarity": 97.5}  # --recipe: % of the original on every seed


def _scores(model, bootstrap: int) -> dict[str, float]:
    out = mh.eval.human_judged(model, bootstrap=bootstrap)
    return {k: out[k]["score"] for k in SETS} | {f"{k}_ci": (out[k]["low"], out[k]["high"]) for k in SETS}


def recover_seconds(
    run: Callable[[], object], clock: Callable[[], float] = time.perf_counter
) -> float | None:
    """Seconds of one recovery run (timed once, never repeated: it trains), None when too short for
    ``clock`` to tell."""
    return timing.once(run, clock=clock)[1].median


def _cell(score: float, ci: tuple) -> str:
    return f"{score:.3f}" if ci[0] is None else f"{score:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def recipe(args: argparse.Namespace) -> list[dict]:
    """``--recipe``: MLA r=``--rank`` with the library's defaults, recovered once per seed; prints the table
    and whether the goal holds on every seed."""
    torch.set_num_threads(args.threads)
    teacher = mh.pretrained.minilm()
    texts = mh.pretrained.stdlib_docstrings(args.texts, max_chars=600)
    base = _scores(teacher, args.bootstrap)
    rows = [{"model": "original", **base}]
    print(rows[-1], flush=True)
    extra = {} if args.average is None else {"average": args.average}
    for seed in [int(s) for s in args.seeds.split(",")]:
        student = mh.heads.to_mla(teacher, kv_rank=args.rank)  # defaults only
        report: dict = {}
        run = functools.partial(heads.recover, student, teacher, texts, minutes=args.minutes, seed=seed,
                                report=report, **extra)  # fmt: skip
        seconds = recover_seconds(run)
        got = _scores(student, args.bootstrap)
        pct = {k: 100 * got[k] / base[k] for k in SETS}
        rows.append({"model": f"MLA r={args.rank}, seed {seed}", **got, "pct": pct, "recover_s": seconds,
                     "steps": report["steps"], "best_step": report["best_step"], "stopped": report["stopped"],
                     "holds": all(pct[k] >= GOAL[k] for k in SETS)})  # fmt: skip
        print(rows[-1], flush=True)
    print(
        "\n| model | Lee r | WordSim rho | polarity acc | % of original (Lee / WordSim / polarity) | steps |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        pct_text = " / ".join(f"{r['pct'][k]:.2f}%" for k in SETS) if "pct" in r else "100%"
        steps = f"{r['steps']} (best {r['best_step']}, {r['stopped']})" if "steps" in r else "-"
        print(
            f"| {r['model']} | {' | '.join(_cell(r[k], r[f'{k}_ci']) for k in SETS)} | {pct_text} | {steps} |"
        )
    held = [r["holds"] for r in rows[1:]]
    verdict = "met" if all(held) else "not met"
    print(f"\ngoal (Lee, WordSim >= 98%, polarity >= 97.5% every seed): {verdict}, {sum(held)}/{len(held)}")
    return rows


def variants(args: argparse.Namespace) -> list[dict]:
    """GQA-2, MLA and (with ``--variants prune``) pruning, each before and after recovery."""
    torch.manual_seed(0)
    model = mh.pretrained.minilm()
    docs = mh.pretrained.stdlib_docstrings(args.texts, max_chars=600)
    calibration = docs[: args.calibration]
    chosen = args.variants.split(",")
    models = {}
    if "gqa" in chosen:
        models[f"GQA-{args.kv_heads} aligned"] = heads.to_gqa(copy.deepcopy(model), args.kv_heads, "aligned")
    if "mla" in chosen:
        models[f"MLA r={args.rank} calibrated"] = heads.to_mla(model, args.rank, calibration=calibration)
    if "prune" in chosen:
        scores = heads.importance(model, docs[64:128])  # (L, H)
        L, H = scores.shape
        k = L * H // 3
        flat = scores.flatten().argsort()[:k].tolist()
        drop: dict[int, list[int]] = {}
        for i in flat:
            drop.setdefault(i // H, []).append(i % H)
        models["pruned 1/3 by importance"] = heads.prune(copy.deepcopy(model), drop)
    train_texts = heads.mixed_lengths(docs) if args.pieces else docs
    rows = []
    base = _scores(model, args.bootstrap)
    rows.append({"model": "original", "kv_bytes": heads.kv_cache_bytes_per_token(model), **base})
    print(rows[-1], flush=True)
    for name, student in models.items():
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
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", action="store_true", help="MLA with the library's defaults, once per seed")
    p.add_argument(
        "--minutes", type=float, default=None, help="recover wall time per model (default 4; 8 with --recipe)"
    )
    p.add_argument("--seeds", default="0,1,2", help="--recipe: comma-separated recover seeds (default 0,1,2)")
    p.add_argument("--threads", type=int, default=2, help="--recipe: torch threads (default 2)")
    p.add_argument("--average", type=float, default=None, help="--recipe: recover's average= (default None)")
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
    p.add_argument(
        "--bootstrap", type=int, default=None, help="resamples per interval (default 100; 200 with --recipe)"
    )
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    if args.minutes is None:
        args.minutes = 8.0 if args.recipe else 4.0
    if args.bootstrap is None:
        args.bootstrap = 200 if args.recipe else 100
    rows = recipe(args) if args.recipe else variants(args)
    if args.json:
        with atomic_write(args.json) as tmp:
            tmp.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
