"""Heads of all-MiniLM-L6-v2: the role table, the pruning curve and the MHA -> GQA curve.

    nice -n 10 python benchmarks/bench_heads.py                      # markdown on stdout (minutes)
    python benchmarks/bench_heads.py --eval-texts 100 --repeats 1    # quicker

Texts are standard-library docstrings (``mh.pretrained.stdlib_docstrings``), split into disjoint sets:
evaluation (fidelity), importance (Michel et al.'s scores, default self-supervised loss) and calibration
(Procrustes alignment of "aligned" GQA). Fidelity is the cosine between a model's sentence embedding and
the original model's, per text: the mean and the minimum over the evaluation set. Encode time ratios are
medians of interleaved runs over the first ``--time-texts`` evaluation texts; on a shared box they are
noisy (run it niced; ``OMP_WAIT_POLICY=PASSIVE`` keeps OpenMP from spinning against other jobs).
"""

from __future__ import annotations

import argparse
import copy
import random
import time

import torch

import multihead as mh
from multihead import heads
from multihead.bench import timing

FRACTIONS = (0, 1 / 6, 1 / 3, 1 / 2, 2 / 3)
N_KV = (12, 6, 4, 3, 2, 1)


def _cosines(
    model: mh.pretrained.SentenceEncoder, texts: list[str], ref: torch.Tensor
) -> tuple[float, float]:
    cos = (model.encode(texts) * ref).sum(-1)  # (n,): both unit length
    return float(cos.mean()), float(cos.min())


def time_ratio(model, base, texts: list[str], repeats: int, clock=time.perf_counter) -> timing.Comparison:
    """Encode time of ``model`` / of ``base`` (:func:`multihead.bench.timing.measure_all`: interleaved
    samples, at least ``repeats``; "same within noise" where the spreads overlap)."""
    t = timing.measure_all(
        {"model": lambda: model.encode(texts), "base": lambda: base.encode(texts)},
        min_samples=repeats,
        clock=clock,
    )
    return timing.compare(t["model"], t["base"])


def _attention_params(model) -> int:
    return sum(p.numel() for layer in heads.layers_of(model) for p in layer.self_attn.parameters())


def _roles(model, texts: list[str]) -> str:
    rows = heads.roles(heads.attention_maps(model, texts), heads.token_strings(model, texts))
    return (
        f"## Roles of the 72 heads ({len(texts)} docstrings)\n\n{heads.roles_grid(rows)}\n\n"
        f"{heads.roles_table(rows)}\n"
    )


def _importance_grid(scores: torch.Tensor) -> str:
    L, H = scores.shape
    lines = ["| layer | " + " | ".join(f"h{h}" for h in range(H)) + " |", "|---" * (H + 1) + "|"]
    lines += [f"| {i} | " + " | ".join(f"{float(v):.2f}" for v in scores[i]) + " |" for i in range(L)]
    return "\n".join(lines)


def _pruning(model, scores: torch.Tensor, evaluation, timed, ref, repeats: int, seed: int) -> str:
    L, H = scores.shape
    ascending = [divmod(int(i), H) for i in scores.flatten().argsort()]  # least important first
    shuffled = ascending.copy()
    random.Random(seed).shuffle(shuffled)
    full = _attention_params(model)
    lines = [
        "| heads removed | fraction | order | mean cos | min cos | attention params | encode time | "
        "heads left per layer |",
        "|---:|---:|:---|---:|---:|---:|---:|:---|",
    ]
    for fraction in FRACTIONS:
        n = round(fraction * L * H)
        for order, ranked in (("importance", ascending), ("random", shuffled)):
            if n == 0 and order == "random":
                continue
            drop: dict[int, list[int]] = {}
            for layer, head in ranked[:n]:
                drop.setdefault(layer, []).append(head)
            pruned = heads.prune(copy.deepcopy(model), drop)
            mean, low = _cosines(pruned, evaluation, ref)
            ratio = time_ratio(pruned, model, timed, repeats) if order == "importance" else None
            left = [getattr(layer.self_attn, "n_heads", 0) for layer in heads.layers_of(pruned)]
            params = _attention_params(pruned) / full
            time_cell = "-" if ratio is None else str(ratio)
            cells = [
                str(n),
                f"{fraction:.2f}",
                order,
                f"{mean:.4f}",
                f"{low:.4f}",
                f"{params:.2f}",
                time_cell,
            ]
            lines.append("| " + " | ".join([*cells, str(left)]) + " |")
    return (
        "## Pruning curve (heads removed by ascending importance; random order for comparison)\n\n"
        + "\n".join(lines)
    )


def _gqa(model, evaluation, calibration, ref) -> str:
    lines = [
        "| n_kv_heads | method | mean cos | min cos | KV cache bytes/token (fp32) | KV saved |",
        "|---:|:---|---:|---:|---:|---:|",
    ]
    full = heads.kv_cache_bytes_per_token(model)
    for n_kv in N_KV:
        for method in ("mean", "aligned"):
            converted = heads.to_gqa(copy.deepcopy(model), n_kv, method, calibration=calibration)
            mean, low = _cosines(converted, evaluation, ref)
            kv = heads.kv_cache_bytes_per_token(converted)
            lines.append(f"| {n_kv} | {method} | {mean:.4f} | {low:.4f} | {kv} | {1 - kv / full:.0%} |")
    return "## MHA -> GQA (no retraining)\n\n" + "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--eval-texts", type=int, default=300, help="texts for fidelity (default 300)")
    p.add_argument("--time-texts", type=int, default=128, help="evaluation texts timed (default 128)")
    p.add_argument("--importance-texts", type=int, default=128, help="texts for importance (default 128)")
    p.add_argument("--calib-texts", type=int, default=64, help="calibration texts for aligned (default 64)")
    p.add_argument("--role-texts", type=int, default=64, help="texts for the role table (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timing runs (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random pruning order (default 0)")
    args = p.parse_args()

    total = args.eval_texts + args.importance_texts + args.calib_texts
    docs = mh.pretrained.stdlib_docstrings(total, max_chars=800)
    evaluation = docs[: args.eval_texts]
    importance_texts = docs[args.eval_texts : args.eval_texts + args.importance_texts]
    calibration = docs[args.eval_texts + args.importance_texts :]
    model = mh.pretrained.minilm()
    ref = model.encode(evaluation)
    print(f"# Heads of all-MiniLM-L6-v2 (torch {torch.__version__}, {torch.get_num_threads()} threads)\n")
    print(_roles(model, evaluation[: args.role_texts]))
    scores, took = timing.once(lambda: heads.importance(model, importance_texts))
    spent = timing.TOO_SHORT if took.median is None else f"{took.median:.1f} s"
    print(
        f"## Head importance (Michel et al., span-contrastive loss, {len(importance_texts)} docstrings, "
        f"{spent}; l2-normalised per layer)\n\n{_importance_grid(scores)}\n"
    )
    print(_pruning(model, scores, evaluation, evaluation[: args.time_texts], ref, args.repeats, args.seed))
    print()
    print(_gqa(model, evaluation, calibration, ref))


if __name__ == "__main__":
    main()
