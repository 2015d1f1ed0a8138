"""The packaged SmolLM2-135M-Instruct Q4_1 file in multihead and in llama.cpp: perplexity, greedy tokens,
decode and prompt speed on the same file and text.

    python benchmarks/llamacpp_smollm2.py --bin BUILD/bin --weights fp32 --threads 2 --greedy 32
    python benchmarks/llamacpp_smollm2.py --bin BUILD/bin --threads 1 2 --runs 4 --context 256

``--weights fp32``: our model is the file's blocks dequantized to fp32 (``from_gguf(path,
dequantize=True)``, what ``mh.pretrained.smollm2()`` gives); llama.cpp multiplies the Q4_1 blocks
natively, rounding the activations to 8 bits per block of 32. Both score the held-out Wikipedia text of
``docs/real-lm.md`` (``mh.eval.wikipedia.held_out_texts(8, 2000)`` joined with blank lines). llama.cpp's
method is not the sliding window of ``mh.eval.perplexity``: it cuts the tokens into chunks of ``-c``
tokens, puts the BOS token first in each chunk where the file asks for it, and scores only the second half
of each chunk. :func:`ours_chunked` repeats exactly that on our model, so the two numbers measure the same
thing; our sliding window on the same text is printed for scale. Greedy tokens (``--greedy N``):
``llama-simple -n N`` against ``model.generate`` on three training-slice excerpts and a chat turn in the
file's template; where the texts part, our logit margin there (our first choice against llama.cpp's
token).

``--weights blocks``: our model keeps the file's Q4_1 / Q8_0 blocks (``from_gguf(path)``, the native block
products). Measured ``--runs`` times interleaved (llama.cpp, then ours, at each thread count), medians:
decode (``llama-bench -n NEW -d CONTEXT -p 0`` against ours the same way: a CONTEXT-token prompt, then NEW
greedy tokens, ``llamacpp_decode.our_rate``); prompt processing (``llama-bench -p CONTEXT -n 0`` against
the CONTEXT-token prompt into a fresh cache and the head on its last row, the fastest of 3); greedy tokens
(``llama-simple -n N`` on three fixed prompts, stop ids off); perplexity by llama.cpp's chunks, both on the
blocks. ``--gguf`` takes another file (a ``llama-quantize --allow-requantize`` copy).

Builds nothing; benchmarks/LLAMACPP.md says how to build llama.cpp offline.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

import multihead as mh
from multihead.eval import perplexity_scores, wikipedia

sys.path.insert(0, str(Path(__file__).parent))
from llamacpp_decode import llamacpp_rate, our_rate


def held_out_text() -> str:
    return "\n\n".join(wikipedia.held_out_texts(8, 2000))


def ours_chunked(model, text: str, context: int) -> tuple[float, int]:
    """llama-perplexity's method on our model: (perplexity, tokens scored)."""
    tok = model.tokenizer
    ids = tok.encode(text)  # BOS first where the file asks for it, as common_tokenize(..., true)
    first = context // 2
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) // context * context, context):
            chunk = list(ids[start : start + context])
            if tok.add_bos and tok.bos_token_id is not None:
                chunk[0] = tok.bos_token_id  # llama.cpp puts BOS first in every chunk
            x = torch.tensor([chunk])  # (1, c)
            logp = torch.log_softmax(model(x)[0].double(), -1)  # (c, V)
            targets = torch.tensor(chunk[first + 1 :])  # (c - first - 1,)
            nll -= float(logp[first:-1].gather(1, targets[:, None]).sum())
            count += len(targets)
    return math.exp(nll / count), count


def llamacpp(binary: Path, gguf: Path, text: str, context: int, threads: int) -> tuple[float, float, str]:
    """llama-perplexity's final estimate: (perplexity, its +/-, the tail of its output)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "text.txt"
        path.write_text(text, encoding="utf-8")
        argv = [str(binary), "-m", str(gguf), "-f", str(path), "-c", str(context), "-b", str(context)]
        done = subprocess.run([*argv, "-t", str(threads)], capture_output=True, text=True, check=True)
    out = done.stdout + done.stderr
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
    if found is None:
        raise SystemExit(f"no final estimate in llama-perplexity's output:\n{out[-2000:]}")
    return float(found.group(1)), float(found.group(2)), out[-600:]


def prompts(model) -> list[str]:
    """Three excerpts of the training slice and one chat turn in the model's template."""
    texts = [wikipedia.excerpt(a.text, 300) for a in wikipedia.training()[:3]]
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = model.tokenizer.apply_chat_template(question, tokenize=False)
    return [*texts, chat]


