"""The natural call against its explicit fast path, and against the path it took before, in one run.

    python benchmarks/natural_calls.py --threads 1                 # every part, about 5 CPU-minutes
    python benchmarks/natural_calls.py --threads 1 --only generate --preset llama-20m

Parts (each time :func:`multihead.bench.timing.measure_all`: interleaved samples, median and quartiles;
a ratio whose spreads overlap reads "same within noise"):

- encode: ``mh.pretrained.minilm().encode(texts)`` (natural: the prepacked copy it builds itself) against
  ``mh.quant.quantize(enc, weights="fp32", kv=None).encode(texts)`` (explicit) and the natural call
  with ``enc.prepack = False`` (the path before: plain ``nn.Linear``);
- generate: ``TransformerLM.to(dtype).generate`` for fp32, bf16, fp16 (natural: native decode steps in
  the model's own dtype) against ``mh.quant.quantize(lm, weights=dtype, kv=None)`` (explicit: native
  steps and the native GEMV in every linear) and ``native_steps = False`` (the eager steps before);
- attention: ``mh.attention(q, k, v)`` (auto) against ``F.scaled_dot_product_attention`` on dense
  unmasked fp32 at N=1024 and 4096 (B=1, H=8, D=64).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F

import multihead as mh
from multihead.bench import timing


def report(title: str, fns: dict[str, Callable[[], object]], peer: str, **options) -> None:
    """Time ``fns`` interleaved; print each time and its ratio to ``peer``'s."""
    t = timing.measure_all(fns, **options)
    print(f"\n{title}")
    for name, x in t.items():
        print(f"  {name:44s} {timing.time_text(x):>28s}   vs {peer}: {timing.compare(x, t[peer])}")


def encode(docs: int) -> None:
    texts = mh.pretrained.stdlib_docstrings(docs)
    natural = mh.pretrained.minilm()
    before = mh.pretrained.minilm()
    before.prepack = False
    explicit = mh.quant.quantize(mh.pretrained.minilm(), weights="fp32", kv=None)
    fns = {
        "natural: minilm().encode": lambda: natural.encode(texts),
        "explicit: quantize(weights='fp32').encode": lambda: explicit.encode(texts),
        "before: encode with prepack=False": lambda: before.encode(texts),
    }
    report(f"encode {len(texts)} docstrings", fns, "explicit: quantize(weights='fp32').encode", min_samples=3)


def generate(preset: str, prompt: int, new: int) -> None:
    base = mh.pretrained.random_lm(preset, seed=0).eval()
    ids = torch.randint(0, base.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        natural = copy.deepcopy(base).to(dtype)
        before = copy.deepcopy(natural)
        before.native_steps = False
        explicit = mh.quant.quantize(natural, weights=name, kv=None)
        fns = {
            f"natural: .to({name}).generate": lambda m=natural: m.generate(ids, new),
            f"explicit: quantize(weights='{name}').generate": lambda m=explicit: m.generate(ids, new),
            "before: native_steps=False": lambda m=before: m.generate(ids, new),
        }
        why = natural.why_not_native_steps
        title = f"generate {new} tokens, {preset} {name}, prompt {prompt} (native steps: {why or 'yes'})"
        report(title, fns, f"explicit: quantize(weights='{name}').generate", min_samples=3)


def attention() -> None:
    g = torch.Generator().manual_seed(0)
    for n in (1024, 4096):
        q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))  # (B, H, N, D)
        fns = {
            "mh.attention (auto)": lambda q=q, k=k, v=v: mh.attention(q, k, v),
            "F.scaled_dot_product_attention": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v),
        }
        report(f"dense unmasked attention, fp32, N={n}", fns, "F.scaled_dot_product_attention", min_samples=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--only", choices=["encode", "generate", "attention"], default=None)
    ap.add_argument("--preset", default="llama-20m", help="generate: the model shape (default llama-20m)")
    ap.add_argument("--prompt", type=int, default=64, help="generate: prompt tokens (default 64)")
    ap.add_argument("--new-tokens", type=int, default=32, help="generate: new tokens (default 32)")
    ap.add_argument("--docs", type=int, default=128, help="encode: docstrings (default 128)")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    if args.only in (None, "encode"):
        encode(args.docs)
    if args.only in (None, "generate"):
        generate(args.preset, args.prompt, args.new_tokens)
    if args.only in (None, "attention"):
        attention()


if __name__ == "__main__":
    main()
