"""Does an MQAR model recall, or has it learned where the pairs sit? (BENCHMARKS.md, "MQAR").

    OMP_NUM_THREADS=1 python benchmarks/mqar_shift.py --attention Linformer    # ~17 CPU minutes
    OMP_NUM_THREADS=1 python benchmarks/mqar_shift.py --attention exact        # ~30 CPU minutes

Zoology's generator always puts the key-value pairs at the first 2 x n_pairs positions. A model whose
attention is tied to absolute positions (Linformer's learned (k, max_len) projections) can pass MQAR by
keeping exactly those positions. This script trains the default recipe (`multihead train`), then measures
held-out accuracy with F random filler tokens in front of the pairs (total length unchanged), and for
Linformer the share of each learned projection's energy on the first 2 x n_pairs positions (12.5% for
the random initial projections at max_len 256). Prints JSON.
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attention", default="exact", help="exact or a method of `multihead approx`")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    ap.add_argument("--fills", default="0,32,64,128", help="filler tokens before the pairs, comma list")
    args = ap.parse_args()

    import multihead.train.trainer as T
    from multihead.bench import approx as measure
    from multihead.data import IGNORE_INDEX, mqar

    cfg = T.TrainConfig() if args.steps is None else T.TrainConfig(steps=args.steps)
    approx = None if args.attention == "exact" else measure.make(args.attention, cfg.seq_len)
    built: list[T.TransformerLM] = []
    build = T.build_model

    def keep(c: T.TrainConfig, a: object = None) -> T.TransformerLM:
        built.append(build(c, a))
        return built[-1]

    T.build_model = keep  # train_mqar does not return its model
    res = T.train_mqar(cfg, approx)
    model, mask = built[-1], T._mask_for(approx)
    out: dict[str, object] = {"attention": res.approx, "accuracy": res.accuracy}
    g = torch.Generator().manual_seed(123)
    n = 1000
    for fill in (int(f) for f in args.fills.split(",")):
        x, y = mqar(n, cfg.seq_len - fill, cfg.n_pairs, cfg.vocab, cfg.power_a, seed=777)  # (n, L - F) each
        x = torch.cat([torch.randint(cfg.vocab, (n, fill), generator=g), x], 1)  # (n, L): filler first
        y = torch.cat([torch.full((n, fill), IGNORE_INDEX), y], 1)  # (n, L)
        out[f"accuracy_fill_{fill}"] = T.accuracy(model, x, y, mask=mask)
    context = 2 * cfg.n_pairs
    for i, layer in enumerate(model.layers):
        for mod in layer.modules():
            for name in ("proj_k", "proj_v"):
                w = getattr(mod, name, None)
                if isinstance(w, torch.Tensor):
                    energy = (w.detach() ** 2).sum(0)  # (max_len,): energy per key position
                    share = float(energy[:context].sum() / energy.sum())
                    out[f"layer{i}_{name}_energy_first_{context}"] = share
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
