"""``multihead generate``: greedy or sampled generation from a checkpoint or a random-weights preset.

    multihead generate                                    llama-tiny preset, 16 random prompt tokens
    multihead generate --preset llama-155m --prompt-len 256 --max-new-tokens 64     decode speed
    multihead generate --model DIR --prompt "Once upon"   a save_pretrained() directory (GPT-2, LLaMA,
                                                          Mistral, Qwen2, DeepSeek-V3) or a `heads
                                                          convert` folder; text needs DIR/tokenizer.json
    multihead generate --model smollm2 --prompt "Once"    the packaged SmolLM2-135M-Instruct (or a .gguf
                                                          file): prints text, stops at its end of turn
    multihead generate --preset llama-155m --weights bf16 an inference copy in bf16 with native decode
                                                          steps where the model allows them
    multihead generate --preset llama-155m --weights int8 int8 weights, a scale per 32 (--group-size):
                                                          native VNNI steps, prompts and batches

Prints the new tokens and the speed: prefill time and decode tokens/s (one-token steps on the KV cache),
each the median of generations repeated until they are long enough to time (a few times the one run
the tokens need), with its spread (for the rate: the rates its time's spread allows), or "n/a" with
the reason and the option that gives a figure (a difference inside the noise, a spread wider than 10x).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .threads import threads_option

if TYPE_CHECKING:
    from ..bench.timing import Checked, Timing

__all__ = ["register"]


def _model(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """(TransformerLM, tokenizer or None, description)."""
    from ..pretrained import random_lm
    from .models import load_lm

    if args.model is None:
        return random_lm(args.preset, seed=args.seed), None, f"preset {args.preset} (random weights)"
    return load_lm(args.model)  # smollm2, a .gguf file, a save_pretrained or `heads convert` folder


def _group(text: str | None) -> int | None:
    """--group-size: inputs per int8 weight scale (default 32), or "row" for one scale per output row."""
    if text is None:
        return 32
    if text == "row":
        return None
    n = int(text) if text.isdigit() else 0
    if n != 32 and (n <= 0 or n % 64 != 0):
        raise ValueError(f"--group-size takes 32, 64 (or another multiple of 64) or row, got {text!r}")
    return n


def _check_sizes(args: argparse.Namespace, lm: Any, n: int) -> None:
    """Refuse, before any tensor is built, a prompt of ``n`` tokens and a batch that the model's
    positions or the free memory cannot hold.

    Raises:
        ValueError: prompt + new tokens past the model's max_len, or the ids, one hidden state per
            prompt token and the dense KV cache of the whole batch larger than the free memory.
    """
    from ..core.limits import check_fits
    from ..heads import kv_cache_bytes_per_token

    total = n + args.max_new_tokens
    where = "--prompt-len" if args.prompt is None and args.prompt_ids is None else "the prompt"
    limit = getattr(lm, "max_len", None)
    if isinstance(limit, int) and total > limit:
        raise ValueError(
            f"{where} ({n} tokens) + --max-new-tokens {args.max_new_tokens} = {total} positions exceed "
            f"the model's max_len={limit}; ask for at most {limit} positions in all"
        )
    width = getattr(getattr(lm, "embed", None), "embedding_dim", 0)
    per_token = 16 + 4 * width  # the ids in and out (int64), a hidden state (fp32)
    if args.cache == "dense":
        per_token += kv_cache_bytes_per_token(lm)
    check_fits(
        args.batch * total * per_token,
        f"--batch {args.batch} x {total} positions (the ids, a hidden state and the KV cache)",
        "lower --batch, --prompt-len or --max-new-tokens",
    )


def _prompt(args: argparse.Namespace, lm: Any, tokenizer: Any) -> torch.Tensor:
    """The prompt ids (batch, N), after :func:`_check_sizes`."""
    vocab = lm.vocab_size
    ids: list[int] | None = None
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError(
                "--prompt TEXT needs a --model directory with tokenizer.json, smollm2 or a .gguf file "
                "(a model with a tokenizer); use --prompt-ids"
            )
        encoded = tokenizer.encode(args.prompt)  # a GGUF model's ids, or a tokenizers Encoding
        ids = list(getattr(encoded, "ids", encoded))
    elif args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",")]
        except ValueError:
            raise ValueError(
                f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}"
            ) from None
    _check_sizes(args, lm, args.prompt_len if ids is None else len(ids))
    if ids is None:
        g = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
    if not ids or min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"prompt ids must be 1 or more integers in [0, {vocab}), got {ids[:8]}...")
    return torch.tensor(ids).repeat(args.batch, 1)  # (batch, N)


def _timed(
    lm: Any, ids: torch.Tensor, args: argparse.Namespace, clock: Callable[[], float] = time.perf_counter
) -> tuple[torch.Tensor, Timing, Timing]:
    """Generate; return the ids, the time of the prefill (prompt + first token) and of the decode steps
    after it. Both through :func:`multihead.bench.timing.measure_all`: ``generate(ids, 1)`` and
    ``generate(ids, n)`` repeated, interleaved, until their samples are long enough for ``clock`` and
    the scheduler; the decode steps are their difference, "too short to measure" inside the noise.
    """
    from ..bench import timing

    kw: dict[str, Any] = {"cache": args.cache}
    if not args.sample and (args.temperature != 1.0 or args.top_k is not None or args.top_p is not None):
        raise ValueError("--temperature, --top-k and --top-p apply only with --sample")
    if args.sample and not args.temperature > 0:
        raise ValueError(
            f"--temperature must be > 0, got {args.temperature}; for greedy decoding drop --sample "
            "(greedy is the default)"
        )
    if args.sample:
        kw.update(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    last: list[torch.Tensor] = []

    def run(n: int) -> Callable[[], None]:
        def call() -> None:
            torch.manual_seed(args.seed)  # every call samples the same tokens
            out = lm.generate(ids, n, **kw)  # (batch, N + n)
            if n == args.max_new_tokens:
                last[:] = [out]

        return call

    t = timing.measure_all({"prefill": run(1), "all": run(args.max_new_tokens)}, min_samples=3, clock=clock)
    if not last:  # a clock that never moved: nothing was timed, but the tokens are still wanted
        run(args.max_new_tokens)()
    return last[0], t["prefill"], timing.difference(t["all"], t["prefill"])


def _decode_figure(decode: Timing, steps: int, args: argparse.Namespace, room: int | None = None) -> Checked:
    """Decode tokens/s of ``steps`` steps after the first token (for every row of the batch), checked
    (:func:`multihead.bench.timing.rate_figure`): "n/a (why; the option that gives a figure)" for one
    token, a difference inside the noise or a spread wider than 10x; the tokens it suggests fit in
    ``room`` (the model's positions after the prompt) when given."""
    from ..bench import timing

    if steps <= 0:
        return timing.check_figure(
            None, why="one token: no decode step", fix="pass --max-new-tokens 2 or more"
        )
    more = max(4 * args.max_new_tokens, 64)
    if room is not None and room > args.max_new_tokens:  # no more than the model's positions hold
        more = min(more, room)
    fix = f"pass --max-new-tokens {more}: more decode steps per timed call set them apart from the prefill"
    return timing.rate_figure(decode, steps * args.batch, fix=fix)


def _prefill_text(prefill: Timing) -> str:
    """The prefill's milliseconds with their spread, checked like the rate (:func:`_decode_figure`)."""
    from ..bench import timing

    ms = None if prefill.median is None else prefill.median * 1e3
    low, high = (None, None) if prefill.low is None else (prefill.low * 1e3, (prefill.high or 0) * 1e3)
    fix = "pass --prompt-len 256: a longer prefill is long enough for the clock"
    return timing.check_figure(ms, low, high, why=prefill.why, fix=fix).text(".3g", unit="ms")


def _cmd_generate(args: argparse.Namespace) -> int:
    """Load or build the model, generate, print tokens (and text) and speed."""
    from rich.console import Console

    if args.group_size is not None and args.weights != "int8":
        given = "no --weights was given" if args.weights is None else f"not to --weights {args.weights}"
        raise ValueError(f"--group-size applies to --weights int8; {given}")
    lm, tokenizer, what = _model(args)
    ids = _prompt(args, lm, tokenizer)  # before the weights are converted: sizes are checked first
    native_steps = None
    params = sum(p.numel() for p in lm.parameters())  # before any int8 weights become buffers
    if args.weights is not None:
        from ..models import quant

        int8 = args.weights == "int8"
        group = _group(args.group_size) if int8 else None
        # kernel "auto": native where it builds; group None: the float formats' (and int8's per row)
        lm = quant.quantize(lm, weights=args.weights, kv=None, group_size=group)
        native_steps = lm.why_not_native_steps or "yes"
        scales = "" if not int8 else " (a scale per row)" if group is None else f" (groups of {group})"
        what = f"{what}, {args.weights} weights{scales}"
    with Console(stderr=True).status(f"generating {args.max_new_tokens} tokens with {what}"):
        out, prefill, decode = _timed(lm, ids, args)
    new = out[:, ids.shape[1] :]  # (batch, new)
    limit = getattr(lm, "max_len", None)
    room = limit - ids.shape[1] if isinstance(limit, int) else None
    rate = _decode_figure(decode, new.shape[1] - 1, args, room)
    doc: dict[str, Any] = {
        "model": what,
        "params": params,
        "cache": args.cache,
        "weights": args.weights,
        "native_steps": native_steps,
        "batch": args.batch,
        "prompt_tokens": ids.shape[1],
        "new_tokens": new.shape[1],
        "prefill_s": prefill.median,
        "prefill_spread_s": [prefill.low, prefill.high],
        "decode_s": decode.median,
        "decode_tokens_per_s": rate.value,
        "decode_tokens_per_s_spread": None if rate.low is None else [rate.low, rate.high],
        "decode_note": None if rate.ok else rate.text(),
        "tokens": new.tolist(),
    }
    if tokenizer is not None:
        doc["text"] = [tokenizer.decode(row) for row in new.tolist()]
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    from .console import make_console

    console = make_console()
    for r, row in enumerate(doc.get("text") or new.tolist()):
        console.print(f"[{r}] {row}", markup=False)
    said = rate.text(unit="tokens/s")
    if native_steps is not None:
        said += f" (native steps: {native_steps})"
    console.print(
        f"{what}: {doc['params'] / 1e6:.1f}M params, {args.cache} cache, batch {args.batch}; prefill of "
        f"{ids.shape[1]} tokens + first token {_prefill_text(prefill)}; decode {said}",
        markup=False,
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``generate`` subcommand to the ``multihead`` parser."""
    from ..nn.kv_cache import KINDS
    from ..pretrained import PRESETS
    from .args import positive_int, real, seed

    p = sub.add_parser(
        "generate",
        help="generate tokens from a checkpoint directory or a random-weights preset; prints tokens/s",
        description="Prefill the prompt in one pass, then decode one token per step on a preallocated KV "
        "cache; the speed is the median of repeated generations, with its spread. --model takes "
        "smollm2 (the packaged SmolLM2-135M-Instruct), a .gguf file or a save_pretrained() directory "
        "(config.json + model.safetensors) of GPT-2, LLaMA, Mistral or Qwen2; without it a preset with "
        "random weights runs. A model with a tokenizer prints text and stops at its end of turn.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        metavar="M",
        help="smollm2, a .gguf file, a Hugging Face checkpoint directory or a `heads convert` folder",
    )
    src.add_argument("--preset", choices=list(PRESETS), default="llama-tiny", help="(default llama-tiny)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text (needs a model with a tokenizer)")
    prompt.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, comma-separated")
    p.add_argument("--prompt-len", type=positive_int, default=16, help="random prompt length (default 16)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="(default 32)")
    p.add_argument("--batch", type=positive_int, default=1, help="copies of the prompt decoded together")
    p.add_argument("--cache", choices=list(KINDS), default="dense", help="KV cache kind (default dense)")
    p.add_argument(
        "--weights",
        choices=["fp32", "bf16", "fp16", "int8"],
        default=None,
        help="decode an inference copy in this format, batch-1 steps native where the model allows "
        "(mh.quant.quantize(lm, weights=..., kv=None)); default: the model as loaded",
    )
    p.add_argument(
        "--group-size",
        metavar="N",
        default=None,
        help="with --weights int8: inputs per weight scale, 32 (default), 64 or another multiple of 64, or "
        "row for one scale per output row",
    )
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=real(), default=1.0, help="sampling temperature (with --sample)")
    p.add_argument("--top-k", type=positive_int, default=None, help="sample among the k best (with --sample)")
    p.add_argument(
        "--top-p", type=real(0.0, 1.0, lo_open=True), default=None,
        help="nucleus sampling mass in (0, 1] (with --sample)",
    )  # fmt: skip
    p.add_argument(
        "--seed",
        type=seed,
        default=0,
        help="seed of the weights, the prompt and sampling (0 to 4294967295, default 0)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_generate)
    threads_option(p)
