"""Greedy decoding with and without the native greedy run, interleaved in one process.

    python benchmarks/native_greedy_ab.py --precision int8 --threads 1 --rounds 3

Quantizes a ``--preset`` model (random weights) for native decode steps and times ``generate`` of
``--new-tokens`` after a ``--context``-token prompt, once as the library runs it (batch-1 greedy tokens
picked up to 8 per native call, :meth:`multihead.TransformerLM.greedy_steps`) and once with that run
turned off on the same model (the step-by-step loop: the output head, the argmax and one native decode
step per token from Python). A token's time is ``(t(new) - t(1)) / (new - 1)`` (the prefill cancels),
each time the fastest of at least 3 interleaved samples (:func:`multihead.bench.timing.measure_all`), and
"of limit" its rate over the bytes a step reads (:func:`multihead.bench.decode.step_bytes`) against
:func:`multihead.bench.decode.read_bandwidth` probed in the same round. Both ways give the same tokens
(checked first).
"""

from __future__ import annotations

import argparse
import functools

import torch

import multihead as mh
from multihead.bench import decode, timing
from multihead.models import quant

PRECISIONS = {
    "fp32": {"weights": "fp32", "kv": None},
    "bf16": {"weights": "bf16", "kv": None},
    "fp16": {"weights": "fp16", "kv": None},
    "int8": {"weights": "int8", "kv": "int8", "group_size": 32},
}


def build(preset: str, precision: str) -> torch.nn.Module:
    """The ``preset`` model (random weights, seed 0) quantized for native decode steps."""
    torch.manual_seed(0)
    return quant.quantize(mh.pretrained.random_lm(preset), kernel="native", **PRECISIONS[precision])


def generate(model: torch.nn.Module, prompt: torch.Tensor, n: int, run: bool) -> torch.Tensor:
    """``model.generate(prompt, n)`` with the native greedy run on or off."""
    if not run:
        model.greedy_steps = lambda *args: None  # type: ignore[method-assign]  # the step-by-step loop
    try:
        return model.generate(prompt, n)
    finally:
        if not run:
            del model.greedy_steps


def one_round(model: torch.nn.Module, prompt: torch.Tensor, new: int, samples: int = 3) -> dict:
    """ms a token with the run on and off, and each as a fraction of this round's read limit."""
    calls = {
        f"{k}{n}": functools.partial(generate, model, prompt, n, k == "on")
        for k in ("on", "off")
        for n in (1, new)
    }
    t = timing.measure_all(calls, min_samples=samples)
    nbytes = decode.step_bytes(model, "embed")
    limit = decode.read_bandwidth(nbytes, reps=3)
    out = {}
    for k in ("on", "off"):
        one, many = t[f"{k}1"].best, t[f"{k}{new}"].best
        step = None if one is None or many is None or many <= one else (many - one) / (new - 1)
        out[k] = {
            "ms": None if step is None else step * 1e3,
            "of_limit": None if step is None else nbytes / step / limit,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-155m")
    p.add_argument("--precision", default="int8", choices=list(PRECISIONS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=33)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.preset, args.precision)
    prompt = torch.randint(4, model.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        if not torch.equal(generate(model, prompt, 16, True), generate(model, prompt, 16, False)):
            raise SystemExit("the native greedy run and the step-by-step loop gave different tokens")
        for r in range(args.rounds):
            got = one_round(model, prompt, args.new_tokens)
            cells = []
            for k in ("on", "off"):
                ms, frac = got[k]["ms"], got[k]["of_limit"]
                cells.append(f"{k} " + ("-" if ms is None else f"{ms:.2f} ms ({frac:.0%} of limit)"))
            print(f"{args.precision}, {args.threads} thread(s), round {r + 1}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
