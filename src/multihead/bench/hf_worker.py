"""The worker process of ``multihead bench hf``: one attention implementation, one loaded model, requests
as JSON lines (``python -m multihead.bench.hf_worker --worker IMPL MAX_LEN THREADS``).

:func:`build_model` is the benchmark's Mistral-shaped random-weight model; :func:`serve` answers
``{"op": "prefill" | "decode", ...}`` requests on stdin with the seconds of one call
(:func:`multihead.bench.timing.first_call`), the peak resident set above the loaded model and how many
calls our attention function saw. :mod:`multihead.bench.hf` starts one per implementation and asks it.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

import torch

from . import timing

__all__ = ["D_MODEL", "FLOOR", "HEADS", "LAYERS", "VOCAB", "WARM", "WINDOW", "build_model", "serve"]

FLOOR = "floor"  # an attention that computes nothing: the model's own activations, the floor of any impl
WINDOW = 1024
VOCAB = 1024
LAYERS, D_MODEL, HEADS = 2, 512, 8
WARM = 256  # tokens of the warm-up prefill each worker runs before its first measurement


def build_model(max_len: int) -> Any:
    """The benchmark's Mistral-shaped random-weight causal LM (attn_implementation "sdpa"; switch it with
    ``model.set_attn_implementation``), with multihead registered as "multihead".

    Raises:
        ImportError: when transformers is not installed.
    """
    import transformers

    from ..hf import register

    register()
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=1408,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        sliding_window=WINDOW,
        max_position_embeddings=max_len,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _ids(n: int, seed: int, low: int = 0) -> torch.Tensor:
    return torch.randint(low, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))  # (1, n)


def serve(impl: str, max_len: int, threads: int) -> None:
    """Serve ``{"op": "prefill" | "decode", ...}`` requests on stdin, one JSON answer per line on the real
    stdout (anything else the libraries print goes to stderr)."""
    from .approx import peak_rss_tracker

    answer: TextIO = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # library chatter on fd 1 must not corrupt the answers
    torch.set_num_threads(threads)
    model = build_model(max_len)
    if impl == FLOOR:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        from ..hf import mask_interface

        AttentionInterface.register(FLOOR, _no_attention)
        AttentionMaskInterface.register(FLOOR, mask_interface)
    model.set_attn_implementation(impl)
    from ..hf import register

    counter = register()  # the function "multihead" runs: its calls prove our backend ran
    warmed: set[int] = set()  # prefill lengths warmed up
    decode_warm = False
    for line in sys.stdin:
        req = json.loads(line)
        try:
            with torch.no_grad():
                if req["op"] == "prefill":
                    n = int(req["n"])
                    warm = n if impl == "flex_attention" else WARM  # flex compiles per shape
                    if warm not in warmed:
                        model.model(input_ids=_ids(min(warm, n), 3), use_cache=False)
                        warmed.add(warm)
                    ids = _ids(n, 1)
                    gc.collect()
                    extra = peak_rss_tracker()
                    forward = _counted(counter, functools.partial(_hidden, model, ids))  # (1, n, d)
                    h, t = timing.first_call(forward)
                    peak = None if extra is None else extra()
                    if req.get("save"):
                        torch.save(h, req["save"])
                    res: dict[str, Any] = {
                        "seconds": t.median,
                        "why": t.why,
                        "peak_bytes": peak,
                        "finite": bool(torch.isfinite(h).all()),
                        "calls": forward.first_calls,  # type: ignore[attr-defined]
                    }
                    del h
                else:
                    prompt, new = int(req["prompt"]), int(req["new"])
                    if not decode_warm:
                        _generate(model, _ids(16, 2, low=1), 4)
                        decode_warm = True
                    gen = _counted(counter, functools.partial(_generate, model, _ids(prompt, 2, low=1), new))
                    tokens, t = timing.first_call(gen)
                    res = {
                        "seconds": t.median,
                        "why": t.why,
                        "tokens": tokens,
                        "calls": gen.first_calls,  # type: ignore[attr-defined]
                    }
        except Exception as e:  # reported in the table: flex refusing CPU shapes, out of memory, ...
            res = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e) else ''}"}
        answer.write(json.dumps(res) + "\n")
        answer.flush()


def _hidden(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The last hidden state (1, n, d) of a prefill of ``ids`` (1, n), without a cache."""
    return model.model(input_ids=ids, use_cache=False).last_hidden_state  # (1, n, d)


def _counted(counter: Any, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` that keeps, as ``first_calls``, how many calls ``counter`` (our attention function) saw
    during its first call: :func:`timing.first_call` may call it again where one call is too short."""

    def call() -> Any:
        before = counter.calls
        out = fn()
        if not hasattr(call, "first_calls"):
            call.first_calls = counter.calls - before  # type: ignore[attr-defined]
        return out

    return call


def _no_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any, **kw: Any
) -> tuple[torch.Tensor, None]:
    """The floor row's attention: only the (B, Sq, Hq, Dv) output buffer every implementation returns."""
    B, H, S, _ = query.shape
    return query.new_zeros(B, S, H, value.shape[-1]), None  # (B, Sq, Hq, Dv)


def _generate(model: Any, prompt: torch.Tensor, new: int) -> list[int]:
    """The tokens of a greedy ``generate`` of exactly ``new`` tokens after ``prompt`` (1, P). Token 0 is
    the pad id handed to generate, so prompts draw from 1..VOCAB-1."""
    out = model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )  # (1, P + new)
    return list(out[0, prompt.shape[1] :].tolist())


def _main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="worker of multihead bench hf (not for direct use)")
    ap.add_argument("--worker", nargs=3, metavar=("IMPL", "MAX_LEN", "THREADS"), required=True)
    args = ap.parse_args(argv)
    impl, max_len, threads = args.worker
    serve(impl, int(max_len), int(threads))


if __name__ == "__main__":
    _main()
