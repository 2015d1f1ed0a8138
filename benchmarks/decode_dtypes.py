"""Decode speed per dtype: fp32, bf16 and int8 multihead against Hugging Face, and the bandwidth limit.

    python benchmarks/decode_dtypes.py                          # llama-155m, 256-token prompt, 64 new
    python benchmarks/decode_dtypes.py --preset llama-tiny --threads 1 --rounds 3 --json

A LLaMA-shaped model with random weights is built once by transformers (``LlamaForCausalLM`` from the
preset's config) and converted with ``mh.pretrained.from_hf``, so both sides hold the same weights.
Contestants: multihead and transformers in fp32 and in bf16 (``model.to(torch.bfloat16)``), and
``mh.quant.quantize(model, weights="int8", kv="int8")`` of the fp32 and of the bf16 model (int8
weights per output channel, int8 KV cache). Greedy decoding; decode tokens/s excludes the prefill:
``(new - 1) / (t(new tokens) - t(1 token))``, each time the fastest of the rounds (load on a shared
machine only ever adds time; with too few new tokens the prefill's noise swamps the difference).

The bandwidth limit of a contestant is the measured read bandwidth divided by the bytes of weights every
decode step reads (all parameters and buffers but the input embedding, which is read one row at a time;
a tied output head is counted). The read bandwidth is the best of several matrix-vector products over
1 GiB of fp32 (the operation decoding repeats), measured again in every round; the maximum is kept.

Contestants run interleaved, round after round, so a load change on a shared machine hits all of them;
the ratios come from the same run. Needs transformers.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable

import torch
from torch import nn

import multihead as mh


def step_bytes(model: nn.Module, embedding: str) -> int:
    """Bytes one decode step reads: every parameter and buffer but the input embedding's (one row of it
    is read), each storage once; a storage the output head shares with the embedding is counted."""
    emb = model.get_submodule(embedding)
    skip = {t.untyped_storage().data_ptr() for t in [*emb.parameters(), *emb.buffers()]}
    head = model.get_submodule("lm_head")
    skip -= {t.untyped_storage().data_ptr() for t in [*head.parameters(), *head.buffers()]}
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Best-of-``reps`` read bandwidth (bytes/s) of a matrix-vector product over ``nbytes`` of fp32."""
    n = int((nbytes // 4) ** 0.5)
    a, x = torch.randn(n, n), torch.randn(n)
    best = 0.0
    for _ in range(reps):
        start = time.perf_counter()
        torch.mv(a, x)
        best = max(best, a.numel() * 4 / (time.perf_counter() - start))
    return best


def timed(gen: Callable[[int], torch.Tensor], n: int) -> float:
    """Seconds to generate n tokens (prefill included)."""
    start = time.perf_counter()
    gen(n)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    import transformers as tf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-155m", choices=sorted(mh.pretrained.PRESETS))
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (default 256)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the fastest is reported")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    preset = mh.pretrained.PRESETS[args.preset]
    config = tf.LlamaConfig(**{k: v for k, v in preset.items() if k != "model_type"})
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None
    torch.manual_seed(0)
    hf32 = tf.LlamaForCausalLM(config).eval()
    ours32 = mh.pretrained.from_hf(hf32)
    assert isinstance(ours32, mh.TransformerLM)
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    ours16 = copy.deepcopy(ours32).to(torch.bfloat16)
    int8_32 = mh.quant.quantize(ours32, weights="int8", kv="int8")
    int8_16 = mh.quant.quantize(ours16, weights="int8", kv="int8")
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))

    def hf_gen(model: nn.Module) -> Callable[[int], torch.Tensor]:
        return lambda n: model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)  # type: ignore[operator]

    def our_gen(model: nn.Module) -> Callable[[int], torch.Tensor]:
        return lambda n: model.generate(prompt, n)  # type: ignore[operator]

    contestants = {
        "transformers fp32": (hf_gen(hf32), step_bytes(hf32, "model.embed_tokens")),
        "multihead fp32": (our_gen(ours32), step_bytes(ours32, "embed")),
        "transformers bf16": (hf_gen(hf16), step_bytes(hf16, "model.embed_tokens")),
        "multihead bf16": (our_gen(ours16), step_bytes(ours16, "embed")),
        "multihead int8 (fp32 activations)": (our_gen(int8_32), step_bytes(int8_32, "embed")),
        "multihead int8 (bf16 activations)": (our_gen(int8_16), step_bytes(int8_16, "embed")),
    }
    one: dict[str, list[float]] = {k: [] for k in contestants}
    many: dict[str, list[float]] = {k: [] for k in contestants}
    bandwidth = 0.0
    with torch.inference_mode():
        same = {
            "bf16": torch.equal(hf_gen(hf16)(8), our_gen(ours16)(8)),
            "fp32": torch.equal(hf_gen(hf32)(8), our_gen(ours32)(8)),
        }
        for _ in range(args.rounds):
            bandwidth = max(bandwidth, read_bandwidth())
            for name, (gen, _) in contestants.items():
                one[name].append(timed(gen, 1))
                many[name].append(timed(gen, args.new_tokens))
    # the fastest of the rounds: on a shared machine every disturbance only adds time
    tok_s = {k: (args.new_tokens - 1) / max(min(many[k]) - min(one[k]), 1e-9) for k in contestants}
    limit = {k: bandwidth / b for k, (_, b) in contestants.items()}
    report = {
        "preset": args.preset,
        "threads": torch.get_num_threads(),
        "prompt_len": args.prompt,
        "new_tokens": args.new_tokens,
        "greedy_8_tokens_identical_to_transformers": same,
        "read_bandwidth_GBps": bandwidth / 1e9,
        "bytes_per_token": {k: b for k, (_, b) in contestants.items()},
        "tokens_per_s": tok_s,
        "bandwidth_limit_tokens_per_s": limit,
        "fraction_of_limit": {k: tok_s[k] / limit[k] for k in tok_s},
        "vs_transformers_fp32": {k: v / tok_s["transformers fp32"] for k, v in tok_s.items()},
        "vs_transformers_same_dtype": {
            "multihead fp32": tok_s["multihead fp32"] / tok_s["transformers fp32"],
            "multihead bf16": tok_s["multihead bf16"] / tok_s["transformers bf16"],
        },
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return report
    print(
        f"{args.preset} decode, prompt {args.prompt}, {args.new_tokens} new tokens, "
        f"{report['threads']} torch threads, best of {args.rounds} rounds; "
        f"read bandwidth {report['read_bandwidth_GBps']:.1f} GB/s "
        f"(max of {args.rounds} probes); greedy tokens equal transformers: {same}"
    )
    head = f"{'contestant':36s} {'MB/token':>9s} {'tok/s':>7s} {'limit':>7s} {'of limit':>9s}"
    print(f"{head} {'vs HF fp32':>11s}")
    for name in contestants:
        print(
            f"{name:36s} {report['bytes_per_token'][name] / 1e6:9.1f} {tok_s[name]:7.1f} {limit[name]:7.1f} "
            f"{report['fraction_of_limit'][name]:8.0%} {report['vs_transformers_fp32'][name]:10.2f}x"
        )
    same_dtype = report["vs_transformers_same_dtype"]
    print(f"multihead / transformers, same dtype: fp32 {same_dtype['multihead fp32']:.2f}x, ", end="")
    print(f"bf16 {same_dtype['multihead bf16']:.2f}x")
    return report


if __name__ == "__main__":
    main()
