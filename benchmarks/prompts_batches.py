"""Prompts and batches on the CPU: the time to the first token after prompts of a few lengths, and the
decode step of a batch of sequences, for the int8 model (groups of 32, int8 cache) and the fp32 and bf16
models with native decode kernels (``mh.quant.quantize``), and, given a llama.cpp build and the model as
a q8_0 GGUF, llama.cpp's prompt processing on the same lengths (``llama-bench -p L -n 0``).

    python benchmarks/prompts_batches.py --threads 1
    python benchmarks/prompts_batches.py --threads 1 --llama-bench BUILD/bin/llama-bench \\
        --gguf WORK/model-q8_0.gguf

The GGUF is the one ``benchmarks/llamacpp_decode.py --work WORK`` writes (the same preset, the same
random weights; benchmarks/LLAMACPP.md says how to build llama.cpp offline). A prompt's time is
``model.generate(prompt, 1)``: the prompt's layers, the output head on its last position and the pick;
the models are timed interleaved (:func:`multihead.cost.timing.measure_all`, the fastest sample: load
only ever adds time). A batch's step is ``(t(9) - t(1)) / 8`` of ``generate`` on a batch of 16-token
prompts. llama.cpp's figure is its prompt-processing rate, which does not include a pick.

Several rows of activations in an int8 model run the native multi-row product
(:func:`multihead.native.int8.gemm_q8`): each row rounded to int8 as a decode step rounds it, the weights
read once for up to 64 rows. In the fp32 and bf16 models up to four rows (a small batch's step) run the
native row kernels, the weights read once (:func:`multihead.native.run_rows`); more rows are
``F.linear``'s (docs/cpu-decode.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch

import multihead as mh
from multihead.cost import timing
from multihead.models import quant

NEW = 9  # tokens generated to time a batch's steps: (t(NEW) - t(1)) / (NEW - 1)


def build(preset: str) -> dict[str, torch.nn.Module]:
    """The preset's random-weight model (seed 0) as int8 (groups of 32, int8 cache) and in fp32 and bf16,
    each with the native kernels (``quantize``'s "auto" on a TransformerLM)."""
    torch.manual_seed(0)
    base = mh.pretrained.random_lm(preset).eval()
    return {
        "int8": quant.quantize(base, weights="int8", kv="int8", kernel="native", group_size=32),
        "fp32": quant.quantize(base, weights="fp32", kv=None),
        "bf16": quant.quantize(base, weights="bf16", kv=None),
    }


def first_token(models: dict[str, torch.nn.Module], prompt: torch.Tensor, samples: int) -> dict[str, float]:
    """Seconds to the first token after ``prompt`` (1, L) for each model, interleaved, the fastest sample."""
    calls = {name: (lambda m=m: m.generate(prompt, 1)) for name, m in models.items()}
    with torch.inference_mode():
        times = timing.measure_all(calls, min_samples=samples, max_seconds=60.0)
    return {name: _best(t) for name, t in times.items()}


def batch_step(models: dict[str, torch.nn.Module], prompts: torch.Tensor, samples: int) -> dict[str, float]:
    """Seconds of one decode step of the batch ``prompts`` (B, L) for each model: ``(t(NEW) - t(1)) /
    (NEW - 1)`` of ``generate``, each time the fastest of interleaved samples."""
    calls = {}
    for name, m in models.items():
        for n in (1, NEW):
            calls[f"{name}/{n}"] = lambda m=m, n=n: m.generate(prompts, n)
    with torch.inference_mode():
        times = timing.measure_all(calls, min_samples=samples, max_seconds=60.0)
    return {name: (_best(times[f"{name}/{NEW}"]) - _best(times[f"{name}/1"])) / (NEW - 1) for name in models}


def _best(t: timing.Timing) -> float:
    if t.best is None:
        raise ValueError(f"a call was too short to measure: {t.why}")
    return t.best


def llamacpp_prompts(
    bench: Path, gguf: Path, threads: int, lengths: list[int], runs: int
) -> dict[int, float]:
    """llama-bench's prompt-processing tokens/s for each prompt length (``-p L -n 0``, ``runs`` runs)."""
    cmd = [str(bench), "-m", str(gguf), "-t", str(threads), "-n", "0", "-r", str(runs), "-o", "json"]
    cmd += ["-p", ",".join(map(str, lengths))]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200)
    return parse_llama_bench(done.stdout)


