"""A rotary (LLaMA-style) LM made smaller in its KV cache: GQA (``mh.heads.to_gqa``) against MLA with
partial RoPE (``mh.heads.to_mla``, MHA2MLA) at equal cache bytes, before any recovery.

    OMP_WAIT_POLICY=PASSIVE nice -n 5 python benchmarks/rope_mla.py          # markdown on stdout
    python benchmarks/rope_mla.py --steps 100 --json out.json                # quicker, and JSON

No real pretrained LLaMA-family checkpoint ships offline, so the model is a small LLaMA-shaped
:class:`~multihead.TransformerLM` (rotary, RMSNorm, SwiGLU, GQA: d 256, 8 query heads of 32, 4 kv heads,
``--layers`` layers) trained here for ``--steps`` AdamW steps as a byte-level LM on the standard library's
docstrings (``multihead.train.text.byte_corpus``: the first 90% to train, the last 10% held out). It is a
tiny model with real (if shallow) attention patterns, not a pretrained LLM: its figures say how the
conversions compare, not what they cost a 7B model. ``--random`` skips training (random weights, the
GPT-2 initialisation): attention is then almost uniform and every conversion looks nearly free.

Each row converts the trained model (calibration: ``--cal`` training windows) and is scored on held-out
windows against the original: top-1 agreement of the next-byte prediction, mean KL(original || converted)
in nats, the relative Frobenius error of the logits, and held-out bits per byte. KV bytes per token count
every layer in fp32 (``mh.heads.kv_cache_bytes_per_token``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math

import torch
import torch.nn.functional as F

import multihead as mh
from multihead import heads
from multihead.bench import timing
from multihead.pretrained.files import atomic_write
from multihead.train.text import byte_corpus


def _train(model: mh.TransformerLM, data: torch.Tensor, steps: int, seq: int, batch: int, lr: float) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        warm = min(1.0, (step + 1) / 20)
        for group in opt.param_groups:
            group["lr"] = lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        w = data[starts[:, None] + torch.arange(seq + 1)]  # (B, seq + 1)
        loss = F.cross_entropy(model(w[:, :-1]).reshape(-1, 256), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return float(loss.detach())


@torch.no_grad()
def _score(model, ref_logits: torch.Tensor, windows: torch.Tensor) -> dict[str, float]:
    logits = model(windows[:, :-1])  # (n, N, 256)
    logp, ref_logp = F.log_softmax(logits, -1), F.log_softmax(ref_logits, -1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean()
    nats = F.cross_entropy(logits.reshape(-1, 256), windows[:, 1:].reshape(-1))
    return {
        "agree": float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
        "kl": float(kl),
        "rel_err": float((logits - ref_logits).norm() / ref_logits.norm()),
        "bits_per_byte": float(nats) / math.log(2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400, help="training steps of the byte LM (default 400)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--cal", type=int, default=32, help="calibration windows (default 32)")
    p.add_argument("--eval", type=int, default=48, help="held-out windows (default 48)")
    p.add_argument("--random", action="store_true", help="random weights: no training")
    p.add_argument(
        "--recover-steps", type=int, default=0,
        help="also distil (mh.heads.recover, lr 1e-3, batches of 16 windows) the best GQA and MLA rows of "
        "the smallest cache for this many steps (default 0: before recovery only)",
    )  # fmt: skip
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    torch.manual_seed(0)
    train, held = byte_corpus(2000)
    model = mh.TransformerLM(256, 256, args.layers, 8, 688, n_kv_heads=4, max_len=2 * args.seq)
    last, train_t = timing.once(
        lambda: float("nan") if args.random else _train(model, train, args.steps, args.seq, 16, 3e-3)
    )  # a training run is timed once, never repeated
    model.eval()
    g = torch.Generator().manual_seed(1)
    cal = train[
        torch.randint(0, train.numel() - args.seq, (args.cal,), generator=g)[:, None] + torch.arange(args.seq)
    ]
    n_eval = min(args.eval, (held.numel() - 1) // args.seq)
    windows = held[(torch.arange(n_eval) * args.seq)[:, None] + torch.arange(args.seq + 1)]  # (n, N + 1)
    with torch.no_grad():
        ref = model(windows[:, :-1])  # (n, N, 256)
    D, Hkv = model.head_dim, model.n_kv_heads
    rows: list[dict] = []

    def add(name: str, converted, **extra) -> None:
        rows.append(
            {"model": name, "kv_bytes": heads.kv_cache_bytes_per_token(converted, torch.float32), **extra}
            | _score(converted, ref, windows)
            | {"_model": converted}
        )

    add("original (8 query heads, 4 kv heads)", model)
    for K in (2, 1):
        add(f"GQA-{K} mean", heads.to_gqa(copy.deepcopy(model), K, "mean"))
        add(f"GQA-{K} aligned", heads.to_gqa(copy.deepcopy(model), K, "aligned", calibration=cal))
        numbers = 2 * K * D  # per layer, what GQA-K caches
        for R in (4, 8, 12, 16):
            r = numbers - Hkv * R
            if r < 1:
                continue
            for sel in ("norm", "high", "uniform") if R != 12 else ("norm", "high"):
                conv = heads.to_mla(model, r, rope_dims=R, calibration=cal, rope_select=sel)
                add(f"MLA r={r}, rope_dims={R} ({sel}), calibrated", conv)
            if R == 8:
                add(f"MLA r={r}, rope_dims={R} (norm), weights only", heads.to_mla(model, r, rope_dims=R))
    if args.recover_steps:
        texts = train[
            torch.randint(0, train.numel() - args.seq, (512,), generator=g)[:, None] + torch.arange(args.seq)
        ]
        small = min(r["kv_bytes"] for r in rows)
        for kind in ("GQA", "MLA"):
            best = max(
                (r for r in rows if r["kv_bytes"] == small and r["model"].startswith(kind)),
                key=lambda r: r["agree"],
            )
            conv = best.pop("_model")
            _, recover_t = timing.once(
                lambda conv=conv: heads.recover(
                    conv, model, texts, steps=args.recover_steps, lr=1e-3, progress=False
                )
            )
            add(f"{best['model']} + recover {args.recover_steps} steps", conv, seconds=recover_t.median)
    top = heads.max_kv_rank(model.layers[0].self_attn, D)
    add(f"MLA r={top}, rope_dims={D} (exact limit)", heads.to_mla(model, top, rope_dims=D))
    for r in rows:
        r.pop("_model", None)
    head = (
        f"Byte LM (d 256, {args.layers} layers, 8 heads of {D}, {Hkv} kv heads, "
        + ("random weights" if args.random else f"{args.steps} steps, final train loss {last:.3f} nats")
        + (f", trained in {train_t.median:.0f} s" if train_t.median is not None else "")
        + f"); {n_eval} held-out windows of {args.seq} bytes."
    )
    print(head + "\n")
    print(
        "| model | KV bytes/token (fp32) | next-byte agreement | KL (nats) | logit rel. error | bits/byte |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = f"{100 * r['agree']:.1f}% | {r['kl']:.4f} | {r['rel_err']:.3f} | {r['bits_per_byte']:.3f}"
        print(f"| {r['model']} | {r['kv_bytes']:,} | {cells} |")
    if args.json:
        with atomic_write(args.json) as tmp:
            tmp.write_text(json.dumps({"setup": head, "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