def llamacpp_text(binary: Path, gguf: Path, prompt: str, n: int) -> str:
    """What ``llama-simple`` writes after the prompt (its greedy continuation)."""
    done = subprocess.run(
        [str(binary), "-m", str(gguf), "-n", str(n), prompt], capture_output=True, check=True
    )
    out = done.stdout.decode("utf-8", errors="replace").removesuffix("\n")
    if not out.startswith(prompt):
        raise SystemExit(f"llama-simple did not echo the prompt first:\n{out[:500]!r}")
    return out[len(prompt) :]


def parting(model, prompt: str, theirs: str, n: int) -> dict:
    """Our greedy continuation against llama.cpp's text: where they part, and our logit margin there."""
    tok = model.tokenizer
    ids = torch.tensor([tok.encode(prompt)])  # (1, P)
    with torch.inference_mode():
        new = model.generate(ids, n)[0, ids.shape[1] :].tolist()
    ours = tok.decode(new)
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    doc = {"prompt": prompt, "ours": ours, "llamacpp": theirs, "same_chars": same, "tokens": len(new)}
    if ours == theirs:
        return {**doc, "same_tokens": len(new)}
    k = next((k for k in range(len(new)) if len(tok.decode(new[: k + 1])) > same), len(new))
    start = len(tok.decode(new[:k]))
    their_ids = tok.encode(theirs[start:])
    with torch.inference_mode():
        logits = model(torch.tensor([ids[0].tolist() + new[:k]]))[0, -1].double()  # (V,)
    top = logits.topk(2)
    doc["same_tokens"] = k
    if k < len(new) and their_ids:
        theirs_k = their_ids[0]
        doc["ours_token"], doc["llamacpp_token"] = tok.decode([new[k]]), tok.decode([theirs_k])
        doc["margin"] = float(logits[new[k]] - logits[theirs_k])  # our first choice over llama.cpp's
        doc["top2_margin"] = float(top.values[0] - top.values[1])
        doc["llamacpp_rank"] = int((logits > logits[theirs_k]).sum())  # 0: our first choice
    return doc


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
        theirs = llamacpp_text(bin_dir / "llama-simple", gguf, text, n)
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


