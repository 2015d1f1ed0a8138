"""Real-model speed: MiniLM encoding vs sentence-transformers, LLaMA-155M decoding vs transformers.

    python benchmarks/bench_models.py                 # both parts, 3 interleaved rounds, medians
    python benchmarks/bench_models.py --part encode --docs 512 --rounds 3
    python benchmarks/bench_models.py --part decode --new-tokens 64 --threads 2 --json

Encoding: the same standard-library docstrings through sentence-transformers (batch 32), multihead
default (packs a batch only where padding costs more), packed and padded; docs/s and the min cosine
of multihead's (packed) embeddings against ST's.

Decoding: a 155M-parameter LLaMA-shaped model (d 1024, 8 layers, 16 heads, 4 kv heads, d_ff 2816,
vocab 32000, untied head; fp32) with random weights, built once by transformers and converted with
``mh.pretrained.from_hf``; a 256-token prompt, greedy. Decode tokens/s excludes the prefill: it is
``(new - 1) / (t(new tokens) - t(1 token))``. The memory-bandwidth limit is the measured read
bandwidth divided by the weight bytes every decode step must read (all matrices but the embedding).

The machine is shared, so contestants run interleaved, round after round, and the ratios come from
medians of the same run. Needs the oracles extra (transformers, sentence-transformers, the weights).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

import multihead as mh
from multihead.bench import timing
from multihead.bench.decode import read_bandwidth


def median_rounds(fns: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Run every contestant once per round, interleaved; the median of each one's results."""
    results: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            results[name].append(fn())
    return {k: statistics.median(v) for k, v in results.items()}


# -- encoding ------------------------------------------------------------------------------------------
def bench_encode(docs: int, rounds: int) -> dict:
    from sentence_transformers import SentenceTransformer

    texts = mh.pretrained.stdlib_docstrings(docs)
    ours = mh.pretrained.minilm()
    st = SentenceTransformer(str(mh.pretrained.minilm_dir()), device="cpu")
    ref = st.encode(texts, batch_size=32, normalize_embeddings=True, convert_to_tensor=True)
    got = ours.encode(texts, batch_size=32, packed=True)
    lengths = [len(s) for s in ours.tokenize(texts)]

    def timed(fn: Callable[[], object]) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            fn()
            return len(texts) / (time.perf_counter() - start)

        return run

    rates = median_rounds(
        {
            "sentence-transformers": timed(
                lambda: st.encode(texts, batch_size=32, normalize_embeddings=True)
            ),
            "multihead default": timed(lambda: ours.encode(texts, batch_size=32)),
            "multihead packed": timed(lambda: ours.encode(texts, batch_size=32, packed=True)),
            "multihead padded": timed(lambda: ours.encode(texts, batch_size=32, packed=False)),
        },
        rounds,
    )
    base = rates["sentence-transformers"]
    return {
        "docs": len(texts),
        "tokens": sum(lengths),
        "min_cosine_vs_st": float((got * ref).sum(-1).min()),
        "docs_per_s": rates,
        "ratio_vs_st": {k: v / base for k, v in rates.items()},
    }


# -- decoding ------------------------------------------------------------------------------------------
def weight_bytes(lm: mh.TransformerLM) -> int:
    """Bytes of the matrices one decode step reads: every parameter but the embedding table (one row)."""
    return sum(p.numel() * p.element_size() for n, p in lm.named_parameters() if n != "embed.weight") + (
        lm.embed.weight.numel() * lm.embed.weight.element_size()
        if lm.lm_head.weight is lm.embed.weight
        else 0
    )


def bench_decode(prompt_len: int, new_tokens: int, rounds: int) -> dict:
    import transformers as tf

    config = tf.LlamaConfig(
        **{k: v for k, v in mh.pretrained.PRESETS["llama-155m"].items() if k != "model_type"}
    )
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(config).eval()
    ours = mh.pretrained.from_hf(hf)
    assert isinstance(ours, mh.TransformerLM)
    prompt = torch.randint(0, config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(1))

    def hf_gen(n: int) -> torch.Tensor:
        return hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    def ours_gen(n: int) -> torch.Tensor:
        return ours.generate(prompt, n)

    def decode_rate(gen: Callable[[int], torch.Tensor]) -> Callable[[], float]:
        """Decode tokens/s: generate(new) - generate(1) through bench.timing (nan: inside the noise)."""

        def run() -> float:
            t = timing.measure_all(
                {"1": lambda: gen(1), "n": lambda: gen(new_tokens)}, warmup=0, min_samples=1
            )
            rate = timing.difference(t["n"], t["1"]).rate(new_tokens - 1)
            return float("nan") if rate is None else rate

        return run

    with torch.no_grad():
        same = torch.equal(hf_gen(new_tokens), ours_gen(new_tokens))
        rates = median_rounds(
            {
                "transformers": decode_rate(hf_gen),
                "multihead": decode_rate(ours_gen),
                "bandwidth": lambda: read_bandwidth(1 << 30),  # 1 GiB: the same probe, bigger
            },
            rounds,
        )
    bw = rates.pop("bandwidth")
    wbytes = weight_bytes(ours)
    limit = bw / wbytes
    return {
        "params": sum(p.numel() for p in ours.parameters()),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "greedy_tokens_identical": same,
        "weight_bytes_per_token": wbytes,
        "read_bandwidth_GBps": bw / 1e9,
        "bandwidth_limit_tokens_per_s": limit,
        "tokens_per_s": rates,
        "ratio_vs_transformers": rates["multihead"] / rates["transformers"],
        "fraction_of_bandwidth_limit": {k: v / limit for k, v in rates.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["encode", "decode", "both"], default="both")
    ap.add_argument("--docs", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    report: dict = {"threads": torch.get_num_threads(), "torch": torch.__version__}
    if args.part in ("encode", "both"):
        report["encode"] = bench_encode(args.docs, args.rounds)
    if args.part in ("decode", "both"):
        report["decode"] = bench_decode(args.prompt_len, args.new_tokens, args.rounds)
    print(json.dumps(report, indent=1) if args.json else _markdown(report))


def _markdown(r: dict) -> str:
    lines = [f"threads={r['threads']}, torch {r['torch']}", ""]
    if "encode" in r:
        e = r["encode"]
        lines += [f"encoding {e['docs']} docstrings ({e['tokens']} tokens), min cosine vs ST "
                  f"{e['min_cosine_vs_st']:.7f}", "", "| contestant | docs/s | vs sentence-transformers |",
                  "|---|---:|---:|"]  # fmt: skip
        lines += [f"| {k} | {v:.1f} | {e['ratio_vs_st'][k]:.2f}x |" for k, v in e["docs_per_s"].items()]
        lines.append("")
    if "decode" in r:
        d = r["decode"]
        lines += [
            f"decoding: {d['params'] / 1e6:.1f}M params, prompt {d['prompt_len']}, "
            f"{d['new_tokens']} new tokens, "
            f"greedy tokens identical: {d['greedy_tokens_identical']}",
            f"weights read per token {d['weight_bytes_per_token'] / 2**20:.0f} MiB, read bandwidth "
            f"{d['read_bandwidth_GBps']:.1f} GB/s -> limit {d['bandwidth_limit_tokens_per_s']:.1f} tokens/s",
            "",
            "| contestant | tokens/s | of the bandwidth limit |",
            "|---|---:|---:|",
        ]
        lines += [
            f"| {k} | {v:.1f} | {d['fraction_of_bandwidth_limit'][k]:.0%} |"
            for k, v in d["tokens_per_s"].items()
        ]
        lines.append(f"\nmultihead / transformers: {d['ratio_vs_transformers']:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