def parse_llama_bench(out: str) -> dict[int, float]:
    """Prompt length -> tokens/s from ``llama-bench -o json`` output (its prompt-processing rows)."""
    rows = json.loads(out)
    return {int(r["n_prompt"]): float(r["avg_ts"]) for r in rows if int(r.get("n_gen", 0)) == 0}


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    models = build(args.preset)
    vocab = models["fp32"].lm_head.out_features
    g = torch.Generator().manual_seed(1)
    prompts = {}
    for length in args.lengths:
        prompt = torch.randint(4, vocab, (1, length), generator=g)  # (1, L)
        prompts[length] = first_token(models, prompt, args.samples)
    batches = {}
    for b in args.batches:
        batch = torch.randint(4, vocab, (b, 16), generator=g)  # (B, 16)
        batches[b] = batch_step(models, batch, args.samples)
    theirs = {}
    if args.llama_bench is not None:
        if args.gguf is None:
            raise ValueError("--llama-bench needs --gguf (the model as a q8_0 GGUF)")
        theirs = llamacpp_prompts(args.llama_bench, args.gguf, args.threads, args.lengths, args.samples)
    return {"preset": args.preset, "threads": args.threads, "prompts": prompts, "batches": batches,
            "llamacpp_prompt_tok_s": theirs}  # fmt: skip


def table(result: dict) -> str:
    names = list(next(iter(result["prompts"].values())).keys())  # the models, in build()'s order
    theirs = result["llamacpp_prompt_tok_s"]
    lines = [
        f"{result['preset']}, {result['threads']} thread(s); time to the first token "
        "(tokens/s of the prompt)",
        f"| prompt | {' | '.join(names)} | llama.cpp q8_0 prompt | int8 / llama.cpp |",
        "|---:|" + "---:|" * (len(names) + 2),
    ]
    for length, t in result["prompts"].items():
        other = theirs.get(length)
        cells = [f"{t[k] * 1e3:.0f} ms ({length / t[k]:.0f})" for k in names]
        ratio = "-" if other is None else f"{length / t['int8'] / other:.2f}x"
        lines.append(
            f"| {length} | {' | '.join(cells)} | {'-' if other is None else f'{other:.0f} tok/s'} | {ratio} |"
        )
    lines += [
        "",
        f"| batch (16-token prompts): one step | {' | '.join(names)} |",
        "|---:|" + "---:|" * len(names),
    ]
    for b, t in result["batches"].items():
        cells = [f"{t[k] * 1e3:.1f} ms ({b / t[k]:.0f} tok/s)" for k in names]
        lines.append(f"| {b} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-155m", help="a random-weight model shape (default llama-155m)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lengths", type=int, nargs="+", default=[8, 64, 256], help="prompt lengths")
    p.add_argument(
        "--batches", type=int, nargs="+", default=[2, 4, 16], help="batch sizes of the decode rows"
    )
    p.add_argument("--samples", type=int, default=3, help="samples of each call (llama-bench: its runs)")
    p.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench, for its prompt rates")
    p.add_argument(
        "--gguf", type=Path, help="the model as a q8_0 GGUF (benchmarks/llamacpp_decode.py --work)"
    )
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    for name in ("threads", "samples"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if min(args.lengths + args.batches) < 1:
        p.error(f"--lengths and --batches must be at least 1, got {args.lengths} and {args.batches}")
    result = run(args)
    print(table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
