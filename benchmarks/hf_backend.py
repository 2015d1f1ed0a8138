"""multihead as a Hugging Face attention backend vs transformers' own "sdpa" and "eager".

A Mistral-shaped random-weight model (2 layers, d=512, 8 heads, sliding window 1024) built offline:

* prefill at 4K / 8K / 16K tokens: wall time (interleaved rounds in this process, median) and peak extra
  resident memory of the forward (a fresh subprocess per cell, ru_maxrss after minus before), and the
  max |difference| of the last hidden state against "sdpa" (fp32);
* decode: tokens/s of ``model.generate`` (greedy, dynamic cache) with "multihead" vs "sdpa".

    python benchmarks/hf_backend.py                 # the whole table (minutes on a 2-core machine)
    python benchmarks/hf_backend.py --sizes 4096 --rounds 1 --decode-tokens 16   # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

WINDOW = 1024


def build(max_len: int):
    import transformers

    import multihead.hf

    multihead.hf.register()
    cfg = transformers.MistralConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        sliding_window=WINDOW,
        max_position_embeddings=max_len,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def eager_fits(n: int) -> bool:
    """Eager holds a few (1, 8, n, n) fp32 score tensors per layer: keep it to <= 8K tokens here."""
    return n <= 8192


def prefill(model, impl: str, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    model.set_attn_implementation(impl)
    t = time.perf_counter()
    with torch.no_grad():
        h = model.model(input_ids=ids, use_cache=False).last_hidden_state
    return time.perf_counter() - t, h


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_child(impl: str, n: int) -> None:
    """Subprocess mode: one prefill, print the peak RSS above the resting RSS in MiB as JSON (Linux: the
    high-water mark is reset through /proc/self/clear_refs after the model is built)."""
    model = build(n)
    ids = torch.randint(0, 1024, (1, n), generator=torch.Generator().manual_seed(1))
    prefill(model, impl, ids[:, :256])  # warm up code paths at a small size
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    prefill(model, impl, ids)
    print(json.dumps({"peak_mib": (_status_kib("VmHWM") - before) / 1024}))


def peak(impl: str, n: int) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--peak", impl, str(n), "--threads", str(torch.get_num_threads())],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"])


def decode(model, impl: str, prompt: torch.Tensor, new: int) -> float:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        t = time.perf_counter()
        model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
        return new / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="*", default=[4096, 8192, 16384])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds per size")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: a shared machine)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--peak", nargs=2, metavar=("IMPL", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.peak:
        peak_child(args.peak[0], int(args.peak[1]))
        return

    model = build(max([*args.sizes, args.decode_prompt + args.decode_tokens]))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; Mistral-shaped: 2 layers, d=512, "
        f"8 heads, window {WINDOW}, fp32, batch 1\n"
    )
    print("| N | impl | prefill s (median) | x vs sdpa | peak extra MiB | max abs diff vs sdpa |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in args.sizes:
        ids = torch.randint(0, 1024, (1, n), generator=torch.Generator().manual_seed(1))
        impls = ["multihead", "sdpa"] + (["eager"] if eager_fits(n) else [])
        times: dict[str, list[float]] = {i: [] for i in impls}
        outs: dict[str, torch.Tensor] = {}
        for _ in range(args.rounds):
            for impl in impls:
                dt, h = prefill(model, impl, ids)
                times[impl].append(dt)
                outs[impl] = h
        base = statistics.median(times["sdpa"])
        for impl in impls:
            med = statistics.median(times[impl])
            mem = "-" if args.no_memory else f"{peak(impl, n):.0f}"
            diff = float((outs[impl] - outs["sdpa"]).abs().max())
            print(f"| {n} | {impl} | {med:.2f} | {base / med:.2f} | {mem} | {diff:.1e} |", flush=True)
        del outs
    # token 0 is the pad id given to generate: keep it out of the prompt, or generate masks those tokens
    prompt = torch.randint(1, 1024, (1, args.decode_prompt), generator=torch.Generator().manual_seed(2))
    print(
        f"\ndecode: generate {args.decode_tokens} tokens after a {args.decode_prompt}-token prompt (greedy, "
        "dynamic cache), interleaved x3, median\n"
    )
    print("| impl | tok/s | x vs sdpa |")
    print("|---|---:|---:|")
    rates: dict[str, list[float]] = {"multihead": [], "sdpa": []}
    decode(model, "sdpa", prompt[:, :16], 4)  # warm up
    decode(model, "multihead", prompt[:, :16], 4)
    for _ in range(3):
        for impl in rates:
            rates[impl].append(decode(model, impl, prompt, args.decode_tokens))
    base = statistics.median(rates["sdpa"])
    for impl, r in rates.items():
        print(f"| {impl} | {statistics.median(r):.1f} | {statistics.median(r) / base:.2f} |")


if __name__ == "__main__":
    main()
