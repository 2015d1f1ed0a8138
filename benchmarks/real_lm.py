"""What each precision, cache and head-surgery choice costs a real language model: SmolLM2-135M-Instruct
(Q4_1 GGUF dequantized to fp32) on held-out English Wikipedia.

    nice -n 10 python benchmarks/real_lm.py                   # markdown table on stdout (5-20 min on 2 cores)
    python benchmarks/real_lm.py --rows fp32,int8-g32 --json out.json

Rows: the fp32 model; ``mh.quant.quantize`` with weights bf16 / fp16 / int8 per output channel / int8
per group of 32 inputs (KV cache in the weights' float dtype), and with an int8 KV cache (fp32 weights);
raw head surgery (no recovery): ``mh.heads.to_gqa(model, 1)`` (3 kv heads mean-pooled into 1: MQA) and
``mh.heads.to_mla(model, 80)`` (a latent of 80 numbers plus 16 rotary dims of each of the 3 kv heads per
token and layer: the KV bytes of the MQA row), calibrated on training-slice token ids.

Columns: perplexity (``mh.eval.perplexity_scores``: transformers' sliding window, context 512, stride 256,
on the first 8 held-out articles of ``mh.eval.wikipedia``, 2000 characters each) with a percentile
bootstrap 95% interval over windows; the share of greedy tokens equal to the fp32 model's at the same
place (3 prompts from the training slice, 32 new tokens each, no stop ids); KV cache bytes per token
(all 30 layers).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

import multihead as mh
from multihead.nn.kv_cache import cache_bytes
from multihead.pretrained.files import atomic_write

TEXTS, CHARS, CONTEXT, STRIDE = 8, 2000, 512, 256
PROMPTS, PROMPT_CHARS, NEW_TOKENS = 3, 300, 32
MLA_RANK, CALIBRATION = 80, (4, 256)  # latent width; calibration sequences x tokens


def _kv_bytes(model: Any, kind: str = "dense") -> int:
    """KV cache bytes one token adds over all layers (int8: values and their per-token scales)."""
    if kind == "int8":
        layers = [layer.self_attn for layer in model.layers]
        return sum(
            cache_bytes(1, a.n_kv_heads, a.head_dim, a.head_dim, 1, "int8", torch.float32) for a in layers
        )
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return mh.heads.kv_cache_bytes_per_token(model, dtype)


def _calibration(model: Any) -> torch.Tensor:
    """(n, N) token ids from the training slice's first articles."""
    n, N = CALIBRATION
    texts = [a.text for a in mh.eval.wikipedia.training()[:n]]
    return torch.tensor([model.tokenizer.encode(t)[:N] for t in texts])  # (n, N)


def _quantized(**kw: Any) -> Callable[[Any], tuple[Any, int]]:
    def build(model: Any) -> tuple[Any, int]:
        q = mh.quant.quantize(model, **kw)
        return q, _kv_bytes(q, "int8" if kw.get("kv") == "int8" else "dense")

    return build


def _gqa(model: Any) -> tuple[Any, int]:
    m = mh.heads.to_gqa(copy.deepcopy(model), 1)
    return m, _kv_bytes(m)


def _mla(model: Any) -> tuple[Any, int]:
    m = mh.heads.to_mla(model, MLA_RANK, calibration=_calibration(model))
    m.tokenizer, m.eos_token_ids = model.tokenizer, model.eos_token_ids
    return m, _kv_bytes(m)


ROWS: dict[str, tuple[str, Callable[[Any], tuple[Any, int]]]] = {
    "fp32": ("fp32 weights, fp32 KV", lambda m: (m, _kv_bytes(m))),
    "bf16": ("bf16 weights, bf16 KV", _quantized(weights="bf16", kv=None)),
    "fp16": ("fp16 weights, fp16 KV", _quantized(weights="fp16", kv=None)),
    "int8-channel": ("int8 weights per channel, fp32 KV", _quantized(weights="int8", kv=None)),
    "int8-g32": ("int8 weights per 32, fp32 KV", _quantized(weights="int8", kv=None, group_size=32)),
    "kv-int8": ("fp32 weights, int8 KV", _quantized(weights=None, kv="int8")),
    "gqa-1": ("GQA 3 -> 1 kv head (mean), raw", _gqa),
    "mla-80": (f"MLA latent {MLA_RANK} + 3x16 rotary, raw", _mla),
}


def _prompts(model: Any) -> list[torch.Tensor]:
    """(1, N) ids of the first paragraph-cut ``PROMPT_CHARS`` of the first training articles."""
    texts = [mh.eval.wikipedia.excerpt(a.text, PROMPT_CHARS) for a in mh.eval.wikipedia.training()[:PROMPTS]]
    return [torch.tensor([model.tokenizer.encode(t)]) for t in texts]


def _greedy(model: Any, prompts: list[torch.Tensor]) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(p, NEW_TOKENS, eos_token_id=[])[0, p.shape[1] :].tolist() for p in prompts]


def measure(names: list[str], bootstrap: int) -> list[dict[str, Any]]:
    """One dict per row: perplexity, its interval, tokens scored, greedy agreement, KV bytes per token."""
    base = mh.pretrained.smollm2().eval()
    texts = mh.eval.wikipedia.held_out_texts(TEXTS, CHARS)
    prompts = _prompts(base)
    reference = _greedy(base, prompts)
    rows = []
    for name in names:
        what, build = ROWS[name]
        t0 = time.perf_counter()
        model, kv = build(base)
        s = mh.eval.perplexity_scores(model, texts, context=CONTEXT, stride=STRIDE, tokenizer=base.tokenizer)
        got = reference if name == "fp32" else _greedy(model, prompts)
        same = sum(a == b for g, r in zip(got, reference) for a, b in zip(g, r)) / (PROMPTS * NEW_TOKENS)
        low, high = s.interval(samples=bootstrap)
        rows.append({
            "row": name, "what": what, "perplexity": s.perplexity, "low": low, "high": high,
            "tokens": s.scored, "windows": int(s.tokens.numel()), "greedy_same": same,
            "kv_bytes_per_token": kv, "seconds": time.perf_counter() - t0,
        })  # fmt: skip
        print(f"{name}: ppl {s.perplexity:.3f} [{low:.3f}, {high:.3f}], greedy {100 * same:.0f}% same, "
              f"KV {kv} B/token ({rows[-1]['seconds']:.0f} s)", flush=True)  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    fp32_kv = next((r["kv_bytes_per_token"] for r in rows if r["row"] == "fp32"), None)
    lines = [
        "| choice | perplexity | 95% interval | greedy tokens = fp32 | KV bytes / token |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        share = f" ({r['kv_bytes_per_token'] / fp32_kv:.2f}x)" if fp32_kv else ""
        lines.append(
            f"| {r['what']} | {r['perplexity']:.2f} | [{r['low']:.2f}, {r['high']:.2f}] | "
            f"{100 * r['greedy_same']:.0f}% | {r['kv_bytes_per_token']:,}{share} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (default 1000)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = ap.parse_args()
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown or not names:
        ap.error(f"unknown rows {unknown} (choose from {', '.join(ROWS)})")
    rows = measure(names, args.bootstrap)
    first = rows[0]
    print(
        f"\nSmolLM2-135M-Instruct, {first['tokens']} tokens of {TEXTS} held-out Wikipedia articles "
        f"({first['windows']} windows of {CONTEXT}, stride {STRIDE}); torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads\n"
    )
    print(table(rows))
    if args.json:
        with atomic_write(args.json) as tmp:
            tmp.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
