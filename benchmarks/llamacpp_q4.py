"""The packaged SmolLM2-135M-Instruct Q4_1 file on both sides: our run of its own blocks
(``mh.pretrained.from_gguf``, which keeps Q4_1 / Q8_0 blocks and runs the native block products) against
``llama-bench`` and ``llama-simple`` on the same file.

    python benchmarks/llamacpp_q4.py --bin /work/llamacpp/build/bin --threads 1 2 --runs 4 --json out.json

Measured, ``--runs`` times interleaved (llama.cpp, then ours, at each thread count), medians reported:

- decode: ``llama-bench -n NEW -d CONTEXT -p 0`` against ours the same way (a CONTEXT-token prompt, then
  NEW greedy tokens; ours ``(NEW - 1) / (t(generate NEW) - t(generate 1))``, the fastest of 3 each:
  :func:`llamacpp_decode.our_rate`, as its model has no native greedy runs yet);
- prompt processing: ``llama-bench -p CONTEXT -n 0`` against ours: the CONTEXT-token prompt into a fresh
  cache and the head on its last row, the fastest of 3;
- greedy tokens: ``llama-simple -n 64`` on three prompts against our ``generate`` (the texts compared;
  where they part, the token and our logit margin there);
- perplexity: ``llama-perplexity -c 512`` against ours by its method on the same text
  (benchmarks/llamacpp_perplexity.py's ``ours_chunked``), both on the file's blocks.

Builds nothing; benchmarks/LLAMACPP.md says how to build llama.cpp offline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch

import multihead as mh

sys.path.insert(0, str(Path(__file__).parent))
from llamacpp_decode import llamacpp_rate, our_rate
from llamacpp_perplexity import held_out_text, llamacpp, ours_chunked

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")


def llamacpp_prompt_rate(bin_dir: Path, gguf: Path, threads: int, context: int) -> float:
    """llama-bench's prompt processing tokens/s of a ``context``-token prompt, one run."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(context)]
    cmd += ["-n", "0", "-r", "1", "-o", "json"]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200)
    return float(json.loads(done.stdout)[0]["avg_ts"])


def our_prompt_rate(model: mh.TransformerLM, prompt: torch.Tensor, reps: int = 3) -> float:
    """Our tokens/s of ``prompt`` (1, N) into a fresh cache, the head on its last row; fastest of reps."""
    best = float("inf")
    for _ in range(reps):
        cache = model.make_cache(1, prompt.shape[1] + 1)
        t = time.perf_counter()
        with torch.no_grad():
            model.lm_head(model.hidden_states(prompt, cache=cache)[:, -1:])  # (1, 1, V)
        best = min(best, time.perf_counter() - t)
    return prompt.shape[1] / best


def greedy_against_llamacpp(model: mh.TransformerLM, bin_dir: Path, gguf: Path, n: int) -> list[dict]:
    """Per prompt: whether our ``n`` greedy tokens' text equals llama-simple's, else where they part."""
    tok = model.tokenizer
    out = []
    for text in PROMPTS:
        done = subprocess.run(
            [str(bin_dir / "llama-simple"), "-m", str(gguf), "-n", str(n), text],
            check=True,
            capture_output=True,
            text=True,
            timeout=600,
        )
        at = done.stdout.find(text)
        theirs = done.stdout[at + len(text) :] if at >= 0 else ""
        ids = torch.tensor([tok.encode(text)])  # (1, P)
        with torch.no_grad():
            got = model.generate(ids, n, eos_token_id=[])[0, ids.shape[1] :].tolist()
        part = next((i for i in range(len(got)) if not theirs.startswith(tok.decode(got[: i + 1]))), None)
        row: dict = {"prompt": text, "same": part is None, "ours": tok.decode(got), "theirs": theirs[:400]}
        if part is not None:
            with torch.no_grad():
                logits = model(torch.tensor([ids[0].tolist() + got[:part]]))[0, -1]  # (V,)
            top = logits.topk(2).values
            row |= {"parts_at": part, "margin": float(top[0] - top[1])}
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--bin", type=Path, required=True, help="llama.cpp's build/bin (llama-bench, llama-simple)"
    )
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--greedy", type=int, default=64, help="greedy tokens compared (0: none)")
    ap.add_argument("--perplexity", type=int, default=512, help="llama-perplexity's -c (0: not scored)")
    ap.add_argument(
        "--gguf", type=Path, help="another file (a llama-quantize copy); default the packaged one"
    )
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    gguf = mh.pretrained.smollm2_path() if a.gguf is None else a.gguf
    model = mh.pretrained.from_gguf(gguf)  # the file's Q4_1 / Q8_0 blocks kept
    prompt = torch.randint(0, model.vocab_size, (1, a.context), generator=torch.Generator().manual_seed(0))
    samples: dict[str, list[float]] = {}
    for run in range(a.runs):
        for t in a.threads:
            torch.set_num_threads(t)
            pairs = {
                f"decode t{t} llama.cpp": partial(llamacpp_rate, a.bin, gguf, t, a.new, a.context),
                f"decode t{t} ours": partial(our_rate, model, prompt, a.new),
                f"prompt t{t} llama.cpp": partial(llamacpp_prompt_rate, a.bin, gguf, t, a.context),
                f"prompt t{t} ours": partial(our_prompt_rate, model, prompt),
            }
            for name, fn in pairs.items():
                samples.setdefault(name, []).append(fn())
            print(f"run {run}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items() if f"t{t}" in k))
    medians = {k: statistics.median(v) for k, v in samples.items()}
    result = {"file": gguf.name, "context": a.context, "new": a.new, "runs": a.runs, "median": medians}
    result["samples"] = samples
    result["ratios"] = {
        k.replace(" ours", ""): medians[k] / medians[k.replace("ours", "llama.cpp")]
        for k in medians
        if k.endswith("ours")
    }
    torch.set_num_threads(a.threads[0])
    if a.greedy:
        result["greedy"] = greedy_against_llamacpp(model, a.bin, gguf, a.greedy)
    if a.perplexity:
        text = held_out_text()
        theirs, pm, _ = llamacpp(a.bin / "llama-perplexity", gguf, text, a.perplexity, a.threads[0])
        ours, scored = ours_chunked(model, text, a.perplexity)
        result["perplexity"] = {"llama.cpp": theirs, "+/-": pm, "ours": ours, "ratio": ours / theirs}
        result["perplexity"]["tokens"] = scored
        print("perplexity", result["perplexity"])
    print(json.dumps({k: result[k] for k in ("median", "ratios")}, indent=1))
    for g in result.get("greedy", []):
        print(g["prompt"], "same" if g["same"] else f"parts at {g['parts_at']} (margin {g['margin']:.3f})")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