def fp32_against_llamacpp(args: argparse.Namespace) -> None:
    """``--weights fp32``: perplexity by llama.cpp's chunks and our sliding window, greedy texts."""
    gguf = mh.pretrained.smollm2_path() if args.gguf is None else args.gguf
    model = mh.pretrained.from_gguf(gguf, dequantize=True)  # the blocks dequantized to fp32
    threads = args.threads[0]
    text = held_out_text()
    theirs, plus_minus, tail = llamacpp(args.bin / "llama-perplexity", gguf, text, args.perplexity, threads)
    torch.set_num_threads(threads)
    chunked, scored = ours_chunked(model, text, args.perplexity)
    sliding = perplexity_scores(model, [text], context=args.perplexity, stride=args.perplexity // 2)
    doc = {
        "gguf": str(gguf),
        "context": args.perplexity,
        "llamacpp": theirs,
        "llamacpp_plus_minus": plus_minus,
        "ours_chunked": chunked,
        "chunked_tokens": scored,
        "ratio": chunked / theirs,
        "ours_sliding": float(sliding),
        "sliding_tokens": sliding.scored,
    }
    print(f"llama.cpp  {theirs:.4f} +/- {plus_minus:.4f} (llama-perplexity, chunks of {args.perplexity})")
    print(f"multihead  {chunked:.4f} (the same chunks, {scored} tokens): {chunked / theirs:.4f}x llama.cpp's")
    window = f"sliding window, stride {args.perplexity // 2}, {sliding.scored} tokens"
    print(f"multihead  {float(sliding):.4f} ({window})")
    print(tail, file=sys.stderr)
    doc["greedy"] = []
    for prompt in prompts(model) if args.greedy else []:
        d = parting(
            model, prompt, llamacpp_text(args.bin / "llama-simple", gguf, prompt, args.greedy), args.greedy
        )
        doc["greedy"].append(d)
        where = "identical" if d["ours"] == d["llamacpp"] else f"part after {d['same_tokens']} tokens"
        margin = ""
        if "margin" in d:
            rank = d["llamacpp_rank"] + 1
            margin = f" (our margin there {d['margin']:.3f} logits, llama.cpp's token our #{rank})"
        print(f"greedy {d['tokens']} tokens: {where}{margin}: {d['ours'][:60]!r}")
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


def blocks_against_llamacpp(args: argparse.Namespace) -> None:
    """``--weights blocks``: decode and prompt rates, greedy tokens, perplexity on the file's blocks."""
    gguf = mh.pretrained.smollm2_path() if args.gguf is None else args.gguf
    model = mh.pretrained.from_gguf(gguf)  # the file's Q4_1 / Q8_0 blocks kept
    prompt = torch.randint(0, model.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    samples: dict[str, list[float]] = {}
    for run in range(args.runs):
        for t in args.threads:
            torch.set_num_threads(t)
            pairs = {
                f"decode t{t} llamargs.cpp": partial(
                    llamacpp_rate, args.bin, gguf, t, args.new, args.context
                ),
                f"decode t{t} ours": partial(our_rate, model, prompt, args.new),
                f"prompt t{t} llamargs.cpp": partial(llamacpp_prompt_rate, args.bin, gguf, t, args.context),
                f"prompt t{t} ours": partial(our_prompt_rate, model, prompt),
            }
            for name, fn in pairs.items():
                samples.setdefault(name, []).append(fn())
            print(f"run {run}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items() if f"t{t}" in k))
    medians = {k: statistics.median(v) for k, v in samples.items()}
    result = {
        "file": gguf.name,
        "context": args.context,
        "new": args.new,
        "runs": args.runs,
        "median": medians,
    }
    result["samples"] = samples
    result["ratios"] = {
        k.replace(" ours", ""): medians[k] / medians[k.replace("ours", "llamargs.cpp")]
        for k in medians
        if k.endswith("ours")
    }
    torch.set_num_threads(args.threads[0])
    if args.greedy:
        result["greedy"] = greedy_against_llamacpp(model, args.bin, gguf, args.greedy)
    if args.perplexity:
        text = held_out_text()
        theirs, pm, _ = llamacpp(args.bin / "llama-perplexity", gguf, text, args.perplexity, args.threads[0])
        ours, scored = ours_chunked(model, text, args.perplexity)
        result["perplexity"] = {"llamargs.cpp": theirs, "+/-": pm, "ours": ours, "ratio": ours / theirs}
        result["perplexity"]["tokens"] = scored
        print("perplexity", result["perplexity"])
    print(json.dumps({k: result[k] for k in ("median", "ratios")}, indent=1))
    for g in result.get("greedy", []):
        print(g["prompt"], "same" if g["same"] else f"parts at {g['parts_at']} (margin {g['margin']:.3f})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument(
        "--bin", type=Path, required=True, help="llama.cpp's build/bin (llama-bench, -simple, -perplexity)"
    )
    ap.add_argument(
        "--weights", choices=("fp32", "blocks"), default="blocks", help="our side (default blocks)"
    )
    ap.add_argument(
        "--gguf", type=Path, help="another file (a llama-quantize copy); default the packaged one"
    )
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="fp32: the first only")
    ap.add_argument("--runs", type=int, default=4, help="blocks: interleaved speed runs (default 4)")
    ap.add_argument("--context", type=int, default=256, help="blocks: tokens before the timed ones")
    ap.add_argument("--new", type=int, default=32, help="blocks: tokens decoded in a timed run")
    ap.add_argument(
        "--greedy", type=int, default=None, help="greedy tokens compared (0: none; fp32 32, blocks 64)"
    )
    ap.add_argument("--perplexity", type=int, default=512, help="llama-perplexity's -c (0: not scored)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.greedy is None:
        args.greedy = 32 if args.weights == "fp32" else 64
    if args.weights == "fp32":
        if not args.perplexity:
            ap.error("--weights fp32 scores perplexity: pass --perplexity C > 0")
        fp32_against_llamacpp(args)
    else:
        blocks_against_llamacpp(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
