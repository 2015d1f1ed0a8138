"""Decode throughput of ``mh.serve.Engine`` at 1 / 4 / 16 concurrent sequences against one sequence at a
time (``model.generate`` of each prompt alone), on SmolLM2-135M-Instruct, and optionally llama.cpp's
``llama-batched-bench`` on the same file and threads.

    python benchmarks/serve_batching.py [--npp 128] [--ntg 32] [--npl 1,4,16] [--threads 2] [--repeats 3]
                                        [--weights fp32|int8] [--mixed] [--llama-bin BUILD/bin]
                                        [--json out.json]

The shape is llama-batched-bench's: ``npl`` sequences, each a prompt of ``npp`` tokens then ``ntg``
generated ones. For each ``npl`` the engine gets all prompts at once: its first step prefills them in
one packed forward (S_PP, prompt tokens/s), the steps after it decode every sequence in one batched
forward (S_TG: generated tokens/s summed over the sequences; ``--mixed``: prompt lengths spread over
npp/2 .. 3 npp/2). The baseline decodes one prompt alone with
``model.generate`` (its native one-token steps where the model allows them): S_TG = (ntg - 1) / (time of
ntg tokens - time of 1 token); one sequence after another, that is also its rate at any npl. The runs
interleave (baseline, then every npl, ``--repeats`` times) and the medians are printed with the ratios
engine / baseline. Greedy, no stop id, random prompt ids (as llama-batched-bench).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch

import multihead as mh
from multihead.serve import Engine, Request, SamplingParams


def baseline(model, prompt: list[int], ntg: int) -> float:
    """One sequence alone: generated tokens/s of model.generate after its first token."""
    ids = torch.tensor([prompt])
    model.generate(ids, 2, eos_token_id=())  # warm: the first native step builds and checks its plan
    t = time.perf_counter()
    model.generate(ids, 1, eos_token_id=())
    one = time.perf_counter() - t
    t = time.perf_counter()
    model.generate(ids, ntg, eos_token_id=())
    return (ntg - 1) / (time.perf_counter() - t - one)


def engine_run(model, prompts: list[list[int]], ntg: int) -> tuple[float, float]:
    """(prompt tokens/s of the first step, generated tokens/s of the steps after it) for all prompts."""
    n = len(prompts)
    engine = Engine(model, max_seqs=n, max_prefill_tokens=sum(len(p) for p in prompts), num_blocks=n * 16)
    for p in prompts:
        engine.add(Request(p, SamplingParams(max_tokens=ntg, stop_token_ids=())))
    t = time.perf_counter()
    engine.step()
    prefill = time.perf_counter() - t
    assert not engine.scheduler.waiting, "every prompt is prefilled in the first step"
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return sum(len(p) for p in prompts) / prefill, n * (ntg - 1) / (time.perf_counter() - t)


def llama_batched(
    bin_dir: Path, gguf: Path, npp: int, ntg: int, npl: list[int], threads: int
) -> dict[int, float]:
    """llama-batched-bench's S_TG (t/s) per npl on the same file."""
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-npp", str(npp), "-ntg", str(ntg)]
    cmd += ["-npl", ",".join(map(str, npl)), "-t", str(threads), "-c", str((npp + ntg) * max(npl) + 64)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rates = {}
    for (
        line
    ) in out.splitlines():  # |  PP |  TG |  B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[0] or "x"):
            rates[int(cells[2])] = float(cells[7])
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--npp", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--ntg", type=int, default=32, help="generated tokens per sequence")
    ap.add_argument("--npl", default="1,4,16", help="concurrent sequences, comma-separated")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (llama.cpp -t)")
    ap.add_argument(
        "--weights",
        choices=("fp32", "int8"),
        default="fp32",
        help="fp32, or int8 with a scale per 32 weights",
    )
    ap.add_argument("--mixed", action="store_true", help="prompt lengths spread over npp/2 .. 3 npp/2")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians are printed")
    ap.add_argument("--llama-bin", type=Path, default=None, help="llama.cpp's bin folder, to run it too")
    ap.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = ap.parse_args()
    npl = [int(x) for x in args.npl.split(",")]
    torch.set_num_threads(args.threads)  # an application: the whole process on --threads
    model = mh.pretrained.smollm2()
    if (
        args.weights == "int8"
    ):  # llama.cpp's Q8_0 rounding: a scale per 32 weights, native several-row products
        model = mh.quant.quantize(model, weights="int8", kv=None, group_size=32)
    g = torch.Generator().manual_seed(0)
    lengths = [args.npp] * max(npl)
    if args.mixed:  # the same total as npp each, spread evenly (the baseline's prompt has npp tokens)
        lengths = [args.npp // 2 + (args.npp * i) // max(max(npl) - 1, 1) for i in range(max(npl))]
        lengths[0] = args.npp
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]
    base: list[float] = []
    pp: dict[int, list[float]] = {n: [] for n in npl}
    tg: dict[int, list[float]] = {n: [] for n in npl}
    with torch.inference_mode():
        for r in range(args.repeats):
            base.append(baseline(model, prompts[0], args.ntg))
            for n in npl:
                a, b = engine_run(model, prompts[:n], args.ntg)
                pp[n].append(a)
                tg[n].append(b)
            print(f"round {r + 1}/{args.repeats}: baseline {base[-1]:.1f} tok/s, engine "
                  + ", ".join(f"npl={n} {tg[n][-1]:.1f}" for n in npl), flush=True)  # fmt: skip
    b = statistics.median(base)
    spread = f" (mixed: {min(lengths)}..{max(lengths)} tokens)" if args.mixed else ""
    shape = f"npp={args.npp}{spread} ntg={args.ntg}, {args.threads} threads"
    weights = "Q4_1 dequantized to fp32" if args.weights == "fp32" else "int8 weights, a scale per 32"
    print(f"\nSmolLM2-135M ({weights}), {shape}")
    print(f"one sequence at a time (model.generate): S_TG {b:.1f} tok/s")
    print("| npl | engine S_PP tok/s | engine S_TG tok/s | S_TG / one at a time | S_TG / engine npl=1 |")
    print("|---:|---:|---:|---:|---:|")
    first = statistics.median(tg[npl[0]])
    rows = {}
    for n in npl:
        s_pp, s_tg = statistics.median(pp[n]), statistics.median(tg[n])
        rows[n] = {"s_pp": s_pp, "s_tg": s_tg, "vs_one_at_a_time": s_tg / b, "vs_engine_first": s_tg / first}
        print(f"| {n} | {s_pp:.1f} | {s_tg:.1f} | {s_tg / b:.2f}x | {s_tg / first:.2f}x |")
    result = {
        "weights": args.weights,
        "npp": args.npp,
        "ntg": args.ntg,
        "threads": args.threads,
        "baseline_s_tg": b,
        "engine": rows,
    }
    if args.llama_bin is not None:
        rates = llama_batched(
            args.llama_bin, mh.pretrained.smollm2_path(), args.npp, args.ntg, npl, args.threads
        )
        result["llama_batched_bench_s_tg"] = rates
        print("\n| npl | llama-batched-bench S_TG tok/s | engine / llama.cpp |")
        print("|---:|---:|---:|")
        for n in npl:
            if n in rates:
                print(f"| {n} | {rates[n]:.1f} | {rows[n]['s_tg'] / rates[n]:.2f}x |")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
