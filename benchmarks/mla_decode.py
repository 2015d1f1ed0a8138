"""Decode speed and KV cache size of multi-head latent attention (MLA) against MHA and GQA.

    python benchmarks/mla_decode.py                 # d 512, 8 heads, 4 layers, contexts 1024 and 2048
    python benchmarks/mla_decode.py --context 4096 --new-tokens 64 --rounds 5 --threads 2 --json
    python benchmarks/mla_decode.py --device cuda --dtype bfloat16

Four small TransformerLMs (LLaMA blocks: pre-RMSNorm, SwiGLU, rotary) of the same width and depth differ
only in their self-attention:

    MHA            8 query heads, 8 kv heads of D = 64
    GQA            8 query heads, n_heads / 4 = 2 kv heads
    MLA absorbed   LatentAttention (DeepSeek-V2 proportions: kv_rank 4 D = 256, rope_dims D / 2 = 32,
                   nope_dims = v_head_dim = D) with its default absorb=None: the prefill materialises
                   per-head keys, every decode step attends in latent space
    MLA naive      the same weights with absorb=False: per-head keys and values rebuilt from the cached
                   latents at every decode step

At batch 1 each model prefills a random prompt of ``context`` tokens into its cache (not timed), then
decodes ``new_tokens`` greedy tokens one at a time; decode tokens/s is new_tokens / time of that loop.
The vocabulary is small (4096) so that the output head does not hide the attention. The machine may be
shared: the contestants run interleaved, round after round (at least ``--rounds``, more while a loop's
samples add up to under 0.2 s), each figure is the median of the rounds, and a ratio whose spreads
overlap reads "same within noise" (``multihead.bench.timing``).
KV bytes per token is ``mh.heads.kv_cache_bytes_per_token`` (all layers) in the model's dtype; the two
MLA forms hold the same cache, and the script checks that they pick the same tokens.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import time

import torch

import multihead as mh
from multihead.bench import timing


def build(kind: str, args: argparse.Namespace) -> mh.TransformerLM:
    """The benchmark's TransformerLM with ``kind`` attention ("mha", "gqa" or "mla"), seeded weights."""
    d, H, D = args.d_model, args.heads, args.d_model // args.heads
    torch.manual_seed(0)
    common = dict(max_len=max(args.context) + args.new_tokens, tie_embeddings=False)
    if kind == "mla":
        rotary = mh.RotaryEmbedding(D // 2)

        def attention(_layer: int) -> mh.MultiHeadAttention:
            return mh.variants.LatentAttention(
                d, H, kv_rank=4 * D, rope_dims=D // 2, nope_dims=D, v_head_dim=D, rotary=rotary
            )

        return mh.TransformerLM(args.vocab, d, args.layers, H, args.d_ff, attention=attention, **common)
    n_kv = H if kind == "mha" else max(1, H // 4)
    return mh.TransformerLM(args.vocab, d, args.layers, H, args.d_ff, n_kv_heads=n_kv, **common)


@torch.inference_mode()
def decode(
    model: mh.TransformerLM, prompt: torch.Tensor, new: int, clock=time.perf_counter
) -> tuple[float, torch.Tensor]:
    """Prefill ``prompt`` (1, C) into a fresh cache, then time ``new`` greedy one-token steps.

    Returns (seconds of the decode loop's ``new - 1`` steps, the new tokens (new,)).
    """
    caches = model.make_cache(1, prompt.shape[1] + new)
    h = model.hidden_states(prompt, cache=caches)  # (1, C, d): the prefill, not timed
    tok = model.lm_head(h[:, -1]).argmax(-1, keepdim=True)  # (1, 1)
    out = [tok]
    sync(prompt.device)
    start = clock()
    for _ in range(new - 1):
        h = model.hidden_states(tok, cache=caches)  # (1, 1, d)
        tok = model.lm_head(h[:, -1]).argmax(-1, keepdim=True)  # (1, 1)
        out.append(tok)
    sync(prompt.device)
    return clock() - start, torch.cat(out, 1)[0]


def measure(
    models: dict, prompt: torch.Tensor, new: int, rounds: int, clock=time.perf_counter
) -> tuple[dict[str, timing.Timing], dict[str, torch.Tensor]]:
    """Interleaved rounds of :func:`decode`, at least ``rounds`` and more while a model's samples add
    up to under 0.2 s (:func:`multihead.bench.timing.enough`): name -> the decode loop's
    :class:`~multihead.bench.timing.Timing` ("too short to measure" where a loop is under 50 ticks of
    ``clock``), and name -> its tokens."""
    floor = 50 * (timing.clock_resolution(clock) or float("inf"))
    secs: dict[str, list[float]] = {k: [] for k in models}
    tokens: dict[str, torch.Tensor] = {}

    def done(xs: list[float]) -> bool:  # enough, or a loop already too short for the clock
        return timing.enough(xs, min_samples=rounds) or bool(xs and min(xs) < floor)

    while not all(done(v) for v in secs.values()):
        for name, m in models.items():
            seconds, tokens[name] = decode(m, prompt, new, clock)
            secs[name].append(seconds)
    return {k: timing.from_samples(v, floor=floor) for k, v in secs.items()}, tokens


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate_cell(row: dict) -> str:
    return timing.TOO_SHORT if row["tokens_per_s"] is None else f"{row['tokens_per_s']:.1f}"


def vs_cell(row: dict) -> str:
    if row["vs_mha"] is None:
        return timing.TOO_SHORT
    return (
        timing.SAME if row["vs_mha_within_noise"] and row["attention"] != "MHA" else f"{row['vs_mha']:.2f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-ff", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    args = ap.parse_args()
    print("$ python " + " ".join(shlex.quote(a) for a in sys.argv), flush=True)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    mla = build("mla", args)
    naive = copy.deepcopy(mla)
    assert all(layer.self_attn.absorbs(1, max(args.context)) for layer in mla.layers)
    for layer in naive.layers:
        layer.self_attn.absorb = False
    models = {"MHA": build("mha", args), "GQA": build("gqa", args), "MLA absorbed": mla, "MLA naive": naive}
    for m in models.values():
        m.to(device=device, dtype=dtype).eval()

    rows = []
    for C in args.context:
        prompt = torch.randint(0, args.vocab, (1, C), generator=torch.Generator().manual_seed(C)).to(device)
        times, tokens = measure(models, prompt, args.new_tokens, args.rounds)
        for name, m in models.items():
            kv = mh.heads.kv_cache_bytes_per_token(m, dtype)
            vs = timing.compare(times["MHA"], times[name])  # MHA's time / this one's: > 1 faster
            rows.append(
                {
                    "context": C,
                    "attention": name,
                    "tokens_per_s": times[name].rate(args.new_tokens - 1),
                    "why": times[name].why,
                    "vs_mha": vs.ratio,
                    "vs_mha_within_noise": vs.same,
                    "kv_bytes_per_token": kv,
                    "kv_mib_at_context": kv * C / 2**20,
                    "params_m": sum(p.numel() for p in m.parameters()) / 1e6,
                    "same_tokens_as_absorbed": (
                        bool(torch.equal(tokens[name], tokens["MLA absorbed"]))
                        if name == "MLA naive"
                        else None
                    ),
                }
            )
    threads = torch.get_num_threads()
    if args.json:
        print(json.dumps({"args": vars(args), "threads": threads, "results": rows}, indent=2))
        return
    print(
        f"\nd_model {args.d_model}, {args.heads} heads, {args.layers} layers, d_ff {args.d_ff}, vocab "
        f"{args.vocab}, batch 1, {args.new_tokens} new tokens, {args.dtype} on {args.device} "
        f"({threads} threads), median of >= {args.rounds} interleaved rounds\n"
    )
    print(
        "| context | attention | decode tokens/s | vs MHA | KV bytes/token (all layers) "
        "| KV MiB at context | params (M) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        note = ""
        if r["same_tokens_as_absorbed"] is not None:
            note = " (same tokens)" if r["same_tokens_as_absorbed"] else " (OTHER TOKENS)"
        print(
            f"| {r['context']} | {r['attention']}{note} | {rate_cell(r)} | "
            f"{vs_cell(r)} | {r['kv_bytes_per_token']:,} | "
            f"{r['kv_mib_at_context']:.1f} | {r['params_m']:.2f} |"
        )


if __name__ == "__main__":
    main()
